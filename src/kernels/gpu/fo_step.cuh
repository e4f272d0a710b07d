// Multi-tensor apply: one launch steps every device tensor of a param group that shares
// one rule. The launch gets a table of tensors in device memory; each tensor is cut into
// ceil(numel / 32) work items of up to 32 consecutive elements (a quant8 scale group),
// and a warp updates one item, a lane per element: decode to f32, apply the rule, encode
// back, exactly as fo's CPU kernel does per element (see fo_step_kernel).
#pragma once
#include "fo_halfconv.cuh"
#include "fo_master.cuh"
#include "fo_quant8.cuh"
#include "fo_rules.cuh"

// One tensor of a launch. Pointers are device pointers on the GPU (host pointers in
// the host build). `group_begin`: the first global group index of this tensor (a prefix
// sum over the launch's rows, in order), so a thread finds its tensor by binary search.
// Nothing here changes from step to step (the rule's step-dependent scalars and SGD's
// `first` are launch arguments), so a table stays resident on the device and is uploaded
// again only when a pointer changes (src/optim/placement/device_table.rs).
struct fo_step_tensor {
  void* param;
  const void* grad;
  void* error_bits;  // int8 or int16 codes, or null
  void* m;
  uint16_t* m_scales;
  void* v;
  uint16_t* v_scales;
  uint64_t numel;
  uint64_t group_begin;
  int32_t param_dtype;  // C ABI codes: 0 F32, 1 F16, 2 BF16
  int32_t grad_dtype;
  int32_t error_bits_width;  // 0, 8 or 16
  int32_t m_kind;            // fo_moment_kind
  int32_t v_kind;
};

FO_HD float fo_moment_load(int32_t kind, const void* s, const uint16_t* scales, uint64_t i) {
  switch (kind) {
    case FO_MOMENT_F32:
      return ((const float*)s)[i];
    case FO_MOMENT_F16:
      return fo_f16_to_f32(((const uint16_t*)s)[i]);
    case FO_MOMENT_BF16:
      return fo_bf16_to_f32(((const uint16_t*)s)[i]);
    case FO_MOMENT_Q8_SIGNED:
      return fo_signed_decode(((const int8_t*)s)[i], fo_f16_to_f32(scales[i / FO_GROUP]));
    case FO_MOMENT_Q8_SQRT:
    case FO_MOMENT_Q8_FOURTH:
      return fo_unsigned_decode(((const uint8_t*)s)[i], fo_f16_to_f32(scales[i / FO_GROUP]),
                                kind == FO_MOMENT_Q8_FOURTH);
    default:
      return 0.0f;
  }
}

FO_HD float fo_param_load(const fo_step_tensor& t, uint64_t i) {
  if (t.param_dtype == 0) return ((const float*)t.param)[i];
  uint16_t b = ((const uint16_t*)t.param)[i];
  if (t.error_bits_width == 8) return fo_error_reconstruct(t.param_dtype, b, ((const int8_t*)t.error_bits)[i], 127.0f);
  if (t.error_bits_width == 16)
    return fo_error_reconstruct(t.param_dtype, b, ((const int16_t*)t.error_bits)[i], 32767.0f);
  return fo_half_to_f32(t.param_dtype, b);
}

// Rounds master x into the parameter and splits off its error bits.
FO_HD void fo_param_store(const fo_step_tensor& t, uint64_t i, float x) {
  if (t.param_dtype == 0) {
    ((float*)t.param)[i] = x;
    return;
  }
  uint16_t b = fo_f32_to_half(t.param_dtype, x);
  ((uint16_t*)t.param)[i] = b;
  if (t.error_bits_width == 8) ((int8_t*)t.error_bits)[i] = (int8_t)fo_error_encode(t.param_dtype, x, b, 127.0f);
  if (t.error_bits_width == 16)
    ((int16_t*)t.error_bits)[i] = (int16_t)fo_error_encode(t.param_dtype, x, b, 32767.0f);
}

// Stores element i of an unquantized moment.
FO_HD void fo_moment_store_one(int32_t kind, void* s, uint64_t i, float x) {
  if (kind == FO_MOMENT_F32) ((float*)s)[i] = x;
  if (kind == FO_MOMENT_F16) ((uint16_t*)s)[i] = fo_f32_to_f16(x);
  if (kind == FO_MOMENT_BF16) ((uint16_t*)s)[i] = fo_f32_to_bf16(x);
}

FO_HD bool fo_is_quantized(int32_t kind) { return kind >= FO_MOMENT_Q8_SIGNED; }

