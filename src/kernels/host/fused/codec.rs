//! Decoding and encoding one half of a quantization group (16 lanes, fewer at a tensor's
//! end) between the stored formats and f32 lanes, in the `fast` arithmetic:
//! - split masters `b + q·(2^L/Q)` with the power of two built from `b`'s exponent bits
//!   (one multiply and one fused multiply-add; no division); error bits
//!   `round(clamp((x − b)·2^−L, ±1)·Q)`, half away from zero;
//! - bf16 rounding to nearest even on the bits (NaN kept quiet), f16 by conversion;
//! - quant8 momentum decoded table-free, `q·s/(254 − |q|)`, encoded `254y/(1 + |y|)` with
//!   `y = x·(1/a)`; quant8 variance kept as its root `r = sqrt(v)`: `q·(s/255)` and
//!   `floor(r·(255/a) + 0.5)` (quant8_wide: `u·u` with code 0 standing for half a level,
//!   and one more square root to encode).
//!
//! Codes of NaN values are 0, as in the exact format.
use half::f16;

use super::lanes::{Lanes, W};
use crate::optim::math::master_split::Half;
use crate::optim::math::quant8::ABSMAX_FLOOR;
use crate::optim::math::state::Root;

/// Where a parameter chunk lives.
#[derive(Clone, Copy)]
pub enum ParamPtr {
    F32(*mut f32),
    Half {
        h: Half,
        bits: *mut u16,
        err: ErrPtr,
    },
}

#[derive(Clone, Copy)]
pub enum ErrPtr {
    None,
    I8(*mut i8),
    I16(*mut i16),
}

#[derive(Clone, Copy)]
pub enum GradPtr {
    F32(*const f32),
    Half(Half, *const u16),
}

/// A moment state chunk; scales are indexed by group.
#[derive(Clone, Copy)]
pub enum MomentPtr {
    F32(*mut f32),
    Half(Half, *mut u16),
    Signed(*mut i8, *mut f16),
    Unsigned(*mut u8, *mut f16, Root),
}

const EXP: u32 = 0x7f80_0000;

/// 16-bit float bits (zero-extended lanes) to f32.
#[inline(always)]
fn half_to_f32<L: Lanes>(l: L, h: Half, bits: L::I) -> L::F {
    match h {
        Half::BF16 => l.bits_as_f(l.shl::<16>(bits)),
        Half::F16 => l.f16_to_f32(bits),
    }
}

/// f32 to bf16 bits (round to nearest even; NaN stays a quiet NaN), as the f32 value
/// with the low 16 bits cleared.
#[inline(always)]
fn bf16_round<L: Lanes>(l: L, x: L::F) -> L::I {
    let b = l.to_bits(x);
    let lsb = l.and(l.shr::<16>(b), l.isplat(1));
    let rounded = l.iadd(b, l.iadd(lsb, l.isplat(0x7fff)));
    let nan = l.or(b, l.isplat(0x0040_0000));
    l.and(l.iselect(l.ord(x), rounded, nan), l.isplat(0xffff_0000))
}

/// f32 to 16-bit bits in the low half of each lane, and the rounded value.
#[inline(always)]
fn round_half<L: Lanes>(l: L, h: Half, x: L::F) -> (L::I, L::F) {
    match h {
        Half::BF16 => {
            let r = bf16_round(l, x);
            (l.shr::<16>(r), l.bits_as_f(r))
        }
        Half::F16 => {
            let b = l.f32_to_f16(x);
            (b, l.f16_to_f32(b))
        }
    }
}

