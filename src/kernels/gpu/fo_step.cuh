// Multi-tensor apply: one launch steps every device tensor of a param group that shares
// one rule. The launch gets a table of tensors in device memory; each tensor is cut into
// ceil(numel / 32) work items of up to 32 consecutive elements (a quant8 scale group),
// and FO_GROUP_LANES lanes update one item, FO_VEC consecutive elements each: decode to
// f32, apply the rule, encode back, exactly as fo's CPU kernel does per element (see
// fo_step_kernel).
#pragma once
#include "fo_fast.cuh"
#include "fo_halfconv.cuh"
#include "fo_master.cuh"
#include "fo_quant8.cuh"
#include "fo_rules.cuh"
#include "fo_vec.cuh"

// Lanes per scale group: each lane moves its FO_VEC = 4 elements of every array in one
// access (fo_vec.cuh). src/kernels/gpu/mod.rs (STEP_LANES_PER_GROUP) sizes the launch
// from this.
#define FO_GROUP_LANES (FO_GROUP / FO_VEC)
// Lanes one thread runs: 1 on the GPU, a whole group on the host (fo_shim.cuh).
#define FO_RUN_LANES (FO_LOCKSTEP ? FO_GROUP_LANES : 1)

// One tensor of a launch. Pointers are device pointers on the GPU (host pointers in
// the host build). `group_begin`: the first global group index of this tensor (a prefix
// sum over the launch's rows, in order), so a thread finds its first tensor by binary search
// and the next ones by walking forward.
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

FO_HD int fo_moment_size(int32_t kind) {
  return kind == FO_MOMENT_NONE ? 0 : kind == FO_MOMENT_F32 ? 4 : kind <= FO_MOMENT_BF16 ? 2 : 1;
}

FO_HD bool fo_is_quantized(int32_t kind) { return kind >= FO_MOMENT_Q8_SIGNED; }

// Whether every array the row's step moves element by element starts 16-byte aligned
// (the scales, one per group, are moved alone). Checked on the addresses at each launch:
// a row's ranges then take vectors wherever they are whole.
FO_HD bool fo_row_aligned16(const fo_step_tensor& t) {
  bool ok = fo_aligned16(t.param) && fo_aligned16(t.grad);
  if (t.error_bits_width != 0) ok = ok && fo_aligned16(t.error_bits);
  if (t.m_kind != FO_MOMENT_NONE) ok = ok && fo_aligned16(t.m);
  if (t.v_kind != FO_MOMENT_NONE) ok = ok && fo_aligned16(t.v);
  return ok;
}

// Element k of a moment from its word (and its group's f32 scale when quantized, with the
// codes' values from `tb`).
FO_HD float fo_moment_decode(const fo_code_tables& tb, int32_t kind, const uint32_t* w, int k, float scale) {
  switch (kind) {
    case FO_MOMENT_F32:
      return fo_from_bits(w[k]);
    case FO_MOMENT_F16:
      return fo_f16_to_f32((uint16_t)w[k]);
    case FO_MOMENT_BF16:
      return fo_bf16_to_f32((uint16_t)w[k]);
    case FO_MOMENT_Q8_SIGNED:
      return fo_signed_decode_t(tb, (int8_t)(uint8_t)w[k], scale);
    case FO_MOMENT_Q8_SQRT:
    case FO_MOMENT_Q8_FOURTH:
      return fo_unsigned_decode_t(tb, (uint8_t)w[k], scale, kind == FO_MOMENT_Q8_FOURTH);
    default:
      return 0.0f;
  }
}

// The word of an unquantized moment (quantized ones are encoded after the group's max).
FO_HD uint32_t fo_moment_encode(int32_t kind, float x) {
  if (kind == FO_MOMENT_F32) return fo_bits(x);
  if (kind == FO_MOMENT_F16) return fo_f32_to_f16(x);
  return fo_f32_to_bf16(x);
}

