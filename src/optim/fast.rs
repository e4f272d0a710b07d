//! The `fast` arithmetic (`Arithmetic::Fast`) for the compressed formats: the same
//! algorithms and stored formats as FlashOptim's, with the operations reformulated so the
//! step is no longer bound by correctly rounded divisions and square roots:
//! - bias corrections folded into two scalars (`lr/bc1`, `1/sqrt(bc2)`), multiplied;
//! - quant8 variance kept by its root through the step: decode gives `sqrt(v)`, the update
//!   squares it, takes the one square root per element it needs and hands it to the encoder
//!   (exact takes three: decode squares, update roots `v/bc2`, encode roots `v`);
//! - group scales applied as reciprocals (`x·(1/a)`, `r·(255/a)`, `q·(scale/255)`);
//! - softsign decode table-free as one division of small integers' products,
//!   `q·s/(254 − |q|)` (= `t/(2 − |t|)·s` with `t = q/127`), encode `254y/(1 + |y|)`;
//! - master reconstruction `b + q·(1/Q)·2^L` (no division);
//! - fused multiply-adds wherever a product is added.
//!
//! Every operation is still an IEEE f32 operation (`mul_add` always fused), so the fast
//! results are the same bits on AVX-512, AVX2 and plain code (the scalar reference).
//! Per step from the same state, fast and exact differ by at most one quant8 code (and
//! one fp16 ulp of a group scale), and in params/masters by at most `ULP_BOUND` units of
//! the stored master's resolution for 24-bit masters and 16-bit params (one error-bits
//! code, one bf16/f16 ulp), `ULP_BOUND_FINE` for 32-bit masters and f32 params (whose
//! resolution is about one f32 ulp, where the f32 roundings fast saves or adds show),
//! the unit taken at the larger of the old and new value (tests/optim_fast.rs).
use half::slice::HalfFloatSliceExt;

use super::config::{Algorithm, OptimConfig};
use super::rule::{run_sgd_variant, SgdVariant};
use super::kernel::BLOCK;
use super::master_split::{pow2, ErrorCode, Half};
use super::quant8::{self, to_code, GROUP};
use super::state::{ErrChunk, MomentChunk, ParamChunk, Root};

/// Bound per step, fast vs exact from the same state, for 24-bit masters, 16-bit params
/// without error bits and 16-bit (`param_dtype`) states, in units of their resolution.
/// Measured worst over the oracle and random cases: 1.03 (one unit, plus a value that
/// crossed a binade).
pub const ULP_BOUND: u32 = 2;
/// The same for 32-bit masters (int16 error bits) and f32 params, in units of their
/// resolution (about one f32 ulp). Measured worst: 16 (flash_adamw_mw32 in quant8_wide,
/// where an update nearly cancels the decayed weight); bound with a factor 2 of margin.
pub const ULP_BOUND_FINE: u32 = 32;

#[derive(Debug, Clone, Copy)]
pub enum FastRule {
    Adam {
        l2: Option<f32>,
        decay: f32,
        b1: f32,
        w1: f32,
        b2: f32,
        w2: f32,
        /// `lr / bc1`.
        step: f32,
        /// `1 / sqrt(bc2)`.
        inv_sqrt_bc2: f32,
        eps: f32,
        /// The variance buffer holds `sqrt(v)` (quant8 state), not `v`.
        v_root: bool,
    },
    Sgd {
        l2: Option<f32>,
        decay: f32,
        momentum: Option<f32>,
        wdamp: f32,
        nesterov: bool,
        neg_lr: f32,
    },
    Lion {
        decay: f32,
        b1: f32,
        w1: f32,
        b2: f32,
        w2: f32,
        neg_lr: f32,
    },
}

impl FastRule {
    /// The rule for group `c` (non-fp32 state) at `step`; hyper-parameters are taken as
    /// FlashOptim rounds them (f32 betas, `pow` in double), the derived scalars in double.
    pub fn new(c: &OptimConfig, step: u64) -> FastRule {
        let coupled = !c.algorithm.decoupled_decay() && c.weight_decay != 0.0;
        let l2 = coupled.then_some(c.weight_decay as f32);
        let decay = if c.algorithm.decoupled_decay() {
            1.0 - c.decay_amount() as f32
        } else {
            1.0
        };
        let (b1, b2) = (c.beta1 as f32, c.beta2 as f32);
        match c.algorithm {
            Algorithm::AdamW | Algorithm::Adam => {
                let bc = |b: f32| 1.0 - (b as f64).powf(step as f64) as f32;
                FastRule::Adam {
                    l2,
                    decay,
                    b1,
                    w1: 1.0 - b1,
                    b2,
                    w2: 1.0 - b2,
                    step: (c.lr as f32 as f64 / bc(b1) as f64) as f32,
                    inv_sqrt_bc2: (1.0 / (bc(b2) as f64).sqrt()) as f32,
                    eps: c.eps as f32,
                    v_root: c.state_format.is_quantized(),
                }
            }
            Algorithm::Sgd | Algorithm::SgdW => FastRule::Sgd {
                l2,
                decay,
                momentum: (c.momentum != 0.0).then_some(c.momentum as f32),
                wdamp: (1.0 - c.dampening) as f32,
                nesterov: c.nesterov,
                neg_lr: -(c.lr as f32),
            },
            Algorithm::Lion => FastRule::Lion {
                decay,
                b1,
                w1: 1.0 - b1,
                b2,
                w2: 1.0 - b2,
                neg_lr: -(c.lr as f32),
            },
        }
    }

