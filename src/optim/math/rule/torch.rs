//! torch.optim's single-tensor CPU arithmetic, for fp32 state: `add(x, alpha=a)` is one
//! fused multiply-add, `lerp` is ATen's vectorized form, `addcmul`/`addcdiv` round
//! separately. The `fast` arithmetic steps SGD and Lion with these same operations (its
//! own scalars, see `fast`).
use super::arith::Arith;
use super::update::{Elem, States, Update, ADAM, MOMENTUM};
use super::{Betas, Lion, Sgd};

/// Adam and AdamW (`betas.b1` unused: the first moment is a `lerp` by `w1`).
#[derive(Debug, Clone, Copy)]
pub struct TorchAdam {
    /// Adam's weight decay, added to the gradient.
    pub l2: Option<f32>,
    /// `1 − lr·wd` (AdamW), else 1.
    pub decay: f32,
    pub betas: Betas,
    pub bc2_sqrt: f32,
    pub eps: f32,
    /// `−lr / bc1`.
    pub neg_step: f32,
}

impl Update for TorchAdam {
    const STATES: [States; 5] = [ADAM; 5];
    #[inline(always)]
    fn update<A: Arith, const L2: bool, const K: u8>(&self, a: A, x: Elem<A::F>) -> Elem<A::F> {
        let s = |x: f32| a.splat(x);
        let Betas { w1, b2, w2, .. } = self.betas;
        let Elem { p, g, m, v } = x;
        let gi = if L2 {
            a.fma(p, s(self.l2.unwrap_or(0.0)), g)
        } else {
            g
        };
        // ATen's vectorized lerp(m, g, w): fma(w, g − m, m) for |w| < 0.5, else
        // fma(w − 1, g − m, g).
        let d = a.sub(gi, m);
        let m = if w1.abs() < 0.5 {
            a.fma(s(w1), d, m)
        } else {
            a.fma(s(w1 - 1.0), d, gi)
        };
        let v = a.add(a.mul(v, s(b2)), a.mul(a.mul(s(w2), gi), gi));
        let denom = a.add(a.div(a.sqrt(v), s(self.bc2_sqrt)), s(self.eps));
        let step = a.div(a.mul(s(self.neg_step), m), denom);
        let p = a.add(a.mul(p, s(self.decay)), step);
        Elem { p, g, m, v }
    }
}

/// SGD and SGDW; dampening as torch: the buffer's first step sets it to the gradient
/// undampened.
#[derive(Debug, Clone, Copy)]
pub struct TorchSgd(pub Sgd);

/// The states SGD touches, by variant: none without momentum; the buffer only written on
/// its first step.
pub(super) const SGD_STATES: [States; 5] = {
    let none = States {
        m: false,
        read_m: false,
        v: false,
    };
    let first = States {
        m: true,
        read_m: false,
        v: false,
    };
    [none, MOMENTUM, MOMENTUM, first, first]
};

impl Update for TorchSgd {
    const STATES: [States; 5] = SGD_STATES;
    #[inline(always)]
    fn update<A: Arith, const L2: bool, const K: u8>(&self, a: A, x: Elem<A::F>) -> Elem<A::F> {
        let (s, c) = (|x: f32| a.splat(x), self.0);
        let Elem { p, g, mut m, v } = x;
        let gi = if L2 {
            a.fma(p, s(c.l2.unwrap_or(0.0)), g)
        } else {
            g
        };
        let mom = s(c.momentum.unwrap_or(0.0));
        let d = if K == 0 {
            gi
        } else {
            m = if K >= 3 {
                gi
            } else {
                a.fma(gi, s(c.wdamp), a.mul(m, mom))
            };
            if K == 2 || K == 4 {
                a.fma(m, mom, gi)
            } else {
                m
            }
        };
        let p = a.fma(d, s(c.lr), a.mul(p, s(c.decay)));
        Elem { p, g, m, v }
    }
}

/// Lion (decoupled decay).
#[derive(Debug, Clone, Copy)]
pub struct TorchLion(pub Lion);

impl Update for TorchLion {
    const STATES: [States; 5] = [MOMENTUM; 5];
    #[inline(always)]
    fn update<A: Arith, const L2: bool, const K: u8>(&self, a: A, x: Elem<A::F>) -> Elem<A::F> {
        let (s, c) = (|x: f32| a.splat(x), self.0);
        let Betas { b1, w1, b2, w2 } = c.betas;
        let Elem { p, g, m, v } = x;
        let u = a.sign(a.fma(g, s(w1), a.mul(m, s(b1))));
        let p = a.fma(u, s(c.lr), a.mul(p, s(c.decay)));
        let m = a.fma(g, s(w2), a.mul(m, s(b2)));
        Elem { p, g, m, v }
    }
}
