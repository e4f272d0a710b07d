// The fast arithmetic's state coding (src/kernels/host/fused/codec.rs), one element at a
// time: the same stored formats as the exact coding (fo_quant8.cuh, fo_master.cuh), with
// the operations reformulated as the host's fast kernel does them, in the same order, so
// the GPU gives its bits:
// - quant8 momentum decoded table-free, q·s/(254 − |q|), encoded 254y/(1 + |y|) with
//   y = x·(1/a);
// - quant8 variance held as its root r = sqrt(v) through the step: decoded q·(s/255)
//   (quant8_wide: u·u, code 0 standing for half a level), encoded floor(r·(255/a) + 0.5);
// - split masters b + q·(2^L/Q), the power of two built from b's exponent bits, and error
//   bits round(clamp((x − b)·2^−L, ±1)·Q), half away from zero.
// The host kernel's lane operations have x86 semantics where IEEE leaves a choice, and so
// do these: max(a, b) and min(a, b) give b unless a is greater (less), so a NaN in a gives
// b; float to integer gives INT32_MIN for NaN and out of range.
#pragma once
#include "fo_halfconv.cuh"
#include "fo_quant8.cuh"

FO_HD float fo_max_x86(float a, float b) { return a > b ? a : b; }
FO_HD float fo_min_x86(float a, float b) { return a < b ? a : b; }

// x (already integral or truncated) to int32 as x86's conversion: INT32_MIN (the "integer
// indefinite") for NaN and values outside [-2^31, 2^31).
FO_HD int32_t fo_to_i32_x86(float x) {
  return (x >= -2147483648.0f && x < 2147483648.0f) ? (int32_t)x : (int32_t)0x80000000u;
}
FO_HD int32_t fo_floor_i_x86(float x) { return fo_to_i32_x86(fo_floor(x)); }
FO_HD int32_t fo_trunc_i_x86(float x) { return fo_to_i32_x86(fo_trunc(x)); }