// The f32 master of element k from its parameter word p[k] and error bits e[k].
FO_HD float fo_param_decode(const fo_code_tables& tb, const fo_step_tensor& t, const uint32_t* p, const uint32_t* e,
                            int k) {
  if (t.param_dtype == 0) return fo_from_bits(p[k]);
  uint16_t b = (uint16_t)p[k];
  if (t.error_bits_width == 8) return fo_error_reconstruct_unit(t.param_dtype, b, tb.q127[(uint8_t)e[k]]);
  if (t.error_bits_width == 16) return fo_error_reconstruct(t.param_dtype, b, (int16_t)(uint16_t)e[k], 32767.0f);
  return fo_half_to_f32(t.param_dtype, b);
}

// Rounds master x into parameter word p[k] and splits off its error bits into e[k], the
// exact way or (`fast`) the fast arithmetic's (fo_fast.cuh).
FO_HD void fo_param_encode(const fo_step_tensor& t, float x, uint32_t* p, uint32_t* e, int k, bool fast) {
  if (t.param_dtype == 0) {
    p[k] = fo_bits(x);
    return;
  }
  uint16_t b = fo_f32_to_half(t.param_dtype, x);
  p[k] = b;
  int32_t w = t.error_bits_width;
  if (w != 8 && w != 16) return;
  int32_t c = fast ? fo_fast_error_code(t.param_dtype, b, w, x)
                   : fo_error_encode(t.param_dtype, x, b, w == 8 ? 127.0f : 32767.0f);
  e[k] = w == 8 ? (uint32_t)(uint8_t)(int8_t)c : (uint32_t)(uint16_t)(int16_t)c;
}

// The fast arithmetic's master of element k (fo_fast.cuh).
FO_HD float fo_fast_param_decode(const fo_step_tensor& t, const uint32_t* p, const uint32_t* e, int k) {
  if (t.param_dtype == 0) return fo_from_bits(p[k]);
  int32_t q = t.error_bits_width == 8 ? (int32_t)(int8_t)(uint8_t)e[k]
              : t.error_bits_width == 16 ? (int32_t)(int16_t)(uint16_t)e[k] : 0;
  return fo_fast_master(t.param_dtype, (uint16_t)p[k], t.error_bits_width, q);
}

FO_HD float fo_grad_decode(int32_t dtype, uint32_t w) {
  if (dtype == 0) return fo_from_bits(w);
  return dtype == 2 ? fo_bf16_to_f32((uint16_t)w) : fo_f16_to_f32((uint16_t)w);
}

// The elements of tensor t a lane owns: [*e0, *e0 + n) of group g, lane `lane` of it.
FO_HD int fo_lane_range(const fo_step_tensor& t, uint64_t g, unsigned lane, uint64_t* e0) {
  *e0 = g * FO_GROUP + (uint64_t)lane * FO_VEC;
  uint64_t rest = *e0 < t.numel ? t.numel - *e0 : 0;
  return rest < FO_VEC ? (int)rest : FO_VEC;
}

