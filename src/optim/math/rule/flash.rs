//! FlashOptim 0.1.4's kernel arithmetic, for the compressed formats stepped `exact`: no
//! fused multiply-add anywhere (Rust never contracts `a*b + c`). SGD and Lion in these
//! operations: `sgd::Sgd<Flash>`, `lion::Lion<Flash>`.
use super::arith::{Arith, Flash, Ops};
use super::update::{Elem, Update};
use super::Betas;

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
    #[inline(always)]
    fn update<A: Arith, const L2: bool, const K: u8>(&self, a: A, x: Elem<A::F>) -> Elem<A::F> {
        let s = |x: f32| a.splat(x);
        let Betas { b1, w1, b2, w2 } = self.betas;
        let Elem { p, g, m, v } = x;
        let gi = Flash::l2::<A, L2>(a, p, g, self.l2);
        let m = a.add(a.mul(m, s(b1)), a.mul(gi, s(w1)));
        let v = a.add(a.mul(v, s(b2)), a.mul(a.mul(gi, gi), s(w2)));
        let step = a.mul(s(self.lr), a.div(m, s(self.bc1)));
        let denom = a.add(a.sqrt(a.div(v, s(self.bc2))), s(self.eps));
        let p = a.sub(a.mul(p, s(self.decay)), a.div(step, denom));
        Elem { p, g, m, v }
    }
}
