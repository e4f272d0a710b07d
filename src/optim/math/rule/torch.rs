//! torch.optim's single-tensor CPU arithmetic, for fp32 state: `add(x, alpha=a)` is one
//! fused multiply-add, `lerp` is ATen's vectorized form, `addcmul`/`addcdiv` round
//! separately. SGD and Lion in these operations: `sgd::Sgd<Torch>`, `lion::Lion<Torch>`.
use super::arith::{Arith, Ops, Torch};
use super::update::{Elem, Update};
use super::Betas;

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
    #[inline(always)]
    fn update<A: Arith, const L2: bool, const K: u8>(&self, a: A, x: Elem<A::F>) -> Elem<A::F> {
        let s = |x: f32| a.splat(x);
        let Betas { w1, b2, w2, .. } = self.betas;
        let Elem { p, g, m, v } = x;
        let gi = Torch::l2::<A, L2>(a, p, g, self.l2);
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
