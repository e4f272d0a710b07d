// A lane's range of FO_VEC = 4 consecutive elements of one array, moved between memory and
// 32-bit words (one element per word, zero-extended) in one access of 4 * size bytes
// (4 f32: 16 bytes; 4 halves: 8; 4 int8 codes: 4) where the range allows, else one element
// at a time. The math never sees the difference: it reads and writes the words, so the bits
// do not depend on the path taken.
//
// Four elements a lane, as torch's multi-tensor apply takes them: a warp's 32 lanes then
// cover 32 consecutive ranges, so each of its accesses is one contiguous block of memory,
// and the lane's arrays are few enough to stay in registers with every loop unrolled (the
// earlier 16 elements a lane kept them in a 448-byte local-memory frame per thread).
//
// A misaligned vector access faults on a GPU, so the choice is made on the actual
// addresses at run time (fo_aligned16; a shard of a flat buffer may start anywhere), by
// the caller for every range: a range is moved in one access only when it is whole
// (FO_VEC elements, so never a tensor's tail) and its array starts 16-byte aligned. A
// range then starts at a multiple of 4 * size bytes, the access's own alignment.
#pragma once
#include "fo_shim.cuh"

#define FO_VEC 4

FO_HD bool fo_aligned16(const void* p) { return ((unsigned long long)p & 15ull) == 0; }

// The FO_VEC elements of `size` bytes in words w (little-endian, as both the GPU and the
// host store them), one element per word of d, and back.
FO_HD void fo_words_unpack(uint32_t* d, const uint32_t* w, int size) {
  if (size == 4) {
    FO_UNROLL
    for (int i = 0; i < 4; ++i) d[i] = w[i];
  } else if (size == 2) {
    FO_UNROLL
    for (int i = 0; i < 2; ++i) d[2 * i] = w[i] & 0xffffu, d[2 * i + 1] = w[i] >> 16;
  } else {
    FO_UNROLL
    for (int i = 0; i < 4; ++i) d[i] = (w[0] >> (8 * i)) & 0xffu;
  }
}

FO_HD void fo_words_pack(uint32_t* w, const uint32_t* d, int size) {
  if (size == 4) {
    FO_UNROLL
    for (int i = 0; i < 4; ++i) w[i] = d[i];
  } else if (size == 2) {
    FO_UNROLL
    for (int i = 0; i < 2; ++i) w[i] = (d[2 * i] & 0xffffu) | (d[2 * i + 1] << 16);
  } else {
    w[0] = (d[0] & 0xffu) | ((d[1] & 0xffu) << 8) | ((d[2] & 0xffu) << 16) | (d[3] << 24);
  }
}

// Loads elements [e0, e0 + n) of `src` (`size` bytes each) into d[0..n); with `vec`
// (n == FO_VEC, src 16-byte aligned) as one access. Loops are unrolled over constant
// bounds (n only guards), so d's indices are constants and d stays in registers.
FO_HD void fo_gather(uint32_t* d, const void* src, int size, uint64_t e0, int n, bool vec) {
  if (vec) {
    uint32_t w[4];
    fo_vload((const char*)src + e0 * (uint64_t)size, FO_VEC * size, w);
    fo_words_unpack(d, w, size);
    return;
  }
  FO_UNROLL
  for (int k = 0; k < FO_VEC; ++k) {
    if (k >= n) break;
    uint64_t i = e0 + k;
    d[k] = size == 4 ? ((const uint32_t*)src)[i] : size == 2 ? ((const uint16_t*)src)[i] : ((const uint8_t*)src)[i];
  }
}

// Stores d[0..n) (each word's low `size` bytes) as elements [e0, e0 + n) of `dst`; with
// `vec` as one access.
FO_HD void fo_scatter(void* dst, const uint32_t* d, int size, uint64_t e0, int n, bool vec) {
  if (vec) {
    uint32_t w[4];
    fo_words_pack(w, d, size);
    fo_vstore((char*)dst + e0 * (uint64_t)size, FO_VEC * size, w);
    return;
  }
  FO_UNROLL
  for (int k = 0; k < FO_VEC; ++k) {
    if (k >= n) break;
    uint64_t i = e0 + k;
    if (size == 4) ((uint32_t*)dst)[i] = d[k];
    if (size == 2) ((uint16_t*)dst)[i] = (uint16_t)d[k];
    if (size == 1) ((uint8_t*)dst)[i] = (uint8_t)d[k];
  }
}