// Steps one lane's elements up to their quantized moments: loads every array's range,
// applies the rule element by element, stores the parameter, error bits and any
// unquantized moment, and leaves the new moments in m and v and their largest quant keys
// in *km and *kv for the group's encode. `fresh`: SGD's buffer is created by this step.
// Under the fast arithmetic (fo_rule_fast) the states are coded as fo_fast.cuh says, and
// m and v are left as the fast encoder takes them (the variance's root).
FO_HD void fo_step_lane(const fo_code_tables& tb, const fo_step_tensor& t, const fo_rule& rule, bool fresh,
                        uint64_t g, unsigned lane, bool aligned, float* m, float* v, uint32_t* km, uint32_t* kv) {
  uint64_t e0;
  int n = fo_lane_range(t, g, lane, &e0);
  if (n == 0) return;
  bool vec = aligned && n == FO_VEC;
  int ps = t.param_dtype == 0 ? 4 : 2, gs = t.grad_dtype == 0 ? 4 : 2, es = t.error_bits_width / 8;
  int ms = fo_moment_size(t.m_kind), vs = fo_moment_size(t.v_kind);
  uint32_t p[FO_VEC], gr[FO_VEC], e[FO_VEC], mw[FO_VEC], vw[FO_VEC];
  fo_gather(p, t.param, ps, e0, n, vec);
  fo_gather(gr, t.grad, gs, e0, n, vec);
  if (es) fo_gather(e, t.error_bits, es, e0, n, vec);
  if (ms) fo_gather(mw, t.m, ms, e0, n, vec);
  if (vs) fo_gather(vw, t.v, vs, e0, n, vec);
  float sm = fo_is_quantized(t.m_kind) ? fo_f16_to_f32(t.m_scales[g]) : 0.0f;
  float sv = fo_is_quantized(t.v_kind) ? fo_f16_to_f32(t.v_scales[g]) : 0.0f;
  bool fast = fo_rule_fast(rule.kind);
  bool fm = fast && fo_is_quantized(t.m_kind), fv = fast && fo_is_quantized(t.v_kind);
  if (fm) sm = fo_fast_decode_factor(t.m_kind, sm);
  if (fv) sv = fo_fast_decode_factor(t.v_kind, sv);
  // Unrolled over the FO_VEC elements (n only guards), so every array here is a register
  // (fo_vec.cuh says why); the same loop for the vector and the element path.
  FO_UNROLL
  for (int k = 0; k < FO_VEC; ++k) {
    if (k >= n) break;
    float mk = fm ? fo_fast_moment_decode(t.m_kind, mw[k], sm) : fo_moment_decode(tb, t.m_kind, mw, k, sm);
    float vk = fv ? fo_fast_moment_decode(t.v_kind, vw[k], sv) : fo_moment_decode(tb, t.v_kind, vw, k, sv);
    float pk = fast ? fo_fast_param_decode(t, p, e, k) : fo_param_decode(tb, t, p, e, k);
    fo_rule_apply(rule, &pk, fo_grad_decode(t.grad_dtype, gr[k]), &mk, &vk, fresh, fv);
    fo_param_encode(t, pk, p, e, k, fast);
    if (ms && !fo_is_quantized(t.m_kind)) mw[k] = fo_moment_encode(t.m_kind, mk);
    if (vs && !fo_is_quantized(t.v_kind)) vw[k] = fo_moment_encode(t.v_kind, vk);
    if (fv) vk = fo_fast_encoded(t.v_kind, vk);
    m[k] = mk;
    v[k] = vk;
    uint32_t a = fm ? fo_fast_quant_key(t.m_kind, mk) : fo_quant_key(t.m_kind, mk);
    uint32_t b = fv ? fo_fast_quant_key(t.v_kind, vk) : fo_quant_key(t.v_kind, vk);
    *km = a > *km ? a : *km;
    *kv = b > *kv ? b : *kv;
  }
  fo_scatter(t.param, p, ps, e0, n, vec);
  if (es) fo_scatter(t.error_bits, e, es, e0, n, vec);
  if (ms && !fo_is_quantized(t.m_kind)) fo_scatter(t.m, mw, ms, e0, n, vec);
  if (vs && !fo_is_quantized(t.v_kind)) fo_scatter(t.v, vw, vs, e0, n, vec);
}

// Encodes one lane's elements of a quantized moment x with their group's f32 scale `a`
// (`fast`: the fast arithmetic's coding); the group's first lane also stores the fp16 scale.
FO_HD void fo_quant_lane(const fo_step_tensor& t, int32_t kind, bool fast, void* s, uint16_t* scales, uint64_t g,
                         unsigned lane, bool aligned, const float* x, float a) {
  uint64_t e0;
  int n = fo_lane_range(t, g, lane, &e0);
  if (!fo_is_quantized(kind) || n == 0) return;
  float f = fast ? fo_fast_encode_factor(kind, a) : 0.0f;
  uint32_t w[FO_VEC];
  FO_UNROLL
  for (int k = 0; k < FO_VEC; ++k) {
    if (k >= n) break;
    w[k] = fast ? fo_fast_quant_code(kind, x[k], f) : (uint8_t)fo_quant_code(kind, x[k], a);
  }
  fo_scatter(s, w, 1, e0, n, aligned && n == FO_VEC);
  if (lane == 0) scales[g] = fo_f32_to_f16(a);
}

