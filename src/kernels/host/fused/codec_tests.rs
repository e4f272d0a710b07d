//! Tests of the fast coding: `round_away`, and the GPU's fast coding (fo_fast.cuh, its host
//! build) against this module on edge values.
use super::*;
use crate::kernels::host::fused::Portable;

/// Values where the coding's choices show: NaN, infinities, signed zeros, huge and
/// subnormal magnitudes, and half-integers with their neighbours (the roundings' ties).
fn edge_values() -> Vec<f32> {
    let mut xs = vec![
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        1e-45,
        -1e-45,
        1e-40,
        3e38,
        -3e38,
        2147483648.0,
        -2147483904.0,
    ];
    for k in -300i32..=300 {
        let h = k as f32 * 0.5;
        xs.extend([h, h.next_up(), h.next_down()]);
        let t = k as f32 / 256.0;
        xs.extend([t, t * 1.003, -t * 0.997]);
    }
    xs
}

/// The GPU's fast coding (fo_fast.cuh, its host build) gives this module's codes on
/// the edge values: quant8 momentum and variance codes, error bits and their rounding.
#[test]
fn the_gpus_fast_coding_gives_the_host_codes_on_edge_values() {
    let k = match crate::device::emulated::host_kernels() {
        Ok(k) => k,
        Err(why) => {
            eprintln!("skipped: {why}");
            return;
        }
    };
    let xs = edge_values();
    let gpu = |op: i32, a: i32, b: i32, f: f32| {
        let mut out = vec![0i32; xs.len()];
        unsafe { (k.fast_codes)(op, xs.as_ptr(), xs.len() as i32, a, b, f, out.as_mut_ptr()) };
        out
    };
    let mut sc = [f16::ZERO; 1];
    for (kind, factors) in [(4, [1.0f32, 1.0 / 3.0, 0.7]), (5, [1.0, 255.0 / 7.0, 3.1])] {
        for f in factors {
            let want: Vec<i32> = xs
                .chunks(2 * W)
                .flat_map(|c| {
                    let mut x = [[0f32; W]; 2];
                    for (i, v) in c.iter().enumerate() {
                        x[i / W][i % W] = *v;
                    }
                    let n = [c.len().min(W), c.len().saturating_sub(W)];
                    let mut q = [0u8; 2 * W];
                    let m = if kind == 4 {
                        MomentPtr::Signed(q.as_mut_ptr() as *mut i8, sc.as_mut_ptr())
                    } else {
                        MomentPtr::Unsigned(q.as_mut_ptr(), sc.as_mut_ptr(), Root::Sqrt)
                    };
                    unsafe { store_codes(Portable, m, 0, n, x, f) };
                    q[..c.len()].to_vec()
                })
                .map(i32::from)
                .collect();
            assert_eq!(
                gpu(0, kind, 0, f),
                want,
                "quant code kind {kind} factor {f}"
            );
        }
    }
    for (h, dtype) in [(Half::BF16, 2), (Half::F16, 1)] {
        for width in [8, 16] {
            let want: Vec<i32> = xs
                .chunks(W)
                .flat_map(|c| {
                    let mut x = [0f32; W];
                    x[..c.len()].copy_from_slice(c);
                    let (mut bits, mut e8, mut e16) = ([0u16; W], [0i8; W], [0i16; W]);
                    let err = if width == 8 {
                        ErrPtr::I8(e8.as_mut_ptr())
                    } else {
                        ErrPtr::I16(e16.as_mut_ptr())
                    };
                    let p = ParamPtr::Half {
                        h,
                        bits: bits.as_mut_ptr(),
                        err,
                    };
                    unsafe { store_param(Portable, p, 0, c.len(), x) };
                    (0..c.len())
                        .map(|i| {
                            let code = if width == 8 {
                                e8[i] as u16
                            } else {
                                e16[i] as u16
                            };
                            ((bits[i] as u32) << 16 | code as u32) as i32
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
            assert_eq!(
                gpu(1, dtype, width, 0.0),
                want,
                "error bits {h:?} width {width}"
            );
        }
    }
    let want: Vec<i32> = xs
        .chunks(W)
        .flat_map(|c| {
            let mut x = [0f32; W];
            x[..c.len()].copy_from_slice(c);
            round_away(Portable, x)[..c.len()]
                .iter()
                .map(|&q| q as i32)
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(gpu(2, 0, 0, 0.0), want, "round half away from zero");
}

/// `round_away` is `f32::round` (half away from zero) over the codes' range: the
/// values next to every half-integer, and the one below 0.5 that `x + 0.5` gets wrong.
#[test]
fn round_away_is_round_half_away_from_zero() {
    let mut xs = vec![
        0.0f32,
        -0.0,
        0.5f32.next_down(),
        -0.5f32.next_down(),
        1e-30,
        -1e-30,
    ];
    for k in -32768i32..=32767 {
        let h = k as f32 + 0.5;
        xs.extend([
            h,
            h.next_up(),
            h.next_down(),
            k as f32,
            (k as f32).next_up(),
        ]);
    }
    for c in xs.chunks(W) {
        let mut a = [0.0f32; W];
        a[..c.len()].copy_from_slice(c);
        let q = round_away(Portable, a);
        for (x, q) in a.iter().zip(q) {
            assert_eq!(q as i32, x.round() as i32, "round_away({x:e})");
        }
    }
}
