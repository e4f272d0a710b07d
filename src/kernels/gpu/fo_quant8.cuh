// FlashOptim 0.1.4's 8-bit state codec (src/optim/math/quant8.rs) and fo's fourth-root
// variant (quant8_wide): groups of 32 elements share one fp16 scale; every step is one
// correctly rounded f32 operation in the Rust kernels' order.
#pragma once
#include "fo_halfconv.cuh"
#include "fo_master.cuh"

#define FO_GROUP 32
#define FO_ABSMAX_FLOOR 1e-12f

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

// Momentum: encodes x[0..n) into codes, returns the fp16 scale bits.
FO_HD uint16_t fo_signed_encode_group(const float* x, int n, int8_t* codes) {
  uint32_t m = 0;
  for (int i = 0; i < n; ++i) {
    uint32_t b = fo_mag_bits(x[i]);
    m = b > m ? b : m;
  }
  float a = fo_floor_scale(fo_from_bits(m));
  for (int i = 0; i < n; ++i) {
    float y = fo_div(x[i], a);
    float z = fo_div(2.0f * y, 1.0f + fo_abs(y));
    codes[i] = (int8_t)fo_to_code(fo_floor(z * 127.0f + 0.5f), -127.0f, 127.0f);
  }
  return fo_f32_to_f16(a);
}

// Variance, square-root companding (quant8): code = floor(255 sqrt(v)/a + 0.5).
FO_HD uint16_t fo_sqrt_encode_group(const float* v, int n, uint8_t* codes) {
  uint32_t m = 0;
  for (int i = 0; i < n; ++i) {
    uint32_t b = fo_nonneg_bits(v[i]);
    m = b > m ? b : m;
  }
  // sqrt is monotone and correctly rounded: max(sqrt(v)) == sqrt(max(v)).
  float a = fo_floor_scale(fo_sqrt(fo_from_bits(m)));
  for (int i = 0; i < n; ++i)
    codes[i] = (uint8_t)fo_to_code(fo_floor(fo_div(fo_sqrt(v[i]), a) * 255.0f + 0.5f), 0.0f, 255.0f);
  return fo_f32_to_f16(a);
}

// Variance, fourth-root companding (quant8_wide).
FO_HD uint16_t fo_fourth_encode_group(const float* v, int n, uint8_t* codes) {
  float a = 0.0f;
  for (int i = 0; i < n; ++i) a = fo_maxnum(a, fo_sqrt(fo_sqrt(v[i])));
  a = fo_floor_scale(a);
  for (int i = 0; i < n; ++i) {
    float r = fo_sqrt(fo_sqrt(v[i]));
    codes[i] = (uint8_t)fo_to_code(fo_floor(fo_div(r, a) * 255.0f + 0.5f), 0.0f, 255.0f);
  }
  return fo_f32_to_f16(a);
}

// Variance decode; `fourth`: quant8_wide, whose code 0 is stepped as half the smallest
// level (the update sees it, never 0).
FO_HD float fo_unsigned_decode(uint8_t code, float scale, bool fourth) {
  float u = (fourth && code == 0) ? (0.5f / 255.0f) * scale : fo_div((float)code, 255.0f) * scale;
  return fourth ? (u * u) * (u * u) : u * u;
}
