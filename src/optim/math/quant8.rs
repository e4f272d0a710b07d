//! FlashOptim 0.1.4's 8-bit state codec: groups of 32 consecutive elements of the
//! flattened tensor share one fp16 absmax scale.
//!
//! - signed (momentum: `exp_avg`, `momentum_buffer`): softsign companding to int8 in
//!   [-127, 127]: `y = x/a`, `z = 2y/(1+|y|)`, `q = floor(127 z + 0.5)`.
//! - unsigned sqrt (variance: `exp_avg_sq`): `r = sqrt(v)`, `q = floor(255 r/a + 0.5)`.
//!
//! `a = max(absmax of the group, 1e-12)` is used in f32 to encode; the scale stored (and
//! used to decode) is `fp16(a)`. Every operation is one correctly rounded f32 operation in
//! the kernels' order, with no fused multiply-add, so results equal FlashOptim's bit for
//! bit (`tests/optim_codecs.rs` checks every value of `flash_quant.safetensors`).
use half::f16;

/// Elements per quantization group.
pub const GROUP: usize = 32;
/// The absmax floor, so an all-zero group encodes without dividing by zero.
pub const ABSMAX_FLOOR: f32 = 1e-12;

/// `x` (an integral value) as i32, NaN as 0, clamped to [lo, hi]. Rust's saturating
/// `as` casts do not vectorize on x86; this does, and gives the same result in range.
#[inline(always)]
pub fn to_code(x: f32, lo: f32, hi: f32) -> i32 {
    let x = if x.is_nan() { 0.0 } else { x.max(lo).min(hi) };
    // SAFETY: x is finite and within [lo, hi], a subrange of i32.
    unsafe { x.to_int_unchecked::<i32>() }
}

/// Number of groups (= scales) for `numel` elements; the last group may be short.
pub fn num_groups(numel: usize) -> usize {
    numel.div_ceil(GROUP)
}

/// `t/(2-|t|)` for `t = q/127`, per int8 code: the softsign inverse only depends on the
/// code, so decoding is a table look-up and one multiply (same f32 operations, same bits).
static SIGNED_DECODE: std::sync::LazyLock<[f32; 256]> = std::sync::LazyLock::new(|| {
    let mut t = [0f32; 256];
    for (i, slot) in t.iter_mut().enumerate() {
        let q = i as u8 as i8;
        let t = q as f32 / 127.0;
        *slot = t / (2.0 - t.abs());
    }
    t
});

/// `q/255` per uint8 code.
static UNSIGNED_DECODE: std::sync::LazyLock<[f32; 256]> =
    std::sync::LazyLock::new(|| std::array::from_fn(|q| q as f32 / 255.0));

/// The decode table for signed codes (index by `code as u8`).
pub fn signed_table() -> &'static [f32; 256] {
    &SIGNED_DECODE
}

/// The decode table for unsigned codes.
pub fn unsigned_table() -> &'static [f32; 256] {
    &UNSIGNED_DECODE
}

/// |x| as ordered bits: for non-NaN floats the bits with the sign cleared order like the
/// magnitudes; NaN maps to 0 so it never wins (as `f32::max` ignores NaN).
#[inline(always)]
fn mag_bits(v: f32) -> u32 {
    let b = v.to_bits() & 0x7fff_ffff;
    if b > 0x7f80_0000 {
        0
    } else {
        b
    }
}

/// The maximum of 16 lanes as a halving tree with a fixed-size array per level, so it
/// compiles to a few in-register shuffles and maxima (a loop over the widths does not).
#[inline(always)]
fn tree_max(l: [u32; 16]) -> u32 {
    let l: [u32; 8] = std::array::from_fn(|i| l[i].max(l[i + 8]));
    let l: [u32; 4] = std::array::from_fn(|i| l[i].max(l[i + 4]));
    let l: [u32; 2] = std::array::from_fn(|i| l[i].max(l[i + 2]));
    l[0].max(l[1])
}