// One item (a 32-element group) of row `row`: this thread's lanes stepped, then, for
// quantized moments, the group's scales and codes. The template arguments fix a row's
// formats and the rule's kind at compile time (-1: read them from the row and the rule):
// given constants, every switch over dtypes and kinds in the per-element code folds away,
// so a specialized path runs only its own arithmetic. The text, and so the bits, are the
// generic path's: it overwrites the fields with the values they already hold.
template <int PD, int GD, int EW, int MK, int VK, int RK>
FO_HD void fo_step_group(const fo_code_tables& tb, const fo_step_tensor& row, const fo_rule& rule_in, bool first,
                         uint64_t g, unsigned lane0) {
  fo_step_tensor t = row;
  fo_rule rule = rule_in;
  if (PD >= 0) t.param_dtype = PD;
  if (GD >= 0) t.grad_dtype = GD;
  if (EW >= 0) t.error_bits_width = EW;
  if (MK >= 0) t.m_kind = MK;
  if (VK >= 0) t.v_kind = VK;
  if (RK >= 0) rule.kind = RK;
  bool aligned = fo_row_aligned16(t);
  float m[FO_RUN_LANES * FO_VEC], v[FO_RUN_LANES * FO_VEC];
  uint32_t km = 0, kv = 0;  // a partial group's idle lanes add key 0
  for (unsigned l = 0; l < FO_RUN_LANES; ++l)
    fo_step_lane(tb, t, rule, first, g, lane0 + l, aligned, m + l * FO_VEC, v + l * FO_VEC, &km, &kv);
  // Uniform over the group's lanes (one item, one tensor), so both reach the shuffle.
  if (!fo_is_quantized(t.m_kind) && !fo_is_quantized(t.v_kind)) return;
  km = fo_lanes_max<FO_GROUP_LANES>(km);
  kv = fo_lanes_max<FO_GROUP_LANES>(kv);
  // The fast keys are already of the values encoded (the variance's root).
  bool fast = fo_rule_fast(rule.kind);
  float am = fast ? fo_floor_scale(fo_from_bits(km)) : fo_quant_scale(t.m_kind, km);
  float av = fast ? fo_floor_scale(fo_from_bits(kv)) : fo_quant_scale(t.v_kind, kv);
  for (unsigned l = 0; l < FO_RUN_LANES; ++l) {
    fo_quant_lane(t, t.m_kind, fast, t.m, t.m_scales, g, lane0 + l, aligned, m + l * FO_VEC, am);
    fo_quant_lane(t, t.v_kind, fast, t.v, t.v_scales, g, lane0 + l, aligned, v + l * FO_VEC, av);
  }
}

// The specialized paths, by the formats of AdamW's common uses (0: the generic path):
// torch's arithmetic for fp32 state over f32 or bf16 parameters, and FlashOptim's (exact)
// and fo's fast arithmetic for quant8 state over f32 parameters and over bf16 parameters
// with or without 24-bit masters (8-bit error bits). Gradients of the parameter's dtype,
// as torch gives them.
enum fo_step_path {
  FO_PATH_GENERIC = 0,
  FO_PATH_TORCH_ADAM_F32 = 1,
  FO_PATH_TORCH_ADAM_BF16 = 2,
  FO_PATH_FLASH_ADAM_Q8_F32 = 3,
  FO_PATH_FLASH_ADAM_Q8_BF16 = 4,
  FO_PATH_FLASH_ADAM_Q8_BF16_E8 = 5,
  FO_PATH_FAST_ADAM_Q8_F32 = 6,
  FO_PATH_FAST_ADAM_Q8_BF16 = 7,
  FO_PATH_FAST_ADAM_Q8_BF16_E8 = 8,
  FO_PATH_LAST = FO_PATH_FAST_ADAM_Q8_BF16_E8,
};

