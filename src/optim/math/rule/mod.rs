//! The element-wise update rules, one per (algorithm, arithmetic contract), each written
//! once over `arith::Arith` (`update`): the exact loops run it over f32 slices, which the
//! compiler vectorizes, the fused `fast` kernel over 16 lanes, and the GPU table
//! (`kernels::step_table`) carries its scalars to `fo_rules.cuh`, the GPU's own source,
//! checked against these bits by the host-shim tests.
//!
//! - `arith`: the operations rules are written in; `update`: how a rule meets memory;
//! - `torch`, `flash`, `fast`: the three arithmetics' Adams; `sgd`, `lion`: SGD and Lion
//!   in torch's or FlashOptim's operations (`arith::Ops`); each with its scalars.
//!
//! Two exact contracts (see `StateFormat`), and `fast` (see `fast`):
//! - torch's (fp32 state: `TorchAdam`, `Sgd<Torch>`, `Lion<Torch>`): torch.optim's
//!   single-tensor CPU arithmetic. Scalars in double on the host (`1 − lr·wd`, `lr/bc1`,
//!   `sqrt(bc2)`, `1 − β`), rounded to f32 when applied; `add(x, alpha=a)` is one fused
//!   multiply-add (`f32::mul_add`); `lerp` is ATen's vectorized form; `addcmul`/`addcdiv`
//!   are separate roundings.
//! - FlashOptim 0.1.4's kernel arithmetic (param_dtype / quant8 / split masters stepped
//!   `exact`: `FlashAdam`, `Sgd<Flash>`, `Lion<Flash>`): hyper-parameters rounded to f32,
//!   `1 − β` an f32 subtraction, `lr·wd` and `1 − dampening` in double then rounded,
//!   `pow(β, step)` in double from the f32 β, then rounded; no fused multiply-add anywhere
//!   (Rust never contracts `a*b + c`).
//!
//! SGD dampening follows torch in both contracts: the first step sets the buffer to the
//! gradient undampened (FlashOptim dampens it; identical when dampening = 0).
pub mod arith;
pub mod fast;
pub mod flash;
pub mod lion;
pub mod sgd;
pub mod torch;
pub mod update;

use crate::optim::math::config::{Algorithm, Arithmetic, OptimConfig, StateFormat};
use std::marker::PhantomData;

use arith::{Flash, Torch};
use fast::FastRule;
use flash::FlashAdam;
use lion::Lion;
use sgd::Sgd;
use torch::TorchAdam;
use update::{with_l2, Fixed, Runner, Slices};

/// One parameter's rule for one step: its arithmetic's update and scalars.
#[derive(Debug, Clone, Copy)]
pub enum Rule {
    TorchAdam(TorchAdam),
    FlashAdam(FlashAdam),
    TorchSgd(Sgd<Torch>),
    FlashSgd(Sgd<Flash>),
    TorchLion(Lion<Torch>),
    FlashLion(Lion<Flash>),
    /// `Arithmetic::Fast` on non-fp32 state (see `fast`).
    Fast(FastRule),
}

/// β1, β2 and their complements `1 − β`, as an arithmetic rounds them.
#[derive(Debug, Clone, Copy)]
pub struct Betas {
    pub b1: f32,
    pub w1: f32,
    pub b2: f32,
    pub w2: f32,
}

impl Betas {
    /// torch: the complements in double, then rounded.
    fn f64(c: &OptimConfig) -> Betas {
        Betas {
            b1: c.beta1 as f32,
            w1: (1.0 - c.beta1) as f32,
            b2: c.beta2 as f32,
            w2: (1.0 - c.beta2) as f32,
        }
    }

    /// FlashOptim and fast: the betas rounded to f32, the complements in f32.
    fn f32(c: &OptimConfig) -> Betas {
        let (b1, b2) = (c.beta1 as f32, c.beta2 as f32);
        Betas {
            b1,
            w1: 1.0 - b1,
            b2,
            w2: 1.0 - b2,
        }
    }
}

/// `(double)(float)beta` raised to `step` in double, rounded to f32 (FlashOptim's host).
fn flash_pow(beta: f32, step: u64) -> f32 {
    (beta as f64).powf(step as f64) as f32
}

