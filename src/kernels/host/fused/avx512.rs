//! The AVX-512 backend of `Lanes`: one zmm register per 16 lanes, masked loads and
//! stores for short groups, saturating packs for the codes. Each method is the one
//! instruction (or short sequence) whose result the portable backend defines.
use std::arch::x86_64::*;

use super::lanes::{Lanes, W};
use crate::optim::math::rule::arith::Arith;

/// Proof that this CPU has AVX-512 F, BW, VL, DQ, FMA and F16C: only `detect` makes one.
#[derive(Clone, Copy)]
pub struct Avx512(());

impl Avx512 {
    pub fn detect() -> Option<Avx512> {
        let ok = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        ok.then_some(Avx512(()))
    }
}

#[inline(always)]
fn mask(n: usize) -> __mmask16 {
    if n >= W {
        0xffff
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}

// SAFETY (every `unsafe` block below): an `Avx512` value exists only where `detect`
// found the instructions; pointer arguments are the callers' contract.
impl Arith for Avx512 {
    type F = __m512;
    type M = __mmask16;

    #[inline(always)]
    fn splat(self, x: f32) -> __m512 {
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    fn add(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    fn div(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_div_ps(a, b) }
    }
    #[inline(always)]
    fn sqrt(self, a: __m512) -> __m512 {
        unsafe { _mm512_sqrt_ps(a) }
    }
    #[inline(always)]
    fn fma(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn fms(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmsub_ps(a, b, c) }
    }
    #[inline(always)]
    fn lt(self, a: __m512, b: __m512) -> __mmask16 {
        unsafe { _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, b) }
    }
    #[inline(always)]
    fn gt(self, a: __m512, b: __m512) -> __mmask16 {
        unsafe { _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, b) }
    }
    #[inline(always)]
    fn select(self, m: __mmask16, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mask_blend_ps(m, b, a) }
    }
}