/// max |x| over a group, NaN ignored, floored at 1e-12: exactly `fold(0, f32::max)` of
/// the magnitudes. A full group reduces as a lane-wise tree of integer maxima, which
/// compiles to a few vector instructions instead of a serial chain.
#[inline(always)]
pub(crate) fn absmax(x: &[f32]) -> f32 {
    let m = if let Ok(x) = <&[f32; GROUP]>::try_from(x) {
        tree_max(std::array::from_fn(|i| {
            mag_bits(x[i]).max(mag_bits(x[i + 16]))
        }))
    } else {
        x.iter().fold(0u32, |m, &v| m.max(mag_bits(v)))
    };
    f32::from_bits(m).max(ABSMAX_FLOOR)
}

#[inline(always)]
fn encode_signed_body(x: &[f32], codes: &mut [i8]) -> f16 {
    let a = absmax(x);
    for (c, &v) in codes.iter_mut().zip(x) {
        let y = v / a;
        let z = (2.0 * y) / (1.0 + y.abs());
        // |z| <= 1, so the code is within [-127, 127]; NaN becomes 0.
        *c = to_code((z * 127.0 + 0.5).floor(), -127.0, 127.0) as i8;
    }
    f16::from_f32(a)
}

/// Encodes one group (at most 32 values) of momentum; returns its fp16 scale.
#[inline(always)]
pub fn encode_signed_group(x: &[f32], codes: &mut [i8]) -> f16 {
    // Full groups take a fixed-length path the compiler unrolls and vectorizes.
    let n = x.len().min(codes.len());
    if n == GROUP {
        let x: &[f32; GROUP] = x[..GROUP].try_into().unwrap();
        let c: &mut [i8; GROUP] = (&mut codes[..GROUP]).try_into().unwrap();
        encode_signed_body(x, c)
    } else {
        encode_signed_body(&x[..n], &mut codes[..n])
    }
}

/// Decodes one group of momentum.
#[inline(always)]
pub fn decode_signed_group(codes: &[i8], scale: f16, out: &mut [f32]) {
    let s = scale.to_f32();
    let t = signed_table();
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = t[c as u8 as usize] * s;
    }
}

/// max of non-negative `v` over a group as bits; NaN and negative values (whose square
/// roots are NaN) never win; -0 counts as 0.
#[inline(always)]
pub(crate) fn max_nonneg(v: &[f32]) -> f32 {
    let bits = |x: f32| {
        let b = x.to_bits();
        if b > 0x7f80_0000 {
            0
        } else {
            b
        }
    };
    let m = if let Ok(v) = <&[f32; GROUP]>::try_from(v) {
        tree_max(std::array::from_fn(|i| bits(v[i]).max(bits(v[i + 16]))))
    } else {
        v.iter().fold(0u32, |m, &x| m.max(bits(x)))
    };
    f32::from_bits(m)
}

#[inline(always)]
fn encode_unsigned_sqrt_body(v: &[f32], codes: &mut [u8]) -> f16 {
    // sqrt is monotone and correctly rounded, so max(sqrt(v)) == sqrt(max(v)) exactly:
    // one square root per group for the scale, and one pass over the elements.
    let a = max_nonneg(v).sqrt().max(ABSMAX_FLOOR);
    for (c, &v) in codes.iter_mut().zip(v) {
        // 0 <= sqrt(v)/a <= 1: the code is within [0, 255]; NaN becomes 0.
        *c = to_code(((v.sqrt() / a) * 255.0 + 0.5).floor(), 0.0, 255.0) as u8;
    }
    f16::from_f32(a)
}

/// Encodes one group of variance (non-negative values) by its square root. `_scratch`
/// is unused (kept for callers of earlier versions).
#[inline(always)]
pub fn encode_unsigned_sqrt_group(v: &[f32], codes: &mut [u8], _scratch: &mut [f32; GROUP]) -> f16 {
    let n = v.len().min(codes.len());
    if n == GROUP {
        let v: &[f32; GROUP] = v[..GROUP].try_into().unwrap();
        let c: &mut [u8; GROUP] = (&mut codes[..GROUP]).try_into().unwrap();
        encode_unsigned_sqrt_body(v, c)
    } else {
        encode_unsigned_sqrt_body(&v[..n], &mut codes[..n])
    }
}