// Path P's formats, the one table both the choice of a row's path (fo_step_path_of) and
// the compiled path (fo_step_item) read: param and grad dtype, error bits, moment kinds,
// rule kind.
template <int P>
struct fo_path;
#define FO_PATH_FORMATS(P, PD, EW, MK, VK, RK)                                      \
  template <>                                                                      \
  struct fo_path<P> {                                                              \
    static constexpr int pd = PD, gd = PD, ew = EW, mk = MK, vk = VK, rk = RK;      \
  };
FO_PATH_FORMATS(FO_PATH_TORCH_ADAM_F32, 0, 0, FO_MOMENT_F32, FO_MOMENT_F32, FO_RULE_TORCH_ADAM)
FO_PATH_FORMATS(FO_PATH_TORCH_ADAM_BF16, 2, 0, FO_MOMENT_F32, FO_MOMENT_F32, FO_RULE_TORCH_ADAM)
FO_PATH_FORMATS(FO_PATH_FLASH_ADAM_Q8_F32, 0, 0, FO_MOMENT_Q8_SIGNED, FO_MOMENT_Q8_SQRT, FO_RULE_FLASH_ADAM)
FO_PATH_FORMATS(FO_PATH_FLASH_ADAM_Q8_BF16, 2, 0, FO_MOMENT_Q8_SIGNED, FO_MOMENT_Q8_SQRT, FO_RULE_FLASH_ADAM)
FO_PATH_FORMATS(FO_PATH_FLASH_ADAM_Q8_BF16_E8, 2, 8, FO_MOMENT_Q8_SIGNED, FO_MOMENT_Q8_SQRT, FO_RULE_FLASH_ADAM)
FO_PATH_FORMATS(FO_PATH_FAST_ADAM_Q8_F32, 0, 0, FO_MOMENT_Q8_SIGNED, FO_MOMENT_Q8_SQRT, FO_RULE_FAST_ADAM)
FO_PATH_FORMATS(FO_PATH_FAST_ADAM_Q8_BF16, 2, 0, FO_MOMENT_Q8_SIGNED, FO_MOMENT_Q8_SQRT, FO_RULE_FAST_ADAM)
FO_PATH_FORMATS(FO_PATH_FAST_ADAM_Q8_BF16_E8, 2, 8, FO_MOMENT_Q8_SIGNED, FO_MOMENT_Q8_SQRT, FO_RULE_FAST_ADAM)

// Whether row t under rule r has path P's formats.
template <int P>
FO_HD bool fo_path_takes(const fo_step_tensor& t, const fo_rule& r) {
  using F = fo_path<P>;
  return t.param_dtype == F::pd && t.grad_dtype == F::gd && t.error_bits_width == F::ew && t.m_kind == F::mk &&
         t.v_kind == F::vk && r.kind == F::rk;
}

// The first path whose formats row t has, from P on (0 when none).
template <int P = 1>
FO_HD int fo_step_path_of(const fo_step_tensor& t, const fo_rule& r) {
  if constexpr (P > FO_PATH_LAST) {
    return FO_PATH_GENERIC;
  } else {
    return fo_path_takes<P>(t, r) ? P : fo_step_path_of<P + 1>(t, r);
  }
}

// One item of row t on path P, compiled with P's formats.
template <int P>
FO_HD void fo_step_path_group(const fo_code_tables& tb, const fo_step_tensor& t, const fo_rule& rule, bool f,
                              uint64_t g, unsigned lane0) {
  using F = fo_path<P>;
  fo_step_group<F::pd, F::gd, F::ew, F::mk, F::vk, F::rk>(tb, t, rule, f, g, lane0);
}

