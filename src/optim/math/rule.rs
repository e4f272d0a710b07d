//! The element-wise update rules, one per (algorithm, arithmetic contract), written once
//! as plain loops over equal-length f32 slices so the compiler vectorizes them.
//!
//! Two contracts (see `StateFormat`):
//! - `Torch*` (fp32 state): torch.optim's single-tensor CPU arithmetic. Scalars in double
//!   on the host (`1 − lr·wd`, `lr/bc1`, `sqrt(bc2)`, `1 − β`), rounded to f32 when
//!   applied; `add(x, alpha=a)` is one fused multiply-add (`f32::mul_add`); `lerp` is
//!   ATen's vectorized form; `addcmul`/`addcdiv` are separate roundings.
//! - `Flash*` (param_dtype / quant8 / split masters): FlashOptim 0.1.4's kernel arithmetic:
//!   hyper-parameters rounded to f32, `1 − β` an f32 subtraction, `lr·wd` and `1 − dampening`
//!   in double then rounded, `pow(β, step)` in double from the f32 β, then rounded; no
//!   fused multiply-add anywhere (Rust never contracts `a*b + c`).
//!
//! SGD dampening follows torch in both contracts: the first step sets the buffer to the
//! gradient undampened (FlashOptim dampens it; identical when dampening = 0).
use super::fast::FastRule;
use crate::optim::math::config::{Algorithm, Arithmetic, OptimConfig, StateFormat};

