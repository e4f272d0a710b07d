// A lane's range of FO_VEC consecutive elements of one array, moved between memory and
// 32-bit words (one element per word, zero-extended) in 16-byte vector accesses where the
// range allows, else one element at a time. The math never sees the difference: it reads
// and writes the words, so the bits do not depend on the path taken.
//
// A misaligned vector access faults on a GPU, so the choice is made on the actual
// addresses at run time (fo_aligned16; a shard of a flat buffer may start anywhere), by
// the caller for every range: a range is moved in vectors only when it is whole (FO_VEC
// elements, so never a tensor's tail) and its array starts 16-byte aligned. FO_VEC elements of 1, 2 or
// 4 bytes are then 1, 2 or 4 whole vectors, each at an offset that is a multiple of 16.
#pragma once
#include "fo_shim.cuh"

#define FO_VEC 16

FO_HD bool fo_aligned16(const void* p) { return ((unsigned long long)p & 15ull) == 0; }

// One vector of `size`-byte elements, little-endian (as both the GPU and the host store
// them), to and from one word per element.
FO_HD void fo_vec_unpack(uint32_t* d, fo_vec16 w, int size) {
  uint32_t x[4] = {w.x, w.y, w.z, w.w};
  FO_UNROLL
  for (int i = 0; i < 4; ++i) {
    if (size == 4) {
      d[i] = x[i];
    } else if (size == 2) {
      d[2 * i] = x[i] & 0xffffu;
      d[2 * i + 1] = x[i] >> 16;
    } else {
      d[4 * i] = x[i] & 0xffu;
      d[4 * i + 1] = (x[i] >> 8) & 0xffu;
      d[4 * i + 2] = (x[i] >> 16) & 0xffu;
      d[4 * i + 3] = x[i] >> 24;
    }
  }
}

FO_HD fo_vec16 fo_vec_pack(const uint32_t* d, int size) {
  uint32_t x[4];
  FO_UNROLL
  for (int i = 0; i < 4; ++i) {
    if (size == 4)
      x[i] = d[i];
    else if (size == 2)
      x[i] = (d[2 * i] & 0xffffu) | (d[2 * i + 1] << 16);
    else
      x[i] = (d[4 * i] & 0xffu) | ((d[4 * i + 1] & 0xffu) << 8) | ((d[4 * i + 2] & 0xffu) << 16) | (d[4 * i + 3] << 24);
  }
  return fo_vec16{x[0], x[1], x[2], x[3]};
}

// Loads elements [e0, e0 + n) of `src` (`size` bytes each) into d[0..n); with `vec`
// (n == FO_VEC, src 16-byte aligned) as `size` vectors.
FO_HD void fo_gather(uint32_t* d, const void* src, int size, uint64_t e0, int n, bool vec) {
  if (vec) {
    const char* b = (const char*)src + e0 * (uint64_t)size;
    FO_NO_UNROLL
    for (int j = 0; j < size; ++j) fo_vec_unpack(d + j * (16 / size), fo_vload(b + 16 * j), size);
    return;
  }
  FO_NO_UNROLL
  for (int k = 0; k < n; ++k) {
    uint64_t i = e0 + k;
    d[k] = size == 4 ? ((const uint32_t*)src)[i] : size == 2 ? ((const uint16_t*)src)[i] : ((const uint8_t*)src)[i];
  }
}

// Stores d[0..n) (each word's low `size` bytes) as elements [e0, e0 + n) of `dst`; with
// `vec` as `size` vectors.
FO_HD void fo_scatter(void* dst, const uint32_t* d, int size, uint64_t e0, int n, bool vec) {
  if (vec) {
    char* b = (char*)dst + e0 * (uint64_t)size;
    FO_NO_UNROLL
    for (int j = 0; j < size; ++j) fo_vstore(b + 16 * j, fo_vec_pack(d + j * (16 / size), size));
    return;
  }
  FO_NO_UNROLL
  for (int k = 0; k < n; ++k) {
    uint64_t i = e0 + k;
    if (size == 4) ((uint32_t*)dst)[i] = d[k];
    if (size == 2) ((uint16_t*)dst)[i] = (uint16_t)d[k];
    if (size == 1) ((uint8_t*)dst)[i] = (uint8_t)d[k];
  }
}
