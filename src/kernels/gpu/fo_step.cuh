// Multi-tensor apply: one launch steps every device tensor of a param group. The launch
// gets a table of tensors in device memory; each tensor is cut into ceil(numel / 32)
// work items of up to 32 elements and one thread updates one item: decode to f32, apply
// the rule, encode back, exactly as fo's CPU kernel does per chunk. An item is a quant8
// scale group where a moment is quantized, else a strided set (see fo_step_group).
#pragma once
#include "fo_halfconv.cuh"
#include "fo_master.cuh"
#include "fo_quant8.cuh"
#include "fo_rules.cuh"

// How a moment state is stored.
enum fo_moment_kind {
  FO_MOMENT_NONE = 0,
  FO_MOMENT_F32 = 1,
  FO_MOMENT_F16 = 2,
  FO_MOMENT_BF16 = 3,
  FO_MOMENT_Q8_SIGNED = 4,  // int8 softsign codes + fp16 scale per 32
  FO_MOMENT_Q8_SQRT = 5,    // uint8 codes of sqrt(v) + fp16 scale per 32 (quant8)
  FO_MOMENT_Q8_FOURTH = 6,  // uint8 codes of v^(1/4) + fp16 scale per 32 (quant8_wide)
};

// One tensor of a launch. Pointers are device pointers on the GPU (host pointers in
// the host build). `group_begin`: the first global group index of this tensor (a prefix
// sum over the table, in order), so a thread finds its tensor by binary search.
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
  int32_t first;  // SGD: the momentum buffer is created by this step
  fo_rule rule;
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

// Stores the group [lo, lo+n) of a moment from x.
FO_HD void fo_moment_store(int32_t kind, void* s, uint16_t* scales, uint64_t lo, int n, const float* x) {
  switch (kind) {
    case FO_MOMENT_F32:
      for (int i = 0; i < n; ++i) ((float*)s)[lo + i] = x[i];
      break;
    case FO_MOMENT_F16:
      for (int i = 0; i < n; ++i) ((uint16_t*)s)[lo + i] = fo_f32_to_f16(x[i]);
      break;
    case FO_MOMENT_BF16:
      for (int i = 0; i < n; ++i) ((uint16_t*)s)[lo + i] = fo_f32_to_bf16(x[i]);
      break;
    case FO_MOMENT_Q8_SIGNED:
      scales[lo / FO_GROUP] = fo_signed_encode_group(x, n, (int8_t*)s + lo);
      break;
    case FO_MOMENT_Q8_SQRT:
      scales[lo / FO_GROUP] = fo_sqrt_encode_group(x, n, (uint8_t*)s + lo);
      break;
    case FO_MOMENT_Q8_FOURTH:
      scales[lo / FO_GROUP] = fo_fourth_encode_group(x, n, (uint8_t*)s + lo);
      break;
    default:
      break;
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

// Steps work item j of tensor t, which has `items` = ceil(numel / 32) of them, each of up
// to 32 elements. A tensor with a quantized moment needs a scale group's 32 elements in
// one thread: item j is elements 32j .. 32j+31. Any other tensor is element-wise, so
// item j takes elements j, j + items, j + 2 items, ...: neighbouring threads touch
// neighbouring elements (coalesced loads), and the bits are the same, element by element.
FO_HD void fo_step_group(const fo_step_tensor& t, uint64_t j, uint64_t items) {
  bool grouped = t.m_kind >= FO_MOMENT_Q8_SIGNED || t.v_kind >= FO_MOMENT_Q8_SIGNED;
  uint64_t first = grouped ? j * FO_GROUP : j, stride = grouped ? 1 : items;
  uint64_t left = (t.numel - first + stride - 1) / stride;
  int n = left < FO_GROUP ? (int)left : FO_GROUP;
  // A scale group is decoded whole first (its codes share one scale); element-wise
  // moments are read and written next to their element, so they need no array.
  float m[FO_GROUP], v[FO_GROUP];
  if (grouped)
    for (int i = 0; i < n; ++i) {
      m[i] = fo_moment_load(t.m_kind, t.m, t.m_scales, first + i);
      v[i] = fo_moment_load(t.v_kind, t.v, t.v_scales, first + i);
    }
  for (int i = 0; i < n; ++i) {
    uint64_t e = first + i * stride;
    float mi = grouped ? m[i] : fo_moment_load(t.m_kind, t.m, t.m_scales, e);
    float vi = grouped ? v[i] : fo_moment_load(t.v_kind, t.v, t.v_scales, e);
    float p = fo_param_load(t, e);
    float g = fo_load_any(t.grad, t.grad_dtype, e);
    fo_rule_apply(t.rule, &p, g, &mi, &vi, t.first != 0);
    fo_param_store(t, e, p);
    if (grouped) {
      m[i] = mi;
      v[i] = vi;
    } else {
      fo_moment_store_one(t.m_kind, t.m, e, mi);
      fo_moment_store_one(t.v_kind, t.v, e, vi);
    }
  }
  if (grouped) {
    fo_moment_store(t.m_kind, t.m, t.m_scales, first, n, m);
    fo_moment_store(t.v_kind, t.v, t.v_scales, first, n, v);
  }
}

// One launch for a whole table: a grid-stride loop over all groups of all tensors.
FO_GLOBAL void fo_step_kernel(const fo_step_tensor* __restrict__ table, int count, uint64_t total_groups) {
  uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t gi = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; gi < total_groups; gi += stride) {
    const fo_step_tensor& t = table[fo_find_row<fo_step_tensor, &fo_step_tensor::group_begin>(table, count, gi)];
    fo_step_group(t, gi - t.group_begin, (t.numel + FO_GROUP - 1) / FO_GROUP);
  }
}