/// `2^L / Q` for 16-bit values `bits`, `L` = log2 of half their ulp
/// (`Half::half_ulp_log2`), rounded once.
#[inline(always)]
fn error_scale<L: Lanes>(l: L, h: Half, bits: L::I, inv_q: f32) -> L::F {
    match h {
        // 2^L = 2^(max(E,1)+16−127) · 2^−24, E the exponent field: exact even where 2^L
        // is subnormal (L >= −134); the 2^−24 is folded into the constant.
        Half::BF16 => {
            let e = l.and(l.shl::<16>(bits), l.isplat(EXP));
            let p = l.iadd(l.umax(e, l.isplat(1 << 23)), l.isplat(16 << 23));
            l.mul(l.bits_as_f(p), l.splat(inv_q * f32::powi(2.0, -24)))
        }
        // 2^L = 2^(max(e,1) − 26), always a normal f32.
        Half::F16 => {
            let e = l.umax(l.and(bits, l.isplat(0x7c00)), l.isplat(1 << 10));
            let p = l.iadd(l.shl::<13>(e), l.isplat(101 << 23));
            l.mul(l.bits_as_f(p), l.splat(inv_q))
        }
    }
}

/// `(x − b)·2^−L` for 16-bit values `bits` (value `b`).
#[inline(always)]
fn error_fraction<L: Lanes>(l: L, h: Half, bits: L::I, e: L::F) -> L::F {
    match h {
        Half::BF16 => {
            // 2^(135 − max(E,8)) fits an f32 exponent; the few lanes below 2^−119
            // (E < 8) take the rest of 2^−L as a second, exact factor.
            let eb = l.and(l.shl::<16>(bits), l.isplat(EXP));
            let e8 = l.umax(eb, l.isplat(8 << 23));
            let f = l.mul(e, l.bits_as_f(l.isub(l.isplat(262 << 23), e8)));
            let tiny = l.ult(eb, l.isplat(8 << 23));
            if l.any(tiny) {
                let rest = l.iadd(
                    l.isub(e8, l.umax(eb, l.isplat(1 << 23))),
                    l.isplat(127 << 23),
                );
                l.select(tiny, l.mul(f, l.bits_as_f(rest)), f)
            } else {
                f
            }
        }
        Half::F16 => {
            let eb = l.umax(l.and(bits, l.isplat(0x7c00)), l.isplat(1 << 10));
            l.mul(e, l.bits_as_f(l.isub(l.isplat(153 << 23), l.shl::<13>(eb))))
        }
    }
}

/// Round half away from zero of `s` (|s| < 2^22), as `trunc(s ± (0.5 − 2^−25))`: the sum
/// rounds up to the next integer exactly when |s|'s fraction is at least one half (the
/// tie 0.5 + (0.5 − 2^−25) = 1 − 2^−25 rounds to even, 1.0), where `floor(|s| + 0.5)`
/// with its sign restored takes two more operations.
#[inline(always)]
fn round_away<L: Lanes>(l: L, s: L::F) -> L::I {
    let sign = l.and(l.to_bits(s), l.isplat(0x8000_0000));
    let half = l.or(sign, l.isplat(0.5f32.next_down().to_bits()));
    l.trunc_i(l.add(s, l.bits_as_f(half)))
}

/// Master values of elements `[i, i+n)`.
///
/// # Safety
/// The pointers are valid for those elements.
#[inline(always)]
pub unsafe fn load_param<L: Lanes>(l: L, p: ParamPtr, i: usize, n: usize) -> L::F {
    match p {
        ParamPtr::F32(s) => l.load_f32(s.add(i), n),
        ParamPtr::Half { h, bits, err } => {
            let b = l.load_u16(bits.add(i), n);
            let x = half_to_f32(l, h, b);
            let (q, inv_q) = match err {
                ErrPtr::None => return x,
                ErrPtr::I8(e) => (l.load_i8(e.add(i), n), 1.0 / 127.0),
                ErrPtr::I16(e) => (l.load_i16(e.add(i), n), 1.0 / 32767.0),
            };
            l.fma(l.i2f(q), error_scale(l, h, b, inv_q), x)
        }
    }
}