// One item of row t on path PATH (0: the row's own, fo_step_path_of, chosen at run time).
// With PATH a constant the switch folds to its one case, so an entry compiled for one path
// holds that path's code alone, and its registers are that path's.
template <int PATH>
FO_HD void fo_step_item(const fo_code_tables& tb, const fo_step_tensor& t, const fo_rule& rule, bool f, uint64_t g,
                        unsigned lane0) {
  switch (PATH != FO_PATH_GENERIC ? PATH : fo_step_path_of(t, rule)) {
    case FO_PATH_TORCH_ADAM_F32: return fo_step_path_group<FO_PATH_TORCH_ADAM_F32>(tb, t, rule, f, g, lane0);
    case FO_PATH_TORCH_ADAM_BF16: return fo_step_path_group<FO_PATH_TORCH_ADAM_BF16>(tb, t, rule, f, g, lane0);
    case FO_PATH_FLASH_ADAM_Q8_F32: return fo_step_path_group<FO_PATH_FLASH_ADAM_Q8_F32>(tb, t, rule, f, g, lane0);
    case FO_PATH_FLASH_ADAM_Q8_BF16: return fo_step_path_group<FO_PATH_FLASH_ADAM_Q8_BF16>(tb, t, rule, f, g, lane0);
    case FO_PATH_FLASH_ADAM_Q8_BF16_E8:
      return fo_step_path_group<FO_PATH_FLASH_ADAM_Q8_BF16_E8>(tb, t, rule, f, g, lane0);
    case FO_PATH_FAST_ADAM_Q8_F32: return fo_step_path_group<FO_PATH_FAST_ADAM_Q8_F32>(tb, t, rule, f, g, lane0);
    case FO_PATH_FAST_ADAM_Q8_BF16: return fo_step_path_group<FO_PATH_FAST_ADAM_Q8_BF16>(tb, t, rule, f, g, lane0);
    case FO_PATH_FAST_ADAM_Q8_BF16_E8:
      return fo_step_path_group<FO_PATH_FAST_ADAM_Q8_BF16_E8>(tb, t, rule, f, g, lane0);
    default: return fo_step_group<-1, -1, -1, -1, -1, -1>(tb, t, rule, f, g, lane0);
  }
}

// One launch for the rows of a table that share one rule. The rule travels by value with
// the launch (68 bytes of kernel parameters), so a step whose pointers did not change
// uploads nothing.
//
// Multi-tensor apply: every tensor is cut into work items of 32 consecutive elements (a
// quant8 scale group), and FO_GROUP_LANES = 8 neighbouring lanes step one item per
// iteration of a grid-stride loop over the items of all rows, lane l on elements
// [4l, 4l + 4), moved in one access per array where fo_vec.cuh allows (whole ranges of
// aligned arrays), else element by element; the math per element is the same either way.
// A quantized group's scale is the max of its lanes' keys: a shuffle tree among the eight
// lanes on the GPU (fo_lanes_max), the same max however it is ordered. On the host
// (fo_shim.cuh) a group's first lane runs all of its lanes in lockstep, with the
// cross-lane max taken by this same loop, so the host-shim tests run this text, the GPU's
// split and its vector accesses included, on every path.
//
// Entries: fo_step_kernel picks each row's path (any launch); fo_step_kernel_p<N> runs
// path N for every row, for a launch whose rows all take it (the launch code checks,
// src/kernels/step_path.rs): holding one path's code, it needs fewer registers (NVRTC
// 13.2, sm_90: 43 to 60, p5 capped at 48, against 117 for the entry holding every path), so more
// threads are resident.
template <int PATH>
FO_HD void fo_step_rows(const fo_code_tables& tb, const fo_step_tensor* __restrict__ table, int count,
                        uint64_t total_groups, const fo_rule& rule, int32_t first) {
  fo_require_warp_blocks();
  if (FO_LOCKSTEP && threadIdx.x % FO_GROUP_LANES != 0) return;
  uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  uint64_t li = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (li >= total_groups * FO_GROUP_LANES) return;
  // The row of the first item by binary search; after that the items only move forward,
  // so the row does too: a walk of the rows passed (most strides stay in one row).
  int row = fo_find_row<fo_step_tensor, &fo_step_tensor::group_begin>(table, count, li / FO_GROUP_LANES);
  // A group's lanes are neighbours and the stride is whole warps, so they leave together.
  for (; li < total_groups * FO_GROUP_LANES; li += stride) {
    uint64_t gi = li / FO_GROUP_LANES;
    while (row + 1 < count && table[row + 1].group_begin <= gi) ++row;
    const fo_step_tensor& t = table[row];
    fo_step_item<PATH>(tb, t, rule, first != 0, gi - t.group_begin, (unsigned)(li % FO_GROUP_LANES));
  }
}

