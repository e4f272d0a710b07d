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