FO_HD int32_t fo_clamp_i32(int32_t x, int32_t lo, int32_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

// The decode factor of a quantized moment's group from its fp16 scale s (as f32): s for
// the momentum, s·(1/255) for the variance.
FO_HD float fo_fast_decode_factor(int32_t kind, float s) {
  return kind == FO_MOMENT_Q8_SIGNED ? s : s * (1.0f / 255.0f);
}

// A quantized moment's element from its code and its group's decode factor k: the
// momentum's value, the variance's root.
FO_HD float fo_fast_moment_decode(int32_t kind, uint32_t code, float k) {
  if (kind == FO_MOMENT_Q8_SIGNED) {
    float q = (float)(int32_t)(int8_t)(uint8_t)code;
    return fo_div(q * k, 254.0f - fo_abs(q));
  }
  uint32_t qi = (uint8_t)code;
  float r = (float)(int32_t)qi * k;
  if (kind == FO_MOMENT_Q8_SQRT) return r;
  float u = qi < 1u ? 0.5f * k : r;  // quant8_wide: code 0 is half the smallest level
  return u * u;
}

// What a quantized moment encodes from the value the step leaves (the momentum; the
// variance's root, quant8_wide's root of it), and that value's key: the group's scale is
// the largest key's value (NaN and negative keys as 0, as the host's max drops them).
FO_HD float fo_fast_encoded(int32_t kind, float x) { return kind == FO_MOMENT_Q8_FOURTH ? fo_sqrt(x) : x; }
// The exact coding's key, but for quant8_wide, whose root fo_fast_encoded already took.
FO_HD uint32_t fo_fast_quant_key(int32_t kind, float x) {
  return kind == FO_MOMENT_Q8_FOURTH ? fo_nonneg_bits(x) : fo_quant_key(kind, x);
}

// The encode factor of a group with f32 scale a: 1/a for the momentum, 255/a for the
// variance.
FO_HD float fo_fast_encode_factor(int32_t kind, float a) {
  return fo_div(kind == FO_MOMENT_Q8_SIGNED ? 1.0f : 255.0f, a);
}

// One element's code (its byte) with its group's encode factor k.
FO_HD uint32_t fo_fast_quant_code(int32_t kind, float x, float k) {
  if (kind == FO_MOMENT_Q8_SIGNED) {
    float y = x * k;
    float z = fo_div(254.0f * y, 1.0f + fo_abs(y));
    int32_t c = fo_isnan(z) ? 0 : fo_floor_i_x86(z + 0.5f);
    return (uint8_t)(int8_t)fo_clamp_i32(c, -128, 127);
  }
  // max(·, 0) sends NaN (and anything negative) to code 0; the byte saturates as an
  // unsigned lane does (INT32_MIN is 2^31 there: 255).
  uint32_t c = (uint32_t)fo_floor_i_x86(fo_max_x86(fo_fma(x, k, 0.5f), 0.0f));
  return c < 255u ? c : 255u;
}

// 2^L / Q for 16-bit parameter bits b (dtype 1 f16, 2 bf16), L = log2 of half their ulp,
// as one rounded product (inv_q = 1/Q rounded).
FO_HD float fo_fast_error_scale(int32_t dtype, uint16_t b, float inv_q) {
  if (dtype == 2) {
    uint32_t e = ((uint32_t)b << 16) & 0x7f800000u;
    uint32_t p = (e > (1u << 23) ? e : (1u << 23)) + (16u << 23);
    return fo_from_bits(p) * (inv_q * 5.9604644775390625e-8f);  // 2^-24 folded in, exactly
  }
  uint32_t e = b & 0x7c00u;
  e = e > (1u << 10) ? e : (1u << 10);
  return fo_from_bits((e << 13) + (101u << 23)) * inv_q;
}

// (x − b)·2^−L for 16-bit parameter bits b and e = x − b.
FO_HD float fo_fast_error_fraction(int32_t dtype, uint16_t b, float e) {
  if (dtype == 2) {
    uint32_t eb = ((uint32_t)b << 16) & 0x7f800000u;
    uint32_t e8 = eb > (8u << 23) ? eb : (8u << 23);
    float f = e * fo_from_bits((262u << 23) - e8);
    if (eb < (8u << 23)) {
      uint32_t lo = eb > (1u << 23) ? eb : (1u << 23);
      f = f * fo_from_bits(e8 - lo + (127u << 23));
    }
    return f;
  }
  uint32_t eb = b & 0x7c00u;
  eb = eb > (1u << 10) ? eb : (1u << 10);
  return e * fo_from_bits((153u << 23) - (eb << 13));
}

// Round half away from zero of s, as trunc(s ± (0.5 − 2^−25)).
FO_HD int32_t fo_fast_round_away(float s) {
  uint32_t half = (fo_bits(s) & 0x80000000u) | 0x3effffffu;
  return fo_trunc_i_x86(s + fo_from_bits(half));
}

// The f32 master of 16-bit parameter bits b (dtype 1 f16, 2 bf16) and error code q
// (`width` 8 or 16; 0: no error bits).
FO_HD float fo_fast_master(int32_t dtype, uint16_t b, int32_t width, int32_t q) {
  float x = fo_half_to_f32(dtype, b);
  if (width == 0) return x;
  float inv_q = width == 8 ? 1.0f / 127.0f : 1.0f / 32767.0f;
  return fo_fma((float)q, fo_fast_error_scale(dtype, b, inv_q), x);
}

// Master x's error code against its rounded 16-bit bits b (width 8 or 16).
FO_HD int32_t fo_fast_error_code(int32_t dtype, uint16_t b, int32_t width, float x) {
  float f = fo_fast_error_fraction(dtype, b, x - fo_half_to_f32(dtype, b));
  f = fo_max_x86(fo_min_x86(f, 1.0f), -1.0f);
  int32_t c = fo_fast_round_away(f * (width == 8 ? 127.0f : 32767.0f));
  return width == 8 ? fo_clamp_i32(c, -128, 127) : fo_clamp_i32(c, -32768, 32767);
}
