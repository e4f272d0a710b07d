// bf16 / f16 <-> f32 written on the bits, so the GPU and the host round identically
// (nearest even, overflow to infinity, subnormals kept, NaN quieted) without relying on
// either side's conversion instructions. Matches fo's Rust `Half` (bf16_bits_rne and
// the `half` crate) bit for bit.
#pragma once
#include "fo_shim.cuh"

FO_HD float fo_bf16_to_f32(uint16_t b) { return fo_from_bits((uint32_t)b << 16); }

FO_HD uint16_t fo_f32_to_bf16(float x) {
  uint32_t b = fo_bits(x);
  if (fo_isnan(x)) return (uint16_t)((b >> 16) | 0x40u);
  return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

FO_HD float fo_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return fo_from_bits(sign | 0x7f800000u | (man ? 0x400000u : 0u) | (man << 13));
  if (exp == 0) {
    // man * 2^-24 is exact in f32.
    float mag = (float)man * 5.9604644775390625e-8f;
    return fo_from_bits(sign | fo_bits(mag));
  }
  return fo_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

FO_HD uint16_t fo_f32_to_f16(float x) {
  uint32_t b = fo_bits(x);
  uint32_t sign = (b >> 16) & 0x8000u;
  uint32_t exp = (b >> 23) & 0xffu;
  uint32_t man = b & 0x7fffffu;
  if (exp == 0xff) return (uint16_t)(sign | 0x7c00u | (man ? 0x200u : 0u) | (man >> 13));
  int32_t e = (int32_t)exp - 127 + 15;
  if (e >= 31) return (uint16_t)(sign | 0x7c00u);
  if (e <= 0) {
    // Subnormal (or zero) result: shift the full significand, round to nearest even.
    int32_t shift = 14 - e;
    if (shift > 24) return (uint16_t)sign;
    uint32_t full = man | 0x800000u;
    uint32_t q = full >> shift;
    uint32_t rest = full & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1);
    if (rest > half || (rest == half && (q & 1u))) q += 1;
    return (uint16_t)(sign | q);
  }
  uint32_t q = ((uint32_t)e << 10) | (man >> 13);
  uint32_t rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (q & 1u))) q += 1;  // may carry into inf: correct
  return (uint16_t)(sign | q);
}

// dtype codes of the C ABI: 0 F32, 1 F16, 2 BF16.
FO_HD float fo_load_any(const void* p, int32_t dtype, uint64_t i) {
  if (dtype == 0) return ((const float*)p)[i];
  uint16_t b = ((const uint16_t*)p)[i];
  return dtype == 2 ? fo_bf16_to_f32(b) : fo_f16_to_f32(b);
}

FO_HD uint16_t fo_f32_to_half(int32_t dtype, float x) { return dtype == 2 ? fo_f32_to_bf16(x) : fo_f32_to_f16(x); }
FO_HD float fo_half_to_f32(int32_t dtype, uint16_t b) { return dtype == 2 ? fo_bf16_to_f32(b) : fo_f16_to_f32(b); }