/// Decodes one group of variance: `s = (q/255)·scale`, `v = s·s`.
#[inline(always)]
pub fn decode_unsigned_sqrt_group(codes: &[u8], scale: f16, out: &mut [f32]) {
    let sc = scale.to_f32();
    let t = unsigned_table();
    for (o, &c) in out.iter_mut().zip(codes) {
        let s = t[c as usize] * sc;
        *o = s * s;
    }
}

fn check_lens(what: &str, numel: usize, codes: usize, scales: usize) {
    assert_eq!(numel, codes, "{what}: {numel} values but {codes} codes");
    assert_eq!(
        scales,
        num_groups(numel),
        "{what}: {scales} scales for {numel} values"
    );
}

/// Quantizes momentum-like values (FlashOptim `quantize(x, signed=True, softsign=True)`).
/// `codes.len() == x.len()`, `scales.len() == num_groups(x.len())`.
pub fn quantize_signed(x: &[f32], codes: &mut [i8], scales: &mut [f16]) {
    check_lens("quantize_signed", x.len(), codes.len(), scales.len());
    for ((x, c), s) in x
        .chunks(GROUP)
        .zip(codes.chunks_mut(GROUP))
        .zip(scales.iter_mut())
    {
        *s = encode_signed_group(x, c);
    }
}

/// Inverse of `quantize_signed` (FlashOptim `dequantize(..., signed=True, softsign=True)`).
pub fn dequantize_signed(codes: &[i8], scales: &[f16], out: &mut [f32]) {
    check_lens("dequantize_signed", out.len(), codes.len(), scales.len());
    for ((c, &s), o) in codes.chunks(GROUP).zip(scales).zip(out.chunks_mut(GROUP)) {
        decode_signed_group(c, s, o);
    }
}

/// Quantizes variance-like values (FlashOptim `quantize(v, signed=False, sqrt=True)`).
pub fn quantize_unsigned_sqrt(v: &[f32], codes: &mut [u8], scales: &mut [f16]) {
    check_lens("quantize_unsigned_sqrt", v.len(), codes.len(), scales.len());
    let mut scratch = [0f32; GROUP];
    for ((v, c), s) in v
        .chunks(GROUP)
        .zip(codes.chunks_mut(GROUP))
        .zip(scales.iter_mut())
    {
        *s = encode_unsigned_sqrt_group(v, c, &mut scratch);
    }
}

/// Inverse of `quantize_unsigned_sqrt`.
pub fn dequantize_unsigned_sqrt(codes: &[u8], scales: &[f16], out: &mut [f32]) {
    check_lens(
        "dequantize_unsigned_sqrt",
        out.len(),
        codes.len(),
        scales.len(),
    );
    for ((c, &s), o) in codes.chunks(GROUP).zip(scales).zip(out.chunks_mut(GROUP)) {
        decode_unsigned_sqrt_group(c, s, o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signed_round_trip_keeps_group_maximum_and_sign() {
        let x: Vec<f32> = (0..70).map(|i| ((i as f32) - 35.0) * 0.37).collect();
        let mut q = vec![0i8; 70];
        let mut s = vec![f16::ZERO; num_groups(70)];
        quantize_signed(&x, &mut q, &mut s);
        assert_eq!(s.len(), 3);
        let mut d = vec![0f32; 70];
        dequantize_signed(&q, &s, &mut d);
        for (a, b) in x.iter().zip(&d) {
            assert!((a - b).abs() <= 0.02 * 35.0 * 0.37, "{a} vs {b}");
            assert!(a.signum() == b.signum() || *b == 0.0);
        }
        assert!(q.iter().all(|&c| c >= -127));
    }

    #[test]
    fn all_zero_group_decodes_to_zero() {
        let mut q = [5u8; 3];
        let mut s = [f16::ONE];
        quantize_unsigned_sqrt(&[0.0; 3], &mut q, &mut s);
        assert_eq!(q, [0; 3]);
        let mut d = [1f32; 3];
        dequantize_unsigned_sqrt(&q, &s, &mut d);
        assert_eq!(d, [0.0; 3]);
    }
}