#[derive(Debug, Clone, Copy)]
pub enum Rule {
    TorchAdam {
        l2: Option<f32>,
        decay: f32,
        w1: f32,
        b2: f32,
        w2: f32,
        bc2_sqrt: f32,
        eps: f32,
        neg_step: f32,
    },
    FlashAdam {
        l2: Option<f32>,
        decay: f32,
        b1: f32,
        w1: f32,
        b2: f32,
        w2: f32,
        bc1: f32,
        bc2: f32,
        lr: f32,
        eps: f32,
    },
    TorchSgd {
        l2: Option<f32>,
        decay: f32,
        momentum: Option<f32>,
        wdamp: f32,
        nesterov: bool,
        neg_lr: f32,
    },
    FlashSgd {
        l2: Option<f32>,
        decay: f32,
        momentum: Option<f32>,
        wdamp: f32,
        nesterov: bool,
        lr: f32,
    },
    TorchLion {
        decay: f32,
        b1: f32,
        w1: f32,
        b2: f32,
        w2: f32,
        neg_lr: f32,
    },
    FlashLion {
        decay: f32,
        b1: f32,
        w1: f32,
        b2: f32,
        w2: f32,
        lr: f32,
    },
    /// `Arithmetic::Fast` on non-fp32 state (see `fast`).
    Fast(FastRule),
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
                Rule::TorchAdam {
                    l2,
                    decay: (1.0 - decay_amount) as f32,
                    w1: (1.0 - c.beta1) as f32,
                    b2: c.beta2 as f32,
                    w2: (1.0 - c.beta2) as f32,
                    bc2_sqrt: bc2.sqrt() as f32,
                    eps: c.eps as f32,
                    neg_step: (-(c.lr / bc1)) as f32,
                }
            }
            (Algorithm::AdamW | Algorithm::Adam, false) => {
                let (b1, b2) = (c.beta1 as f32, c.beta2 as f32);
                Rule::FlashAdam {
                    l2,
                    decay: 1.0 - decay_amount as f32,
                    b1,
                    w1: 1.0 - b1,
                    b2,
                    w2: 1.0 - b2,
                    bc1: 1.0 - flash_pow(b1, step),
                    bc2: 1.0 - flash_pow(b2, step),
                    lr: c.lr as f32,
                    eps: c.eps as f32,
                }
            }
            (Algorithm::Sgd | Algorithm::SgdW, true) => Rule::TorchSgd {
                l2,
                decay: (1.0 - decay_amount) as f32,
                momentum,
                wdamp: (1.0 - c.dampening) as f32,
                nesterov: c.nesterov,
                neg_lr: (-c.lr) as f32,
            },
            (Algorithm::Sgd | Algorithm::SgdW, false) => Rule::FlashSgd {
                l2,
                decay: 1.0 - decay_amount as f32,
                momentum,
                wdamp: (1.0 - c.dampening) as f32,
                nesterov: c.nesterov,
                lr: c.lr as f32,
            },
            (Algorithm::Lion, true) => Rule::TorchLion {
                decay: (1.0 - decay_amount) as f32,
                b1: c.beta1 as f32,
                w1: (1.0 - c.beta1) as f32,
                b2: c.beta2 as f32,
                w2: (1.0 - c.beta2) as f32,
                neg_lr: (-c.lr) as f32,
            },
            (Algorithm::Lion, false) => {
                let (b1, b2) = (c.beta1 as f32, c.beta2 as f32);
                Rule::FlashLion {
                    decay: 1.0 - decay_amount as f32,
                    b1,
                    w1: 1.0 - b1,
                    b2,
                    w2: 1.0 - b2,
                    lr: c.lr as f32,
                }
            }
        }
    }

    /// Updates `p` in place from `g`; `m` and `v` are the algorithm's states (empty slices
    /// where it has none). `first`: the momentum buffer was just created (SGD copies g).
    #[inline(always)]
    pub fn apply(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], first: bool) {
        let n = p.len();
        let g = &g[..n];
        match *self {
            Rule::Fast(_) => {
                unreachable!("fast rules step in kernels::host::fused, one group at a time")
            }
            Rule::TorchAdam {
                l2,
                decay,
                w1,
                b2,
                w2,
                bc2_sqrt,
                eps,
                neg_step,
            } => {
                let (m, v) = (&mut m[..n], &mut v[..n]);
                for i in 0..n {
                    let gi = match l2 {
                        Some(wd) => p[i].mul_add(wd, g[i]),
                        None => g[i],
                    };
                    let pi = p[i] * decay;
                    let mi = lerp(m[i], gi, w1);
                    let vi = v[i] * b2 + (w2 * gi) * gi;
                    let denom = vi.sqrt() / bc2_sqrt + eps;
                    p[i] = pi + (neg_step * mi) / denom;
                    m[i] = mi;
                    v[i] = vi;
                }
            }
            Rule::FlashAdam {
                l2,
                decay,
                b1,
                w1,
                b2,
                w2,
                bc1,
                bc2,
                lr,
                eps,
            } => {
                let (m, v) = (&mut m[..n], &mut v[..n]);
                for i in 0..n {
                    let gi = match l2 {
                        Some(wd) => g[i] + p[i] * wd,
                        None => g[i],
                    };
                    let mi = m[i] * b1 + gi * w1;
                    let vi = v[i] * b2 + (gi * gi) * w2;
                    let pi = p[i] * decay;
                    p[i] = pi - (lr * (mi / bc1)) / ((vi / bc2).sqrt() + eps);
                    m[i] = mi;
                    v[i] = vi;
                }
            }
            Rule::TorchSgd {
                l2,
                decay,
                momentum,
                wdamp,
                nesterov,
                neg_lr,
            } => {
                for i in 0..n {
                    let gi = match l2 {
                        Some(wd) => p[i].mul_add(wd, g[i]),
                        None => g[i],
                    };
                    let d = match momentum {
                        Some(mom) => {
                            let b = if first {
                                gi
                            } else {
                                gi.mul_add(wdamp, m[i] * mom)
                            };
                            m[i] = b;
                            if nesterov {
                                b.mul_add(mom, gi)
                            } else {
                                b
                            }
                        }
                        None => gi,
                    };
                    p[i] = d.mul_add(neg_lr, p[i] * decay);
                }
            }
            Rule::FlashSgd {
                l2,
                decay,
                momentum,
                wdamp,
                nesterov,
                lr,
            } => {
                // The loop-invariant choices are made once, outside the loop, so each
                // variant vectorizes (same operations, same bits).
                let f = FlashSgdLoop {
                    wd: l2.unwrap_or(0.0),
                    decay,
                    mom: momentum.unwrap_or(0.0),
                    wdamp,
                    lr,
                };
                run_sgd_variant(
                    &f,
                    l2.is_some(),
                    momentum.is_some(),
                    nesterov,
                    first,
                    p,
                    g,
                    m,
                )
            }
            Rule::TorchLion {
                decay,
                b1,
                w1,
                b2,
                w2,
                neg_lr,
            } => {
                let m = &mut m[..n];
                for i in 0..n {
                    let u = sign(g[i].mul_add(w1, m[i] * b1));
                    p[i] = u.mul_add(neg_lr, p[i] * decay);
                    m[i] = g[i].mul_add(w2, m[i] * b2);
                }
            }
            Rule::FlashLion {
                decay,
                b1,
                w1,
                b2,
                w2,
                lr,
            } => {
                let m = &mut m[..n];
                for i in 0..n {
                    let u = sign(m[i] * b1 + g[i] * w1);
                    m[i] = m[i] * b2 + g[i] * w2;
                    p[i] = p[i] * decay - u * lr;
                }
            }
        }
    }
}