    /// As `Rule::apply`; with `v_root` the variance slice holds `sqrt(v)` in and out.
    #[inline(always)]
    pub fn apply(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], first: bool) {
        let n = p.len();
        let g = &g[..n];
        match *self {
            FastRule::Adam {
                l2,
                decay,
                b1,
                w1,
                b2,
                w2,
                step,
                inv_sqrt_bc2,
                eps,
                v_root,
            } => {
                let (m, v) = (&mut m[..n], &mut v[..n]);
                for i in 0..n {
                    let gi = match l2 {
                        Some(wd) => p[i].mul_add(wd, g[i]),
                        None => g[i],
                    };
                    let mi = gi.mul_add(w1, m[i] * b1);
                    let prev = if v_root { v[i] * v[i] } else { v[i] };
                    let vi = (gi * gi).mul_add(w2, prev * b2);
                    let r = vi.sqrt();
                    let denom = r.mul_add(inv_sqrt_bc2, eps);
                    p[i] = p[i].mul_add(decay, -(step * mi) / denom);
                    m[i] = mi;
                    v[i] = if v_root { r } else { vi };
                }
            }
            FastRule::Sgd {
                l2,
                decay,
                momentum,
                wdamp,
                nesterov,
                neg_lr,
            } => {
                // Every loop-invariant choice is made outside the loop, so each loop
                // vectorizes.
                let s = Sgd {
                    wd: l2.unwrap_or(0.0),
                    decay,
                    mom: momentum.unwrap_or(0.0),
                    wdamp,
                    neg_lr,
                };
                run_sgd_variant(&s, l2.is_some(), momentum.is_some(), nesterov, first, p, g, m)
            }
            FastRule::Lion {
                decay,
                b1,
                w1,
                b2,
                w2,
                neg_lr,
            } => {
                let m = &mut m[..n];
                for i in 0..n {
                    let c = g[i].mul_add(w1, m[i] * b1);
                    let u: f32 = if c > 0.0 {
                        1.0
                    } else if c < 0.0 {
                        -1.0
                    } else {
                        0.0
                    };
                    m[i] = g[i].mul_add(w2, m[i] * b2);
                    p[i] = u.mul_add(neg_lr, p[i] * decay);
                }
            }
        }
    }
}

struct Sgd {
    wd: f32,
    decay: f32,
    mom: f32,
    wdamp: f32,
    neg_lr: f32,
}

impl SgdVariant for Sgd {
    #[inline(always)]
    fn run<const L2: bool, const K: u8>(&self, p: &mut [f32], g: &[f32], m: &mut [f32]) {
        let n = p.len();
        let m = if K == 0 { &mut m[..0] } else { &mut m[..n] };
        for i in 0..n {
            let gi = if L2 { p[i].mul_add(self.wd, g[i]) } else { g[i] };
            let pi = p[i] * self.decay;
            let d = if K == 0 {
                gi
            } else {
                let b = if K >= 3 {
                    gi
                } else {
                    gi.mul_add(self.wdamp, m[i] * self.mom)
                };
                m[i] = b;
                if K == 2 || K == 4 {
                    self.mom.mul_add(b, gi)
                } else {
                    b
                }
            };
            p[i] = d.mul_add(self.neg_lr, pi);
        }
    }
}

/// `b + q·(1/Q)·2^L`: the master value without a division.
#[inline(always)]
fn reconstruct<C: ErrorCode>(h: Half, b: u16, q: C) -> f32 {
    let l = h.half_ulp_log2(b);
    let hh = l >> 1;
    h.to_f32(b) + ((q.to_f32() * (1.0 / C::Q)) * pow2(hh)) * pow2(l - hh)
}

#[inline(always)]
fn reconstruct_loop<C: ErrorCode>(h: Half, bits: &[u16], codes: &[C], out: &mut [f32]) {
    for ((o, &b), &c) in out.iter_mut().zip(bits).zip(codes) {
        *o = reconstruct(h, b, c);
    }
}