/// Rounds masters `x` into elements `[i, i+n)` and splits off their error bits.
///
/// # Safety
/// As `load_param`.
#[inline(always)]
pub unsafe fn store_param<L: Lanes>(l: L, p: ParamPtr, i: usize, n: usize, x: L::F) {
    match p {
        ParamPtr::F32(s) => l.store_f32(s.add(i), n, x),
        ParamPtr::Half { h, bits, err } => {
            let (b, v) = round_half(l, h, x);
            l.store_u16(bits.add(i), n, b);
            let q = match err {
                ErrPtr::None => return,
                ErrPtr::I8(_) => 127.0,
                ErrPtr::I16(_) => 32767.0,
            };
            let f = error_fraction(l, h, b, l.sub(x, v));
            let f = l.max(l.min(f, l.splat(1.0)), l.splat(-1.0));
            let code = round_away(l, l.mul(f, l.splat(q)));
            match err {
                ErrPtr::I8(e) => l.store_i8_sat(e.add(i), n, code),
                ErrPtr::I16(e) => l.store_i16_sat(e.add(i), n, code),
                ErrPtr::None => {}
            }
        }
    }
}

/// Gradient elements `[i, i+n)` as f32.
///
/// # Safety
/// As `load_param`.
#[inline(always)]
pub unsafe fn load_grad<L: Lanes>(l: L, g: GradPtr, i: usize, n: usize) -> L::F {
    match g {
        GradPtr::F32(s) => l.load_f32(s.add(i), n),
        GradPtr::Half(h, s) => half_to_f32(l, h, l.load_u16(s.add(i), n)),
    }
}

/// Whether a moment state is quantized (encoded against its group's maximum).
#[inline(always)]
pub fn is_quantized(m: MomentPtr) -> bool {
    matches!(m, MomentPtr::Signed(..) | MomentPtr::Unsigned(..))
}

/// The decode factors of groups `[g0, g0+ng)` (at most `W`), lane `j` for group `g0+j`:
/// the fp16 scale for momentum, scale/255 for variance; nothing for unquantized states.
///
/// # Safety
/// The scales of those groups are valid.
#[inline(always)]
pub unsafe fn decode_factors<L: Lanes>(l: L, m: MomentPtr, g0: usize, ng: usize) -> [f32; W] {
    let mut out = [0f32; W];
    let (sc, k) = match m {
        MomentPtr::Signed(_, sc) => (sc, 1.0),
        MomentPtr::Unsigned(_, sc, _) => (sc, 1.0 / 255.0),
        _ => return out,
    };
    let scales = l.f16_to_f32(l.load_u16(sc.add(g0) as *const u16, ng));
    let f = if k == 1.0 {
        scales
    } else {
        l.mul(scales, l.splat(k))
    };
    l.store_f32(out.as_mut_ptr(), W, f);
    out
}

/// The two halves `[lo, lo+n0)` and `[lo+W, lo+W+n1)` of the group starting at `lo`
/// (decode factor `k`, from `decode_factors`): quant8 variance as its root `sqrt(v)`.
///
/// # Safety
/// As `load_param`; `lo` is a multiple of the group size.
#[inline(always)]
pub unsafe fn load_moment<L: Lanes>(
    l: L,
    m: MomentPtr,
    lo: usize,
    n: [usize; 2],
    k: f32,
) -> [L::F; 2] {
    // Plain loops, no closures: a closure would be compiled without the caller's target
    // features, and every intrinsic inside it would become a call.
    let mut out = [l.splat(0.0); 2];
    let kv = l.splat(k);
    for h in 0..2 {
        let at = lo + h * W;
        out[h] = match m {
            MomentPtr::F32(s) => l.load_f32(s.add(at), n[h]),
            MomentPtr::Half(hk, s) => half_to_f32(l, hk, l.load_u16(s.add(at), n[h])),
            MomentPtr::Signed(q, _) => {
                let q = l.i2f(l.load_i8(q.add(at), n[h]));
                l.div(l.mul(q, kv), l.sub(l.splat(254.0), l.abs(q)))
            }
            MomentPtr::Unsigned(q, _, root) => {
                let qi = l.load_u8(q.add(at), n[h]);
                let r = l.mul(l.i2f(qi), kv);
                match root {
                    Root::Sqrt => r,
                    // Code 0 stands for half the smallest level (`StateFormat::Quant8Wide`).
                    Root::Fourth => {
                        let u = l.select(l.ult(qi, l.isplat(1)), l.splat(0.5 * k), r);
                        l.mul(u, u)
                    }
                }
            }
        };
    }
    out
}

