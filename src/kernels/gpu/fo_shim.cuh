// One source, two compilers: this header lets the host C++ compiler build the kernel
// text that NVRTC builds for the GPU, with the same IEEE f32 operations on both.
// GPU: NVRTC with --fmad=false, so only the fused multiply-adds written as fo_fma fuse.
// Host: any C++17 compiler with -ffp-contract=off (the host-shim test builds it so).
#pragma once

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define FO_GPU 1
#define FO_HD __host__ __device__ __forceinline__
#define FO_GLOBAL extern "C" __global__
#if defined(__CUDACC_RTC__)
// NVRTC ships no C library headers: the fixed-width types the kernels use.
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif
// Correctly rounded division and square root whatever -prec-div/-prec-sqrt say.
FO_HD float fo_div(float a, float b) { return __fdiv_rn(a, b); }
FO_HD float fo_sqrt(float a) { return __fsqrt_rn(a); }
// A written fused multiply-add is inline PTX, so the checks (scripts/nvrtc_check.py, the
// nvrtc tests) can tell it from one the compiler contracted: every fma.rn.f32 of the PTX
// must sit inside an inline-asm block, however many times the kernel inlines the rules.
FO_HD float fo_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  float d;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
  return d;
#else
  return __fmaf_rn(a, b, c);
#endif
}
FO_HD float fo_floor(float a) { return floorf(a); }
FO_HD float fo_trunc(float a) { return truncf(a); }
FO_HD float fo_abs(float a) { return fabsf(a); }
FO_HD float fo_copysign(float a, float s) { return copysignf(a, s); }
FO_HD float fo_maxnum(float a, float b) { return fmaxf(a, b); }
FO_HD uint32_t fo_bits(float x) { return __float_as_uint(x); }
FO_HD float fo_from_bits(uint32_t b) { return __uint_as_float(b); }
// The lanes of a scale group run in parallel, one per thread; the max of a value over the
// group's L lanes (L a power of two dividing 32) is a shuffle tree among those lanes only,
// so each group may leave the kernel's loop on its own (its lanes must reach it together).
#define FO_LOCKSTEP 0
template <unsigned L>
__device__ __forceinline__ uint32_t fo_lanes_max(uint32_t x) {
  unsigned lane = threadIdx.x & 31u;
  unsigned mask = L == 32 ? 0xffffffffu : ((1u << (L % 32)) - 1u) << (lane & ~(L - 1u));
  for (unsigned o = L / 2; o > 0; o >>= 1) {
    uint32_t y = __shfl_xor_sync(mask, x, o);
    x = y > x ? y : x;
  }
  return x;
}
// 4, 8 or 16 bytes (`bytes`) in one load or store instruction (ld/st .u32, .v2.u32,
// .v4.u32) as 32-bit words; the address must be aligned to `bytes` or the access faults,
// so callers check the addresses first (fo_vec.cuh).
FO_HD void fo_vload(const void* p, int bytes, uint32_t* w) {
  if (bytes == 16) {
    uint4 v = *(const uint4*)p;
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if (bytes == 8) {
    uint2 v = *(const uint2*)p;
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = *(const uint32_t*)p;
  }
}
FO_HD void fo_vstore(void* p, int bytes, const uint32_t* w) {
  if (bytes == 16)
    *(uint4*)p = make_uint4(w[0], w[1], w[2], w[3]);
  else if (bytes == 8)
    *(uint2*)p = make_uint2(w[0], w[1]);
  else
    *(uint32_t*)p = w[0];
}
#define FO_UNROLL _Pragma("unroll")
#define FO_NO_UNROLL _Pragma("unroll 1")
// fo's launches use blocks of whole warps (BLOCK = 128 in src/device/cuda).
__device__ __forceinline__ void fo_require_warp_blocks() {}
#else
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#define FO_HOST_SHIM 1
#define FO_HD inline
#define FO_GLOBAL inline
#define __device__
#define __restrict__
FO_HD float fo_div(float a, float b) { return a / b; }
FO_HD float fo_sqrt(float a) { return std::sqrt(a); }
FO_HD float fo_fma(float a, float b, float c) { return std::fma(a, b, c); }
FO_HD float fo_floor(float a) { return std::floor(a); }
FO_HD float fo_trunc(float a) { return std::trunc(a); }
FO_HD float fo_abs(float a) { return std::fabs(a); }
FO_HD float fo_copysign(float a, float s) { return std::copysign(a, s); }
FO_HD float fo_maxnum(float a, float b) { return std::fmax(a, b); }
FO_HD uint32_t fo_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
FO_HD float fo_from_bits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}
// A scale group on the host: the thread of its first lane runs all of the group's lanes
// in lockstep (the others return), so a value's max over the group's lanes is the max its
// own loop took: identity.
#define FO_LOCKSTEP 1
template <unsigned L>
inline uint32_t fo_lanes_max(uint32_t x) {
  return x;
}
// Vector accesses of 4, 8 or 16 bytes. A GPU faults on one not aligned to its size, so the
// host build aborts on it too, naming the address: a host test with misaligned tensors
// proves the kernels check the addresses before taking the vector path. Each thread
// counts its vector accesses, so a test with aligned tensors proves the vector path is
// taken.
inline thread_local uint64_t fo_vec_loads = 0, fo_vec_stores = 0;
inline void fo_vec_check(const void* p, int bytes, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % (uintptr_t)bytes == 0) return;
  std::fprintf(stderr, "fo_shim: misaligned %d-byte %s at %p (a fault on a GPU)\n", bytes, what, p);
  std::abort();
}
inline void fo_vload(const void* p, int bytes, uint32_t* w) {
  fo_vec_check(p, bytes, "load");
  ++fo_vec_loads;
  std::memcpy(w, p, (size_t)bytes);
}
inline void fo_vstore(void* p, int bytes, const uint32_t* w) {
  fo_vec_check(p, bytes, "store");
  ++fo_vec_stores;
  std::memcpy(p, w, (size_t)bytes);
}
#define FO_UNROLL
#define FO_NO_UNROLL
// Thread indices of the launch being emulated: fo_host_launch runs every (block, thread)
// in turn. The order is free: the one thing a block shares, the step kernel's code tables
// (filled in shared memory before the entry's one barrier on the GPU), is one copy filled
// once for the process here (FO_CODE_TABLES, fo_quant8.cuh); the step kernel needs blocks
// of whole warps, as on the GPU.
struct fo_dim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline thread_local fo_dim3 threadIdx, blockIdx, blockDim, gridDim;
inline void fo_require_warp_blocks() {
  if (blockDim.x % 32 != 0) std::abort();
}
template <class F>
inline void fo_host_launch(unsigned grid, unsigned block, F&& kernel) {
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned b = 0; b < grid; ++b)
    for (unsigned t = 0; t < block; ++t) {
      blockIdx.x = b;
      threadIdx.x = t;
      kernel();
    }
}
#endif

FO_HD bool fo_isnan(float x) { return (fo_bits(x) & 0x7fffffffu) > 0x7f800000u; }
// floor(a / 2) for any sign (Rust's div_euclid by 2).
FO_HD int32_t fo_floor_half(int32_t a) { return a >= 0 ? a / 2 : -((1 - a) / 2); }

// Multi-tensor apply: the row of a launch table that holds global work item i, the last
// row whose `Begin` field (a running sum over the rows, in order) is <= i.
template <class Row, uint64_t Row::*Begin>
FO_HD int fo_find_row(const Row* table, int count, uint64_t i) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (table[mid].*Begin <= i)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}