/// Master values of a parameter chunk (fast reconstruction of split masters).
#[inline(always)]
pub fn load_param(p: &ParamChunk<'_>, out: &mut [f32]) {
    match p {
        ParamChunk::Half {
            h: Half::BF16,
            bits,
            err: ErrChunk::I8(e),
        } => reconstruct_loop(Half::BF16, bits, e, out),
        ParamChunk::Half {
            h: Half::BF16,
            bits,
            err: ErrChunk::I16(e),
        } => reconstruct_loop(Half::BF16, bits, e, out),
        ParamChunk::Half {
            h: Half::F16,
            bits,
            err: ErrChunk::I8(e),
        } => reconstruct_loop(Half::F16, bits, e, out),
        ParamChunk::Half {
            h: Half::F16,
            bits,
            err: ErrChunk::I16(e),
        } => reconstruct_loop(Half::F16, bits, e, out),
        other => other.load(out),
    }
}

/// Groups per block: the per-group work (scales, maxima, reciprocals) is done for all of a
/// block's groups in one vectorizable pass, then spread to the elements, so the element
/// loops run flat over the whole block instead of 32 at a time.
const BG: usize = BLOCK / GROUP;

/// `per_group[g]` for every element of group `g`.
#[inline(always)]
fn spread(per_group: &[f32], out: &mut [f32; BLOCK]) {
    for (o, &v) in out.chunks_mut(GROUP).zip(per_group) {
        o.fill(v);
    }
}

/// Decodes a moment chunk (at most `BLOCK` elements) for a fast rule: quant8 variance
/// as its root `sqrt(v)`.
#[inline(always)]
pub fn load_moment(c: &MomentChunk<'_>, out: &mut [f32]) {
    let mut sf = [0f32; BG];
    let mut e = [0f32; BLOCK];
    match c {
        MomentChunk::Signed(q, s) => {
            let n = q.len();
            s.convert_to_f32_slice(&mut sf[..s.len()]);
            spread(&sf[..s.len()], &mut e);
            for ((o, &q), &e) in out[..n].iter_mut().zip(q.iter()).zip(&e[..n]) {
                let q = q as f32;
                *o = (q * e) / (254.0 - q.abs());
            }
        }
        MomentChunk::Unsigned(q, s, root) => {
            let n = q.len();
            s.convert_to_f32_slice(&mut sf[..s.len()]);
            for k in sf.iter_mut() {
                *k *= 1.0 / 255.0;
            }
            spread(&sf[..s.len()], &mut e);
            let it = out[..n].iter_mut().zip(q.iter()).zip(&e[..n]);
            match root {
                Root::Sqrt => it.for_each(|((o, &q), &k)| *o = q as f32 * k),
                // Code 0 stands for half the smallest level (`StateFormat::Quant8Wide`).
                Root::Fourth => it.for_each(|((o, &q), &k)| {
                    let u = if q == 0 { 0.5 * k } else { q as f32 * k };
                    *o = u * u;
                }),
            }
        }
        other => other.load(out, true),
    }
}

/// Encodes a moment chunk (at most `BLOCK` elements) from a fast rule's values (quant8
/// variance given as `sqrt(v)`).
#[inline(always)]
pub fn store_moment(c: &mut MomentChunk<'_>, src: &mut [f32]) {
    let mut a = [0f32; BG];
    let mut e = [0f32; BLOCK];
    match c {
        MomentChunk::Signed(q, s) => {
            let (n, ng) = (q.len(), s.len());
            for (a, x) in a.iter_mut().zip(src[..n].chunks(GROUP)) {
                *a = quant8::absmax(x);
            }
            s.convert_from_f32_slice(&a[..ng]);
            for a in a.iter_mut() {
                *a = 1.0 / *a;
            }
            spread(&a[..ng], &mut e);
            for ((c, &v), &inv) in q.iter_mut().zip(&src[..n]).zip(&e[..n]) {
                let y = v * inv;
                let z = (254.0 * y) / (1.0 + y.abs());
                // |z| <= 127 up to rounding; NaN becomes 0.
                *c = to_code((z + 0.5).floor(), -127.0, 127.0) as i8;
            }
        }
        MomentChunk::Unsigned(q, s, root) => {
            let (n, ng) = (q.len(), s.len());
            if *root == Root::Fourth {
                for r in src[..n].iter_mut() {
                    *r = r.sqrt();
                }
            }
            for (a, x) in a.iter_mut().zip(src[..n].chunks(GROUP)) {
                *a = quant8::max_nonneg(x).max(quant8::ABSMAX_FLOOR);
            }
            s.convert_from_f32_slice(&a[..ng]);
            for a in a.iter_mut() {
                *a = 255.0 / *a;
            }
            spread(&a[..ng], &mut e);
            for ((c, &r), &k) in q.iter_mut().zip(&src[..n]).zip(&e[..n]) {
                *c = to_code(r.mul_add(k, 0.5).floor(), 0.0, 255.0) as u8;
            }
        }
        other => other.store(src),
    }
}
