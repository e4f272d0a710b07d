//! FlashOptim 0.1.4's master-weight split: a bf16 (or f16) parameter plus signed integer
//! "error bits" that store the f32 master value's distance from it, in units of half a
//! ulp of the stored value. 24-bit masters carry int8 codes (`Q = 127`), 32-bit masters
//! int16 codes (`Q = 32767`).
//!
//! With `L` = log2(half an ulp of the 16-bit value `b`) (bf16: unbiased exponent − 8,
//! exponent field 0 counting as −126; f16: exponent − 11, field 0 counting as −14):
//! encode `e = x − f32(b)`, `n = −L`, `h = floor(n/2)`, `e_n = clamp((e·2^h)·2^(n−h), −1, 1)`,
//! `code = copysign(floor(|e_n·Q| + 0.5), e_n·Q)` (round half away from zero);
//! decode `x = f32(b) + ((code/Q)·2^h')·2^(L−h')` with `h' = floor(L/2)`. The power of two
//! is split in two factors so neither overflows. Bit-exact against `flash_ecc.safetensors`.
use crate::dtype::DType;
use crate::error::{Error, Result};

/// An error-bits code type: int8 (24-bit masters) or int16 (32-bit masters).
pub trait ErrorCode: Copy + Default + Send + Sync + 'static {
    /// Largest code magnitude, as f32.
    const Q: f32;
    const DTYPE: DType;
    fn from_rounded(x: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl ErrorCode for i8 {
    const Q: f32 = 127.0;
    const DTYPE: DType = DType::I8;
    #[inline(always)]
    fn from_rounded(x: f32) -> i8 {
        // |x| <= 127 by construction; NaN becomes 0 (as `as` would), vectorizably.
        super::quant8::to_code(x, -127.0, 127.0) as i8
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
}

impl ErrorCode for i16 {
    const Q: f32 = 32767.0;
    const DTYPE: DType = DType::I16;
    #[inline(always)]
    fn from_rounded(x: f32) -> i16 {
        super::quant8::to_code(x, -32767.0, 32767.0) as i16
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
}

/// The 16-bit float formats a split master can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    BF16,
    F16,
}

impl Half {
    pub fn from_dtype(d: DType) -> Result<Half> {
        match d {
            DType::BF16 => Ok(Half::BF16),
            DType::F16 => Ok(Half::F16),
            other => Err(Error::Dtype(format!(
                "master-weight error bits need a bf16 or f16 parameter, got {other} \
                 (f32 parameters already hold a full master: set master_weight_bits = 0)"
            ))),
        }
    }

    /// log2 of half an ulp of the value with these bits.
    #[inline(always)]
    pub fn half_ulp_log2(self, bits: u16) -> i32 {
        match self {
            Half::BF16 => {
                let e = ((bits >> 7) & 0xff) as i32;
                (if e == 0 { -126 } else { e - 127 }) - 8
            }
            Half::F16 => {
                let e = ((bits >> 10) & 0x1f) as i32;
                (if e == 0 { -14 } else { e - 15 }) - 11
            }
        }
    }

    #[inline(always)]
    pub fn to_f32(self, bits: u16) -> f32 {
        match self {
            Half::BF16 => f32::from_bits((bits as u32) << 16),
            Half::F16 => half::f16::from_bits(bits).to_f32(),
        }
    }

    /// Round to nearest even (overflow to inf, subnormals kept), as torch and Triton cast.
    #[inline(always)]
    pub fn from_f32(self, x: f32) -> u16 {
        match self {
            Half::BF16 => bf16_bits_rne(x),
            Half::F16 => half::f16::from_f32(x).to_bits(),
        }
    }
}

/// f32 → bf16 bits, round to nearest even; NaN stays a (quiet) NaN. Branch-free so
/// loops over it vectorize.
#[inline(always)]
pub fn bf16_bits_rne(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1))) >> 16;
    let nan = (b >> 16) | 0x40;
    (if x.is_nan() { nan } else { rounded }) as u16
}

/// `2^k` for `k` in the normal range (callers keep |k| <= 67).
#[inline(always)]
pub(crate) fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// The code for master value `x` stored as 16-bit `bits`.
#[inline(always)]
pub fn encode_one<C: ErrorCode>(h: Half, x: f32, bits: u16) -> C {
    let l = h.half_ulp_log2(bits);
    let e = x - h.to_f32(bits);
    let n = -l; // exact in f32: |n| <= 134
    let hh = n.div_euclid(2);
    let en = ((e * pow2(hh)) * pow2(n - hh)).clamp(-1.0, 1.0);
    let s = en * C::Q;
    C::from_rounded((s.abs() + 0.5).floor().copysign(s))
}

/// The master value for 16-bit `bits` with error code `code`.
#[inline(always)]
pub fn reconstruct_one<C: ErrorCode>(h: Half, bits: u16, code: C) -> f32 {
    let l = h.half_ulp_log2(bits);
    let c = code.to_f32() / C::Q;
    let hh = l.div_euclid(2);
    h.to_f32(bits) + (c * pow2(hh)) * pow2(l - hh)
}

fn check(what: &str, a: usize, b: usize, c: usize) -> Result<()> {
    if a != b || a != c {
        return Err(Error::Shape(format!(
            "{what}: lengths {a}, {b} and {c} differ"
        )));
    }
    Ok(())
}

/// Error bits for masters `master` stored as `param` (bf16/f16 bit patterns of `dtype`).
/// FlashOptim's `compute_ecc_bits`.
pub fn encode_error_bits<C: ErrorCode>(
    dtype: DType,
    master: &[f32],
    param: &[u16],
    out: &mut [C],
) -> Result<()> {
    let h = Half::from_dtype(dtype)?;
    check("encode_error_bits", master.len(), param.len(), out.len())?;
    for ((o, &x), &b) in out.iter_mut().zip(master).zip(param) {
        *o = encode_one(h, x, b);
    }
    Ok(())
}

/// Master values from 16-bit params and their error bits. FlashOptim's
/// `reconstruct_fp32_param`.
pub fn reconstruct<C: ErrorCode>(
    dtype: DType,
    param: &[u16],
    codes: &[C],
    out: &mut [f32],
) -> Result<()> {
    let h = Half::from_dtype(dtype)?;
    check("reconstruct", param.len(), codes.len(), out.len())?;
    for ((o, &b), &c) in out.iter_mut().zip(param).zip(codes) {
        *o = reconstruct_one(h, b, c);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_half_crate() {
        for x in [
            1.0f32,
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-9),
            -3.3e38,
            3.39e38,
            1e-40,
            -0.0,
            f32::INFINITY,
        ] {
            assert_eq!(bf16_bits_rne(x), half::bf16::from_f32(x).to_bits(), "{x}");
        }
        assert!(f32::from_bits((bf16_bits_rne(f32::NAN) as u32) << 16).is_nan());
    }

    #[test]
    fn split_master_round_trips_within_a_code() {
        for h in [Half::BF16, Half::F16] {
            for &x in &[0.3141f32, -2.5, 1e-3, 123.456] {
                let b = h.from_f32(x);
                let c: i16 = encode_one(h, x, b);
                let r = reconstruct_one(h, b, c);
                let ulp = 2f32.powi(h.half_ulp_log2(b) + 1);
                assert!((r - x).abs() <= ulp / 32767.0, "{h:?} {x} {r}");
            }
        }
    }

    #[test]
    fn f32_params_are_refused_clearly() {
        let e = encode_error_bits::<i8>(DType::F32, &[1.0], &[0], &mut [0]).unwrap_err();
        assert!(e.to_string().contains("master_weight_bits = 0"), "{e}");
    }
}
