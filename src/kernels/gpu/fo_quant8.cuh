// FlashOptim 0.1.4's 8-bit state codec (src/optim/math/quant8.rs) and fo's fourth-root
// variant (quant8_wide): groups of 32 elements share one fp16 scale; every step is one
// correctly rounded f32 operation in the Rust kernels' order.
#pragma once
#include "fo_halfconv.cuh"
#include "fo_master.cuh"

#define FO_GROUP 32
#define FO_ABSMAX_FLOOR 1e-12f

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

// |x| as ordered bits, NaN as 0 (so max ignores it, as f32::max does).
FO_HD uint32_t fo_mag_bits(float x) {
  uint32_t b = fo_bits(x) & 0x7fffffffu;
  return b > 0x7f800000u ? 0u : b;
}

// Non-negative x as ordered bits; NaN and negative values (sign bit set) as 0.
FO_HD uint32_t fo_nonneg_bits(float x) {
  uint32_t b = fo_bits(x);
  return b > 0x7f800000u ? 0u : b;
}

FO_HD float fo_floor_scale(float a) { return a < FO_ABSMAX_FLOOR ? FO_ABSMAX_FLOOR : a; }

// Signed softsign decode of one code: t = q/127, t/(2-|t|), times the scale.
FO_HD float fo_signed_decode(int8_t code, float scale) {
  float t = fo_div((float)code, 127.0f);
  return fo_div(t, 2.0f - fo_abs(t)) * scale;
}

// Encoding is split at the one point where a scale group's elements meet: each element
// gives a key, the group's scale comes from the largest key (max is order-free, so a
// shuffle between lanes and a loop over the 32 elements give the same bits), and then
// each element is encoded alone with that scale. The kernel runs eight lanes per group,
// 4 elements each (fo_step.cuh); the keys, scale and per-element code here are the Rust
// kernels' numbers.

// The key whose maximum over a group gives the group's scale: |x| as ordered bits for
// the momentum (NaN as 0), v as ordered bits for sqrt companding (NaN and negative as 0),
// v^(1/4) for fourth-root companding (the same rule: fmaxf from 0 ignores NaN).
FO_HD uint32_t fo_quant_key(int32_t kind, float x) {
  if (kind == FO_MOMENT_Q8_SIGNED) return fo_mag_bits(x);
  if (kind == FO_MOMENT_Q8_SQRT) return fo_nonneg_bits(x);
  if (kind == FO_MOMENT_Q8_FOURTH) return fo_nonneg_bits(fo_sqrt(fo_sqrt(x)));
  return 0u;
}

// The group's f32 scale from its largest key (before rounding to fp16).
FO_HD float fo_quant_scale(int32_t kind, uint32_t key_max) {
  float k = fo_from_bits(key_max);
  // sqrt is monotone and correctly rounded: max(sqrt(v)) == sqrt(max(v)).
  return fo_floor_scale(kind == FO_MOMENT_Q8_SQRT ? fo_sqrt(k) : k);
}

// One element's code with its group's f32 scale `a`.
FO_HD int32_t fo_quant_code(int32_t kind, float x, float a) {
  if (kind == FO_MOMENT_Q8_SIGNED) {
    float y = fo_div(x, a);
    float z = fo_div(2.0f * y, 1.0f + fo_abs(y));
    return fo_to_code(fo_floor(z * 127.0f + 0.5f), -127.0f, 127.0f);
  }
  float r = kind == FO_MOMENT_Q8_SQRT ? fo_sqrt(x) : fo_sqrt(fo_sqrt(x));
  return fo_to_code(fo_floor(fo_div(r, a) * 255.0f + 0.5f), 0.0f, 255.0f);
}

// Variance decode; `fourth`: quant8_wide, whose code 0 is stepped as half the smallest
// level (the update sees it, never 0).
FO_HD float fo_unsigned_decode(uint8_t code, float scale, bool fourth) {
  float u = (fourth && code == 0) ? (0.5f / 255.0f) * scale : fo_div((float)code, 255.0f) * scale;
  return fourth ? (u * u) * (u * u) : u * u;
}

// A code's value before its group's scale depends on the code's byte alone, so the step
// kernel reads it from a table of the 256 bytes, filled by the expressions above (so the
// bits are theirs) once per thread block, instead of dividing per element: correctly
// rounded divisions are most of a GPU step's instructions (about 10 each on sm_90).
struct fo_code_tables {
  float q127[256];      // (int8_t)c / 127: the softsign's t, and 24-bit masters' error codes
  float softsign[256];  // t / (2 - |t|): the momentum's value per unit of scale
  float q255[256];      // c / 255: the variance's (sqrt or fourth root) per unit of scale
};

// Entries i0, i0 + step, ... of the tables (the threads of a block fill them together).
FO_HD void fo_code_tables_fill(fo_code_tables* t, unsigned i0, unsigned step) {
  for (unsigned c = i0; c < 256; c += step) {
    float s = fo_div((float)(int8_t)(uint8_t)c, 127.0f);
    t->q127[c] = s;
    t->softsign[c] = fo_div(s, 2.0f - fo_abs(s));
    t->q255[c] = fo_div((float)c, 255.0f);
  }
}

// FO_CODE_TABLES(tb) at the top of a kernel entry declares `tb`, the filled tables: on the
// GPU in the block's shared memory, filled by all of its threads before any reads (the
// barrier is the entry's only one, ahead of any thread's return); on the host one copy
// for the process, filled once (in three interleaved passes, as threads of a block would).
#if defined(FO_GPU)
#define FO_CODE_TABLES(tb)                                   \
  __shared__ fo_code_tables tb##_shared;                     \
  fo_code_tables_fill(&tb##_shared, threadIdx.x, blockDim.x); \
  __syncthreads();                                           \
  const fo_code_tables& tb = tb##_shared
#else
inline const fo_code_tables& fo_host_code_tables() {
  static const fo_code_tables tables = [] {
    fo_code_tables t;
    for (unsigned i0 = 0; i0 < 3; ++i0) fo_code_tables_fill(&t, i0, 3);
    return t;
  }();
  return tables;
}
#define FO_CODE_TABLES(tb) const fo_code_tables& tb = fo_host_code_tables()
#endif

// fo_signed_decode and fo_unsigned_decode through the tables: the same bits.
FO_HD float fo_signed_decode_t(const fo_code_tables& tb, int8_t code, float scale) {
  return tb.softsign[(uint8_t)code] * scale;
}
FO_HD float fo_unsigned_decode_t(const fo_code_tables& tb, uint8_t code, float scale, bool fourth) {
  float u = (fourth && code == 0) ? (0.5f / 255.0f) * scale : tb.q255[code] * scale;
  return fourth ? (u * u) * (u * u) : u * u;
}