/// Stores an unquantized moment's group.
///
/// # Safety
/// As `load_moment`.
#[inline(always)]
pub unsafe fn store_plain<L: Lanes>(l: L, m: MomentPtr, lo: usize, n: [usize; 2], x: [L::F; 2]) {
    for h in 0..2 {
        match m {
            MomentPtr::F32(s) => l.store_f32(s.add(lo + h * W), n[h], x[h]),
            MomentPtr::Half(hk, s) => {
                l.store_u16(s.add(lo + h * W), n[h], round_half(l, hk, x[h]).0)
            }
            _ => {}
        }
    }
}

/// The values a quantized moment encodes (quant8_wide variance: `v^(1/4)` from `sqrt(v)`),
/// and their lane-wise magnitude maximum over the group's elements (NaN ignored: a NaN
/// lane loses to the other operand).
#[inline(always)]
pub fn prepare<L: Lanes>(l: L, m: MomentPtr, n: [usize; 2], x: [L::F; 2]) -> ([L::F; 2], L::F) {
    let zero = l.splat(0.0);
    // A short group's missing lanes must not reach its scale.
    let x = if n[1] < W {
        [l.keep(n[0], x[0]), l.keep(n[1], x[1])]
    } else {
        x
    };
    match m {
        MomentPtr::Unsigned(_, _, root) => {
            let r = if root == Root::Fourth {
                [l.sqrt(x[0]), l.sqrt(x[1])]
            } else {
                x
            };
            // Roots are >= 0 or NaN: max(r, 0) drops NaN (and -0).
            (r, l.max(l.max(r[0], zero), l.max(r[1], zero)))
        }
        _ => (x, l.max(l.abs(x[0]), l.max(l.abs(x[1]), zero))),
    }
}

/// From the lane-wise maxima of groups `[g0, g0+ng)` (`prepare`): each group's scale
/// `a = max(absmax, 1e-12)`, stored as fp16, and the encode factors, lane `j` for group
/// `g0+j`: `1/a` for momentum, `255/a` for variance.
///
/// # Safety
/// As `decode_factors`.
#[inline(always)]
pub unsafe fn encode_scales<L: Lanes>(
    l: L,
    m: MomentPtr,
    g0: usize,
    ng: usize,
    maxima: &[L::F; W],
) -> [f32; W] {
    let a = l.max(l.max16(maxima), l.splat(ABSMAX_FLOOR));
    let (sc, num) = match m {
        MomentPtr::Signed(_, sc) => (sc, 1.0),
        MomentPtr::Unsigned(_, sc, _) => (sc, 255.0),
        _ => unreachable!("only quantized moments have scales"),
    };
    l.store_u16(sc.add(g0) as *mut u16, ng, l.f32_to_f16(a));
    let mut out = [0f32; W];
    l.store_f32(out.as_mut_ptr(), W, l.div(l.splat(num), a));
    out
}

/// Encodes a quantized moment's group from `prepare`d values with its encode factor.
///
/// # Safety
/// As `load_moment`.
#[inline(always)]
pub unsafe fn store_codes<L: Lanes>(
    l: L,
    m: MomentPtr,
    lo: usize,
    n: [usize; 2],
    x: [L::F; 2],
    k: f32,
) {
    let kv = l.splat(k);
    for h in 0..2 {
        let at = lo + h * W;
        match m {
            MomentPtr::Signed(q, _) => {
                let y = l.mul(x[h], kv);
                let z = l.div(l.mul(l.splat(254.0), y), l.add(l.splat(1.0), l.abs(y)));
                let c = l.floor_i(l.add(z, l.splat(0.5)));
                l.store_i8_sat(q.add(at), n[h], l.iselect(l.ord(z), c, l.isplat(0)));
            }
            MomentPtr::Unsigned(q, _, _) => {
                // max(·, 0) sends NaN (and anything negative) to code 0.
                let t = l.max(l.fma(x[h], kv, l.splat(0.5)), l.splat(0.0));
                l.store_u8_sat(q.add(at), n[h], l.floor_i(t));
            }
            _ => {}
        }
    }
}

#[cfg(test)]
#[path = "codec_tests.rs"]
mod tests;
