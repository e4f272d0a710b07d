//! FlashOptim 0.1.4's kernel arithmetic, for the compressed formats stepped `exact`: no
//! fused multiply-add anywhere (Rust never contracts `a*b + c`).
use super::arith::Arith;
use super::torch::SGD_STATES;
use super::update::{Elem, States, Update, ADAM, MOMENTUM};
use super::{Betas, Lion, Sgd};

/// Adam and AdamW.
#[derive(Debug, Clone, Copy)]
pub struct FlashAdam {
    pub l2: Option<f32>,
    pub decay: f32,
    pub betas: Betas,
    pub bc1: f32,
    pub bc2: f32,
    pub lr: f32,
    pub eps: f32,
}

impl Update for FlashAdam {
    const STATES: [States; 5] = [ADAM; 5];
    #[inline(always)]
    fn update<A: Arith, const L2: bool, const K: u8>(&self, a: A, x: Elem<A::F>) -> Elem<A::F> {
        let s = |x: f32| a.splat(x);
        let Betas { b1, w1, b2, w2 } = self.betas;
        let Elem { p, g, m, v } = x;
        let gi = if L2 {
            a.add(g, a.mul(p, s(self.l2.unwrap_or(0.0))))
        } else {
            g
        };
        let m = a.add(a.mul(m, s(b1)), a.mul(gi, s(w1)));
        let v = a.add(a.mul(v, s(b2)), a.mul(a.mul(gi, gi), s(w2)));
        let step = a.mul(s(self.lr), a.div(m, s(self.bc1)));
        let denom = a.add(a.sqrt(a.div(v, s(self.bc2))), s(self.eps));
        let p = a.sub(a.mul(p, s(self.decay)), a.div(step, denom));
        Elem { p, g, m, v }
    }
}

/// SGD and SGDW. The first step sets the buffer to the gradient undampened, as torch
/// does (FlashOptim dampens it; identical when dampening = 0).
#[derive(Debug, Clone, Copy)]
pub struct FlashSgd(pub Sgd);

impl Update for FlashSgd {
    const STATES: [States; 5] = SGD_STATES;
    #[inline(always)]
    fn update<A: Arith, const L2: bool, const K: u8>(&self, a: A, x: Elem<A::F>) -> Elem<A::F> {
        let (s, c) = (|x: f32| a.splat(x), self.0);
        let Elem { p, g, mut m, v } = x;
        let gi = if L2 {
            a.add(g, a.mul(p, s(c.l2.unwrap_or(0.0))))
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
                a.add(a.mul(m, mom), a.mul(gi, s(c.wdamp)))
            };
            if K == 2 || K == 4 {
                a.add(gi, a.mul(mom, m))
            } else {
                m
            }
        };
        let p = a.sub(a.mul(p, s(c.decay)), a.mul(d, s(c.lr)));
        Elem { p, g, m, v }
    }
}

/// Lion (decoupled decay).
#[derive(Debug, Clone, Copy)]
pub struct FlashLion(pub Lion);

impl Update for FlashLion {
    const STATES: [States; 5] = [MOMENTUM; 5];
    #[inline(always)]
    fn update<A: Arith, const L2: bool, const K: u8>(&self, a: A, x: Elem<A::F>) -> Elem<A::F> {
        let (s, c) = (|x: f32| a.splat(x), self.0);
        let Betas { b1, w1, b2, w2 } = c.betas;
        let Elem { p, g, m, v } = x;
        let u = a.sign(a.add(a.mul(m, s(b1)), a.mul(g, s(w1))));
        let m = a.add(a.mul(m, s(b2)), a.mul(g, s(w2)));
        let p = a.sub(a.mul(p, s(c.decay)), a.mul(u, s(c.lr)));
        Elem { p, g, m, v }
    }
}
