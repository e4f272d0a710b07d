// Gradient norms and the clip's scaling on the device (fo_clip_grad_norm with device
// gradients), so a gradient never crosses PCIe: only per-chunk partials come back.
//
// The sum is cut so that the host reproduces it bit for bit (src/clip/norms.rs): a
// tensor is cut into chunks of FO_NORM_CHUNK elements; in a chunk, lane l (of 32) adds
// |x| or x*x (in f64) of elements l, l+32, l+64, ... in order from 0.0; a chunk's sum
// is the lanes' xor butterfly (offsets 16, 8, 4, 2, 1); the host adds a tensor's chunk
// sums in order. The largest |x| is NaN as soon as one element is NaN.
//
// Every thread works alone (no shared memory, no shuffles), so the host build through
// the shim runs the very same code: one thread per (chunk, lane) reads coalesced across
// a warp, then one thread per chunk folds its 32 lanes.
#pragma once
#include "fo_halfconv.cuh"

#define FO_NORM_LANES 32
#define FO_NORM_PER_LANE 256
#define FO_NORM_CHUNK (FO_NORM_LANES * FO_NORM_PER_LANE)

// One gradient of a launch. `chunk_begin`: the first global chunk of this tensor (a
// prefix sum over the table, in order), so a thread finds its tensor by binary search.
struct fo_norm_tensor {
  void* data;
  uint64_t numel;
  uint64_t chunk_begin;
  int32_t dtype;  // C ABI codes: 0 F32, 1 F16, 2 BF16, 3 F64
  int32_t reserved;
};

FO_HD double fo_norm_load(const void* p, int32_t dtype, uint64_t i) {
  if (dtype == 3) return ((const double*)p)[i];
  return (double)fo_load_any(p, dtype, i);
}

FO_HD bool fo_isnan_f64(double x) { return x != x; }

// max that is NaN when either side is (the host's `a > m || a.is_nan()` fold).
FO_HD double fo_nanmax(double a, double b) {
  if (fo_isnan_f64(a)) return a;
  if (fo_isnan_f64(b)) return b;
  return a > b ? a : b;
}

// The tensor that thread i of the lane and scale kernels walks, and in *at its first
// element: lane i % 32 of global chunk i / 32 takes elements at, at+32, ... of its chunk.
FO_HD const fo_norm_tensor& fo_norm_lane(const fo_norm_tensor* t, int n, uint64_t i, uint64_t* at) {
  uint64_t chunk = i / FO_NORM_LANES;
  const fo_norm_tensor& g = t[fo_find_row<fo_norm_tensor, &fo_norm_tensor::chunk_begin>(t, n, chunk)];
  *at = (chunk - g.chunk_begin) * FO_NORM_CHUNK + i % FO_NORM_LANES;
  return g;
}

// Lane partials: thread i is lane i % 32 of global chunk i / 32. `power` 1: sum |x|,
// 2: sum x*x. Writes lane_sum[i] and lane_max[i].
FO_GLOBAL void fo_norm_lanes_kernel(const fo_norm_tensor* __restrict__ t, int n, uint64_t total_chunks,
                                    int32_t power, double* __restrict__ lane_sum,
                                    double* __restrict__ lane_max) {
  uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total_chunks * FO_NORM_LANES;
       i += stride) {
    uint64_t at;
    const fo_norm_tensor& g = fo_norm_lane(t, n, i, &at);
    double s = 0.0, m = 0.0;
    for (int k = 0; k < FO_NORM_PER_LANE && at < g.numel; ++k, at += FO_NORM_LANES) {
      double a = fabs(fo_norm_load(g.data, g.dtype, at));
      s = s + (power == 2 ? a * a : a);
      m = fo_nanmax(a, m);
    }
    lane_sum[i] = s;
    lane_max[i] = m;
  }
}

// Chunk partials: thread c folds the 32 lanes of chunk c; out[2c] is the sum, out[2c+1]
// the largest |x|.
FO_GLOBAL void fo_norm_chunks_kernel(const double* __restrict__ lane_sum, const double* __restrict__ lane_max,
                                     uint64_t total_chunks, double* __restrict__ out) {
  uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t c = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; c < total_chunks; c += stride) {
    double s[FO_NORM_LANES], m[FO_NORM_LANES];
    for (int l = 0; l < FO_NORM_LANES; ++l) {
      s[l] = lane_sum[c * FO_NORM_LANES + l];
      m[l] = lane_max[c * FO_NORM_LANES + l];
    }
    for (int off = FO_NORM_LANES / 2; off > 0; off /= 2)
      for (int l = 0; l < off; ++l) {
        s[l] = s[l] + s[l + off];
        m[l] = fo_nanmax(m[l], m[l + off]);
      }
    out[2 * c] = s[0];
    out[2 * c + 1] = m[0];
  }
}

// The clip: every element times the coefficient, in f32 for f32/bf16/f16 gradients (as
// torch does, rounding 16-bit results to nearest even) and in f64 for f64 ones. Threads
// walk the tensors as fo_norm_lanes_kernel does (fo_norm_lane).
FO_GLOBAL void fo_scale_kernel(const fo_norm_tensor* __restrict__ t, int n, uint64_t total_chunks, float coef,
                               double coef64) {
  uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total_chunks * FO_NORM_LANES;
       i += stride) {
    uint64_t at;
    const fo_norm_tensor& g = fo_norm_lane(t, n, i, &at);
    for (int k = 0; k < FO_NORM_PER_LANE && at < g.numel; ++k, at += FO_NORM_LANES) {
      switch (g.dtype) {
        case 0:
          ((float*)g.data)[at] = ((const float*)g.data)[at] * coef;
          break;
        case 1: {
          uint16_t* p = (uint16_t*)g.data;
          p[at] = fo_f32_to_f16(fo_f16_to_f32(p[at]) * coef);
          break;
        }
        case 2: {
          uint16_t* p = (uint16_t*)g.data;
          p[at] = fo_f32_to_bf16(fo_bf16_to_f32(p[at]) * coef);
          break;
        }
        default:
          ((double*)g.data)[at] = ((const double*)g.data)[at] * coef64;
          break;
      }
    }
  }
}
