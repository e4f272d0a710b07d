//! The `fast` arithmetic (`Arithmetic::Fast`) for the compressed formats: the same
//! algorithms and stored formats as FlashOptim's, with the operations reformulated for
//! speed; `kernels::host::fused` carries it out, one quantization group at a time in registers
//! (SGD and Lion step with torch's operations, `Sgd<Torch>` and `Lion<Torch>`):
//! - bias corrections folded into two scalars (`lr/bc1`, `1/sqrt(bc2)`), multiplied;
//! - quant8 variance kept by its root through the step: decode gives `sqrt(v)`, the update
//!   squares it, takes the one square root per element it needs and hands it to the encoder
//!   (exact takes three: decode squares, update roots `v/bc2`, encode roots `v`);
//! - group scales applied as reciprocals (`x·(1/a)`, `r·(255/a)`, `q·(scale/255)`);
//! - softsign decode table-free as one division of small integers' products,
//!   `q·s/(254 − |q|)` (= `t/(2 − |t|)·s` with `t = q/127`), encode `254y/(1 + |y|)`;
//! - master reconstruction `b + q·(2^L/Q)` and error bits `(x − b)·2^−L`, the powers of
//!   two built from `b`'s exponent bits (no division);
//! - fused multiply-adds wherever a product is added.
//!
//! Every operation is an IEEE f32 operation with one exact result (fused multiply-adds
//! included), so the fast results are the same bits on AVX-512, AVX2 and plain code.
//! Per step from the same state, fast and exact differ by at most one quant8 code (and
//! one fp16 ulp of a group scale), and in params/masters by at most `ULP_BOUND` units of
//! the stored master's resolution for 24-bit masters and 16-bit params (one error-bits
//! code, one bf16/f16 ulp), `ULP_BOUND_FINE` for 32-bit masters and f32 params (whose
//! resolution is about one f32 ulp, where the f32 roundings fast saves or adds show),
//! the unit taken at the larger of the old and new value (tests/optim_fast.rs).
use super::arith::{Arith, Ops, Torch};
use super::lion::Lion;
use super::sgd::Sgd;
use super::update::{Elem, Fixed, Runner, Update};
use super::Betas;
use crate::optim::math::config::{Algorithm, OptimConfig};
use std::marker::PhantomData;

/// Bound per step, fast vs exact from the same state, for 24-bit masters, 16-bit params
/// without error bits and 16-bit (`param_dtype`) states, in units of their resolution.
/// Measured worst over the oracle and random cases: 1.03 (one unit, plus a value that
/// crossed a binade).
pub const ULP_BOUND: u32 = 2;
/// The same for 32-bit masters (int16 error bits) and f32 params, in units of their
/// resolution (about one f32 ulp). Measured worst: 16 (flash_adamw_mw32 in quant8_wide,
/// where an update nearly cancels the decayed weight); bound with a factor 2 of margin.
pub const ULP_BOUND_FINE: u32 = 32;

/// A `fast` rule's scalars.
#[derive(Debug, Clone, Copy)]
pub enum FastRule {
    Adam(FastAdam),
    Sgd(Sgd<Torch>),
    Lion(Lion<Torch>),
}

/// Adam and AdamW with the bias corrections folded into two scalars.
#[derive(Debug, Clone, Copy)]
pub struct FastAdam {
    pub l2: Option<f32>,
    pub decay: f32,
    pub betas: Betas,
    /// `lr / bc1`.
    pub step: f32,
    /// `1 / sqrt(bc2)`.
    pub inv_sqrt_bc2: f32,
    pub eps: f32,
    /// The variance buffer holds `sqrt(v)` (quant8 state), not `v`: variant `K` = 1.
    pub v_root: bool,
}

impl Update for FastAdam {
    #[inline(always)]
    fn update<A: Arith, const L2: bool, const K: u8>(&self, a: A, x: Elem<A::F>) -> Elem<A::F> {
        let s = |x: f32| a.splat(x);
        let Betas { b1, w1, b2, w2 } = self.betas;
        let Elem { p, g, m, v } = x;
        let gi = Torch::l2::<A, L2>(a, p, g, self.l2);
        let root = K == 1;
        let m = a.fma(gi, s(w1), a.mul(m, s(b1)));
        let prev = if root { a.mul(v, v) } else { v };
        let vi = a.fma(a.mul(gi, gi), s(w2), a.mul(prev, s(b2)));
        let r = a.sqrt(vi);
        let denom = a.fma(r, s(self.inv_sqrt_bc2), s(self.eps));
        let p = a.fms(p, s(self.decay), a.div(a.mul(s(self.step), m), denom));
        let v = if root { r } else { vi };
        Elem { p, g, m, v }
    }
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
        let betas = Betas::f32(c);
        match c.algorithm {
            Algorithm::AdamW | Algorithm::Adam => {
                let bc = |b: f32| 1.0 - (b as f64).powf(step as f64) as f32;
                FastRule::Adam(FastAdam {
                    l2,
                    decay,
                    betas,
                    step: (c.lr as f32 as f64 / bc(betas.b1) as f64) as f32,
                    inv_sqrt_bc2: (1.0 / (bc(betas.b2) as f64).sqrt()) as f32,
                    eps: c.eps as f32,
                    v_root: c.state_format.is_quantized(),
                })
            }
            Algorithm::Sgd | Algorithm::SgdW => FastRule::Sgd(Sgd {
                l2,
                decay,
                momentum: (c.momentum != 0.0).then_some(c.momentum as f32),
                wdamp: (1.0 - c.dampening) as f32,
                nesterov: c.nesterov,
                lr: -(c.lr as f32),
                ops: PhantomData,
            }),
            Algorithm::Lion => FastRule::Lion(Lion {
                decay,
                betas,
                lr: -(c.lr as f32),
                ops: PhantomData,
            }),
        }
    }

    /// Runs this rule with `r`, its choices fixed (`first`: the momentum buffer was
    /// just created).
    #[inline(always)]
    pub fn with<R: Runner>(&self, first: bool, r: R) -> R::Out {
        match self {
            FastRule::Adam(u) => match (u.l2.is_some(), u.v_root) {
                (false, false) => r.run(&Fixed::<_, false, 0>(*u)),
                (false, true) => r.run(&Fixed::<_, false, 1>(*u)),
                (true, false) => r.run(&Fixed::<_, true, 0>(*u)),
                (true, true) => r.run(&Fixed::<_, true, 1>(*u)),
            },
            FastRule::Sgd(u) => u.with(first, r),
            FastRule::Lion(u) => r.run(&Fixed::<_, false, 0>(*u)),
        }
    }
}