// Threads per block of every launch (BLOCK_THREADS in src/kernels/gpu/mod.rs, which the
// launch code uses): an entry compiled with launch bounds refuses larger blocks.
#define FO_BLOCK_THREADS 128
// Launch bounds asking for `b` resident blocks per SM, so the compiler keeps the entry's
// registers under 65536 / (128 * b); nothing on the host.
#if defined(FO_GPU)
#define FO_MIN_BLOCKS(b) __launch_bounds__(FO_BLOCK_THREADS, b)
#else
#define FO_MIN_BLOCKS(b)
#endif
#define FO_ANY_REGISTERS

// BOUNDS: FO_ANY_REGISTERS, or FO_MIN_BLOCKS(b) where measured faster. Quant8 over bf16
// with 24-bit masters (p5) holds 66 registers unbounded, so 7 blocks of 128 fit an SM;
// capped at 48 (10 blocks, a few spills around the division's slow-path calls) it ran
// 1.25x faster (H200, fo selftest, 57.7/57.4 -> 72.0/71.6 G params/s, two runs each,
// 2026-11-27). Other caps measured there did not pay: 48 for p4 (59 registers: the same
// speed), 40 (12 blocks) for every entry (fp32 0.86x, p4 0.94x).
#define FO_STEP_ENTRY(NAME, PATH, BOUNDS)                                                          \
  FO_GLOBAL void BOUNDS NAME(const fo_step_tensor* __restrict__ table, int count, uint64_t total_groups, \
                             fo_rule rule, int32_t first) {                                          \
    FO_CODE_TABLES(tb);                                                                              \
    fo_step_rows<PATH>(tb, table, count, total_groups, rule, first);                                 \
  }
FO_STEP_ENTRY(fo_step_kernel, FO_PATH_GENERIC, FO_ANY_REGISTERS)
FO_STEP_ENTRY(fo_step_kernel_p1, FO_PATH_TORCH_ADAM_F32, FO_ANY_REGISTERS)
FO_STEP_ENTRY(fo_step_kernel_p2, FO_PATH_TORCH_ADAM_BF16, FO_ANY_REGISTERS)
FO_STEP_ENTRY(fo_step_kernel_p3, FO_PATH_FLASH_ADAM_Q8_F32, FO_ANY_REGISTERS)
FO_STEP_ENTRY(fo_step_kernel_p4, FO_PATH_FLASH_ADAM_Q8_BF16, FO_ANY_REGISTERS)
FO_STEP_ENTRY(fo_step_kernel_p5, FO_PATH_FLASH_ADAM_Q8_BF16_E8, FO_MIN_BLOCKS(10))
FO_STEP_ENTRY(fo_step_kernel_p6, FO_PATH_FAST_ADAM_Q8_F32, FO_ANY_REGISTERS)
FO_STEP_ENTRY(fo_step_kernel_p7, FO_PATH_FAST_ADAM_Q8_BF16, FO_ANY_REGISTERS)
FO_STEP_ENTRY(fo_step_kernel_p8, FO_PATH_FAST_ADAM_Q8_BF16_E8, FO_ANY_REGISTERS)