/// FlashOptim's SGD loop, specialized. `K`: 0 no momentum, 1 momentum, 2 Nesterov, 3 and
/// 4 the same on the buffer's first step (set to the gradient).
struct FlashSgdLoop {
    wd: f32,
    decay: f32,
    mom: f32,
    wdamp: f32,
    lr: f32,
}

impl SgdVariant for FlashSgdLoop {
    #[inline(always)]
    fn run<const L2: bool, const K: u8>(&self, p: &mut [f32], g: &[f32], m: &mut [f32]) {
        let n = p.len();
        let m = if K == 0 { &mut m[..0] } else { &mut m[..n] };
        for i in 0..n {
            let gi = if L2 { g[i] + p[i] * self.wd } else { g[i] };
            let pi = p[i] * self.decay;
            p[i] = if K == 0 {
                pi - gi * self.lr
            } else {
                let b = if K >= 3 {
                    gi
                } else {
                    m[i] * self.mom + gi * self.wdamp
                };
                m[i] = b;
                if K == 2 || K == 4 {
                    pi - (gi + self.mom * b) * self.lr
                } else {
                    pi - b * self.lr
                }
            };
        }
    }
}

/// One SGD loop specialized on its loop-invariant choices (`L2`: L2 weight decay; `K`: 0 no
/// momentum, 1 momentum, 2 Nesterov, 3 and 4 the same on the buffer's first step), so each
/// variant vectorizes. Exact and fast arithmetic each implement it.
pub(super) trait SgdVariant {
    fn run<const L2: bool, const K: u8>(&self, p: &mut [f32], g: &[f32], m: &mut [f32]);
}

/// Picks the specialized loop for these choices, once per chunk.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn run_sgd_variant<S: SgdVariant>(
    s: &S,
    l2: bool,
    momentum: bool,
    nesterov: bool,
    first: bool,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
) {
    match (l2, momentum, nesterov, first) {
        (false, false, _, _) => s.run::<false, 0>(p, g, m),
        (true, false, _, _) => s.run::<true, 0>(p, g, m),
        (false, true, false, false) => s.run::<false, 1>(p, g, m),
        (true, true, false, false) => s.run::<true, 1>(p, g, m),
        (false, true, true, false) => s.run::<false, 2>(p, g, m),
        (true, true, true, false) => s.run::<true, 2>(p, g, m),
        (false, true, false, true) => s.run::<false, 3>(p, g, m),
        (true, true, false, true) => s.run::<true, 3>(p, g, m),
        (false, true, true, true) => s.run::<false, 4>(p, g, m),
        (true, true, true, true) => s.run::<true, 4>(p, g, m),
    }
}

/// ATen's vectorized CPU `lerp(start, end, w)`: `fma(w, end − start, start)` for |w| < 0.5,
/// else `fma(w − 1, end − start, end)`.
#[inline(always)]
fn lerp(start: f32, end: f32, w: f32) -> f32 {
    let d = end - start;
    if w.abs() < 0.5 {
        w.mul_add(d, start)
    } else {
        (w - 1.0).mul_add(d, end)
    }
}

/// torch `sign`: −1, 0 or 1 (0 stays 0).
#[inline(always)]
fn sign(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
}