impl Rule {
    /// The rule for one parameter of group `c` at step `step` (counting from 1).
    pub fn new(c: &OptimConfig, step: u64) -> Rule {
        let torch = c.state_format == StateFormat::Fp32;
        if !torch && c.arithmetic == Arithmetic::Fast {
            return Rule::Fast(FastRule::new(c, step));
        }
        let coupled = !c.algorithm.decoupled_decay() && c.weight_decay != 0.0;
        let l2 = coupled.then_some(c.weight_decay as f32);
        let decay_amount = if c.algorithm.decoupled_decay() {
            c.decay_amount()
        } else {
            0.0
        };
        let momentum = (c.momentum != 0.0).then_some(c.momentum as f32);
        match (c.algorithm, torch) {
            (Algorithm::AdamW | Algorithm::Adam, true) => {
                let bc1 = 1.0 - c.beta1.powf(step as f64);
                let bc2 = 1.0 - c.beta2.powf(step as f64);
                Rule::TorchAdam(TorchAdam {
                    l2,
                    decay: (1.0 - decay_amount) as f32,
                    betas: Betas::f64(c),
                    bc2_sqrt: bc2.sqrt() as f32,
                    eps: c.eps as f32,
                    neg_step: (-(c.lr / bc1)) as f32,
                })
            }
            (Algorithm::AdamW | Algorithm::Adam, false) => {
                let betas = Betas::f32(c);
                Rule::FlashAdam(FlashAdam {
                    l2,
                    decay: 1.0 - decay_amount as f32,
                    betas,
                    bc1: 1.0 - flash_pow(betas.b1, step),
                    bc2: 1.0 - flash_pow(betas.b2, step),
                    lr: c.lr as f32,
                    eps: c.eps as f32,
                })
            }
            (Algorithm::Sgd | Algorithm::SgdW, true) => Rule::TorchSgd(Sgd {
                l2,
                decay: (1.0 - decay_amount) as f32,
                momentum,
                wdamp: (1.0 - c.dampening) as f32,
                nesterov: c.nesterov,
                lr: (-c.lr) as f32,
                ops: PhantomData,
            }),
            (Algorithm::Sgd | Algorithm::SgdW, false) => Rule::FlashSgd(Sgd {
                l2,
                decay: 1.0 - decay_amount as f32,
                momentum,
                wdamp: (1.0 - c.dampening) as f32,
                nesterov: c.nesterov,
                lr: c.lr as f32,
                ops: PhantomData,
            }),
            (Algorithm::Lion, true) => Rule::TorchLion(Lion {
                decay: (1.0 - decay_amount) as f32,
                betas: Betas::f64(c),
                lr: (-c.lr) as f32,
                ops: PhantomData,
            }),
            (Algorithm::Lion, false) => Rule::FlashLion(Lion {
                decay: 1.0 - decay_amount as f32,
                betas: Betas::f32(c),
                lr: c.lr as f32,
                ops: PhantomData,
            }),
        }
    }

    /// Updates `p` in place from `g` with an exact rule; `m` and `v` are the algorithm's
    /// states (empty slices where it has none). `first`: the momentum buffer was just
    /// created (SGD copies g).
    #[inline(always)]
    pub fn apply(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], first: bool) {
        self.with(first, Slices { p, g, m, v })
    }

    /// Runs this exact rule with `r`, its loop-invariant choices fixed once.
    #[inline(always)]
    pub fn with<R: Runner>(&self, first: bool, r: R) -> R::Out {
        match self {
            Rule::Fast(_) => {
                unreachable!("fast rules step in kernels::host::fused, one group at a time")
            }
            Rule::TorchAdam(u) => with_l2(u, u.l2.is_some(), r),
            Rule::FlashAdam(u) => with_l2(u, u.l2.is_some(), r),
            Rule::TorchSgd(u) => u.with(first, r),
            Rule::FlashSgd(u) => u.with(first, r),
            Rule::TorchLion(u) => r.run(&Fixed::<_, false, 0>(*u)),
            Rule::FlashLion(u) => r.run(&Fixed::<_, false, 0>(*u)),
        }
    }
}
