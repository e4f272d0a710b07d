// FlashOptim 0.1.4's master-weight split (see src/optim/math/master_split.rs): error bits hold
// the f32 master's distance from its 16-bit parameter in units of half an ulp, int8
// (q = 127, 24-bit masters) or int16 (q = 32767, 32-bit masters).
#pragma once
#include "fo_halfconv.cuh"

// log2 of half an ulp of the 16-bit value `bits` (dtype 2 bf16, 1 f16).
FO_HD int32_t fo_half_ulp_log2(int32_t dtype, uint16_t bits) {
  if (dtype == 2) {
    int32_t e = (bits >> 7) & 0xff;
    return (e == 0 ? -126 : e - 127) - 8;
  }
  int32_t e = (bits >> 10) & 0x1f;
  return (e == 0 ? -14 : e - 15) - 11;
}

// 2^k for k in the normal range.
FO_HD float fo_pow2(int32_t k) { return fo_from_bits((uint32_t)(k + 127) << 23); }

// An integral `x` as a code, NaN as 0, clamped to [lo, hi].
FO_HD int32_t fo_to_code(float x, float lo, float hi) {
  if (fo_isnan(x)) return 0;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  return (int32_t)x;
}

// The error code for master `x` stored as `bits`; `q` is 127 or 32767.
FO_HD int32_t fo_error_encode(int32_t dtype, float x, uint16_t bits, float q) {
  int32_t l = fo_half_ulp_log2(dtype, bits);
  float e = x - fo_half_to_f32(dtype, bits);
  int32_t n = -l;
  int32_t h = fo_floor_half(n);
  float en = (e * fo_pow2(h)) * fo_pow2(n - h);
  en = en < -1.0f ? -1.0f : en;  // NaN passes through and becomes code 0
  en = en > 1.0f ? 1.0f : en;
  float s = en * q;
  return fo_to_code(fo_copysign(fo_floor(fo_abs(s) + 0.5f), s), -q, q);
}

// The master value of `bits` whose error code, divided by its q, is `c`.
FO_HD float fo_error_reconstruct_unit(int32_t dtype, uint16_t bits, float c) {
  int32_t l = fo_half_ulp_log2(dtype, bits);
  int32_t h = fo_floor_half(l);
  return fo_half_to_f32(dtype, bits) + (c * fo_pow2(h)) * fo_pow2(l - h);
}

// The master value of `bits` with error code `code`.
FO_HD float fo_error_reconstruct(int32_t dtype, uint16_t bits, int32_t code, float q) {
  return fo_error_reconstruct_unit(dtype, bits, fo_div((float)code, q));
}