// Stores element e of a quantized moment: its code with its group's f32 scale `a`, and
// the fp16 scale itself from the group's first element.
FO_HD void fo_quant_store(int32_t kind, void* s, uint16_t* scales, uint64_t e, float x, float a) {
  if (!fo_is_quantized(kind)) return;
  int32_t code = fo_quant_code(kind, x, a);
  if (kind == FO_MOMENT_Q8_SIGNED)
    ((int8_t*)s)[e] = (int8_t)code;
  else
    ((uint8_t*)s)[e] = (uint8_t)code;
  if (e % FO_GROUP == 0) scales[e / FO_GROUP] = fo_f32_to_f16(a);
}

// Steps element e up to its quantized moments: decodes, applies the rule, stores the
// parameter (and error bits) and any element-wise moment, and returns the new moments
// in *m and *v for the group's encode. `fresh`: SGD's buffer is created by this step.
FO_HD void fo_step_one(const fo_step_tensor& t, const fo_rule& rule, bool fresh, uint64_t e, float* m, float* v) {
  *m = fo_moment_load(t.m_kind, t.m, t.m_scales, e);
  *v = fo_moment_load(t.v_kind, t.v, t.v_scales, e);
  float p = fo_param_load(t, e);
  float g = fo_load_any(t.grad, t.grad_dtype, e);
  fo_rule_apply(rule, &p, g, m, v, fresh);
  fo_param_store(t, e, p);
  fo_moment_store_one(t.m_kind, t.m, e, *m);
  fo_moment_store_one(t.v_kind, t.v, e, *v);
}

// One launch for the rows of a table that share one rule. The rule travels by value with
// the launch (68 bytes of kernel parameters), so a step whose pointers did not change
// uploads nothing.
//
// Multi-tensor apply: every tensor is cut into work items of 32 consecutive elements (a
// quant8 scale group), and a warp steps one item per iteration of a grid-stride loop
// over the items of all rows, lane l on element 32j + l, so neighbouring lanes touch
// neighbouring elements (coalesced) for every tensor, large or small. A quantized
// group's scale is the max of its lanes' keys: a shuffle tree on the GPU (fo_warp_max),
// the same max however it is ordered. On the host (fo_shim.cuh) lane 0 of each warp runs
// all FO_LANES = 32 lanes of it in lockstep, with the cross-lane max taken by this same
// loop, so the host-shim tests run this text, the GPU's split included.
FO_GLOBAL void fo_step_kernel(const fo_step_tensor* __restrict__ table, int count, uint64_t total_groups,
                              fo_rule rule, int32_t first) {
  fo_require_warp_blocks();
  if (FO_LANES != 1 && threadIdx.x % FO_GROUP != 0) return;  // the host: lane 0 runs its warp
  unsigned lane0 = FO_LANES == 1 ? threadIdx.x % FO_GROUP : 0;
  uint64_t warps = (uint64_t)gridDim.x * blockDim.x / FO_GROUP;
  for (uint64_t gi = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) / FO_GROUP; gi < total_groups;
       gi += warps) {
    const fo_step_tensor& t = table[fo_find_row<fo_step_tensor, &fo_step_tensor::group_begin>(table, count, gi)];
    uint64_t base = (gi - t.group_begin) * FO_GROUP + lane0;
    float m[FO_LANES], v[FO_LANES];
    uint32_t km = 0, kv = 0;
    for (int k = 0; k < FO_LANES; ++k) {
      if (base + k >= t.numel) continue;  // a partial group's idle lanes add key 0
      fo_step_one(t, rule, first != 0, base + k, &m[k], &v[k]);
      uint32_t a = fo_quant_key(t.m_kind, m[k]), b = fo_quant_key(t.v_kind, v[k]);
      km = a > km ? a : km;
      kv = b > kv ? b : kv;
    }
    // Uniform over the warp (one item, one tensor), so every lane reaches the shuffles.
    if (!fo_is_quantized(t.m_kind) && !fo_is_quantized(t.v_kind)) continue;
    km = fo_warp_max(km);
    kv = fo_warp_max(kv);
    float am = fo_quant_scale(t.m_kind, km), av = fo_quant_scale(t.v_kind, kv);
    for (int k = 0; k < FO_LANES; ++k) {
      if (base + k >= t.numel) continue;
      fo_quant_store(t.m_kind, t.m, t.m_scales, base + k, m[k], am);
      fo_quant_store(t.v_kind, t.v, t.v_scales, base + k, v[k], av);
    }
  }
}