impl Lanes for Avx512 {
    const SPECIALIZE: bool = true;
    type I = __m512i;
    #[inline(always)]
    fn isplat(self, x: u32) -> __m512i {
        unsafe { _mm512_set1_epi32(x as i32) }
    }
    #[inline(always)]
    fn min(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_min_ps(a, b) }
    }
    #[inline(always)]
    fn max(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_max_ps(a, b) }
    }
    #[inline(always)]
    fn abs(self, a: __m512) -> __m512 {
        unsafe {
            _mm512_castsi512_ps(_mm512_and_si512(
                _mm512_castps_si512(a),
                _mm512_set1_epi32(0x7fff_ffff),
            ))
        }
    }
    #[inline(always)]
    fn to_bits(self, a: __m512) -> __m512i {
        unsafe { _mm512_castps_si512(a) }
    }
    #[inline(always)]
    fn bits_as_f(self, i: __m512i) -> __m512 {
        unsafe { _mm512_castsi512_ps(i) }
    }
    #[inline(always)]
    fn i2f(self, i: __m512i) -> __m512 {
        unsafe { _mm512_cvtepi32_ps(i) }
    }
    #[inline(always)]
    fn floor_i(self, a: __m512) -> __m512i {
        unsafe { _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(a) }
    }
    #[inline(always)]
    fn trunc_i(self, a: __m512) -> __m512i {
        unsafe { _mm512_cvttps_epi32(a) }
    }
    #[inline(always)]
    fn and(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_and_si512(a, b) }
    }
    #[inline(always)]
    fn or(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_or_si512(a, b) }
    }
    #[inline(always)]
    fn iadd(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_add_epi32(a, b) }
    }
    #[inline(always)]
    fn isub(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_sub_epi32(a, b) }
    }
    #[inline(always)]
    fn shl<const N: u32>(self, a: __m512i) -> __m512i {
        unsafe { _mm512_slli_epi32::<N>(a) }
    }
    #[inline(always)]
    fn shr<const N: u32>(self, a: __m512i) -> __m512i {
        unsafe { _mm512_srli_epi32::<N>(a) }
    }
    #[inline(always)]
    fn umax(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_max_epu32(a, b) }
    }
    #[inline(always)]
    fn ord(self, a: __m512) -> __mmask16 {
        unsafe { _mm512_cmp_ps_mask::<_CMP_ORD_Q>(a, a) }
    }
    #[inline(always)]
    fn ult(self, a: __m512i, b: __m512i) -> __mmask16 {
        unsafe { _mm512_cmplt_epu32_mask(a, b) }
    }
    #[inline(always)]
    fn any(self, m: __mmask16) -> bool {
        m != 0
    }
    #[inline(always)]
    fn iselect(self, m: __mmask16, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_mask_blend_epi32(m, b, a) }
    }
    #[inline(always)]
    fn keep(self, n: usize, a: __m512) -> __m512 {
        unsafe { _mm512_maskz_mov_ps(mask(n), a) }
    }
    #[inline(always)]
    fn f16_to_f32(self, i: __m512i) -> __m512 {
        unsafe { _mm512_cvtph_ps(_mm512_cvtepi32_epi16(i)) }
    }
    #[inline(always)]
    fn f32_to_f16(self, a: __m512) -> __m512i {
        unsafe {
            _mm512_cvtepu16_epi32(_mm512_cvtps_ph::<
                { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
            >(a))
        }
    }
    #[inline(always)]
    fn max16(self, x: &[__m512; W]) -> __m512 {
        // A transpose of maxima: each level halves the lanes each vector occupies (quarters
        // across registers, then pairs and single lanes within quarters). The tree leaves
        // input slot s in lane (s%4)·4 + s/4, so slots are filled in that order.
        // (Loops, not closures: a closure would not inherit the target features.)
        unsafe {
            let mut y = [_mm512_setzero_ps(); 8];
            for (i, y) in y.iter_mut().enumerate() {
                let s0 = 2 * i;
                let s1 = s0 + 1;
                let (a, b) = (x[(s0 % 4) * 4 + s0 / 4], x[(s1 % 4) * 4 + s1 / 4]);
                *y = _mm512_max_ps(
                    _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                    _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
                );
            }
            let mut z = [_mm512_setzero_ps(); 4];
            for (i, z) in z.iter_mut().enumerate() {
                let (a, b) = (y[2 * i], y[2 * i + 1]);
                *z = _mm512_max_ps(
                    _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                    _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
                );
            }
            let mut w = [_mm512_setzero_ps(); 2];
            for (i, w) in w.iter_mut().enumerate() {
                let (a, b) = (z[2 * i], z[2 * i + 1]);
                *w = _mm512_max_ps(
                    _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
                    _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
                );
            }
            _mm512_max_ps(
                _mm512_shuffle_ps::<0b10_00_10_00>(w[0], w[1]),
                _mm512_shuffle_ps::<0b11_01_11_01>(w[0], w[1]),
            )
        }
    }

    #[inline(always)]
    unsafe fn load_f32(self, p: *const f32, n: usize) -> __m512 {
        if n >= W {
            _mm512_loadu_ps(p)
        } else {
            _mm512_maskz_loadu_ps(mask(n), p)
        }
    }
    #[inline(always)]
    unsafe fn store_f32(self, p: *mut f32, n: usize, a: __m512) {
        if n >= W {
            _mm512_storeu_ps(p, a)
        } else {
            _mm512_mask_storeu_ps(p, mask(n), a)
        }
    }
    #[inline(always)]
    unsafe fn load_u16(self, p: *const u16, n: usize) -> __m512i {
        let h = if n >= W {
            _mm256_loadu_si256(p as *const __m256i)
        } else {
            _mm256_maskz_loadu_epi16(mask(n), p as *const i16)
        };
        _mm512_cvtepu16_epi32(h)
    }
    #[inline(always)]
    unsafe fn store_u16(self, p: *mut u16, n: usize, a: __m512i) {
        if n >= W {
            _mm256_storeu_si256(p as *mut __m256i, _mm512_cvtepi32_epi16(a))
        } else {
            _mm512_mask_cvtepi32_storeu_epi16(p as *mut i16, mask(n), a)
        }
    }
    #[inline(always)]
    unsafe fn load_i8(self, p: *const i8, n: usize) -> __m512i {
        let b = if n >= W {
            _mm_loadu_si128(p as *const __m128i)
        } else {
            _mm_maskz_loadu_epi8(mask(n), p)
        };
        _mm512_cvtepi8_epi32(b)
    }
    #[inline(always)]
    unsafe fn load_u8(self, p: *const u8, n: usize) -> __m512i {
        let b = if n >= W {
            _mm_loadu_si128(p as *const __m128i)
        } else {
            _mm_maskz_loadu_epi8(mask(n), p as *const i8)
        };
        _mm512_cvtepu8_epi32(b)
    }
    #[inline(always)]
    unsafe fn load_i16(self, p: *const i16, n: usize) -> __m512i {
        let h = if n >= W {
            _mm256_loadu_si256(p as *const __m256i)
        } else {
            _mm256_maskz_loadu_epi16(mask(n), p)
        };
        _mm512_cvtepi16_epi32(h)
    }
    #[inline(always)]
    unsafe fn store_i8_sat(self, p: *mut i8, n: usize, a: __m512i) {
        if n >= W {
            _mm_storeu_si128(p as *mut __m128i, _mm512_cvtsepi32_epi8(a))
        } else {
            _mm512_mask_cvtsepi32_storeu_epi8(p, mask(n), a)
        }
    }
    #[inline(always)]
    unsafe fn store_u8_sat(self, p: *mut u8, n: usize, a: __m512i) {
        if n >= W {
            _mm_storeu_si128(p as *mut __m128i, _mm512_cvtusepi32_epi8(a))
        } else {
            _mm512_mask_cvtusepi32_storeu_epi8(p as *mut i8, mask(n), a)
        }
    }
    #[inline(always)]
    unsafe fn store_i16_sat(self, p: *mut i16, n: usize, a: __m512i) {
        if n >= W {
            _mm256_storeu_si256(p as *mut __m256i, _mm512_cvtsepi32_epi16(a))
        } else {
            _mm512_mask_cvtsepi32_storeu_epi16(p, mask(n), a)
        }
    }
}
