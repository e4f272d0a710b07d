//! Lion (decoupled decay), in torch's operations and in FlashOptim's (`O`).
use std::marker::PhantomData;

use super::arith::{Arith, Ops};
use super::update::{Elem, States, Update, MOMENTUM};
use super::Betas;

/// Lion's scalars for one step; `lr` as `Sgd`'s.
#[derive(Debug, Clone, Copy)]
pub struct Lion<O> {
    pub decay: f32,
    pub betas: Betas,
    pub lr: f32,
    pub ops: PhantomData<O>,
}

impl<O: Ops> Update for Lion<O> {
    const STATES: [States; 5] = [MOMENTUM; 5];
    #[inline(always)]
    fn update<A: Arith, const L2: bool, const K: u8>(&self, a: A, x: Elem<A::F>) -> Elem<A::F> {
        let s = |x: f32| a.splat(x);
        let Betas { b1, w1, b2, w2 } = self.betas;
        let Elem { p, g, m, v } = x;
        let u = a.sign(O::mad(a, g, s(w1), a.mul(m, s(b1))));
        let p = O::step(a, u, s(self.lr), a.mul(p, s(self.decay)));
        let m = O::mad(a, g, s(w2), a.mul(m, s(b2)));
        Elem { p, g, m, v }
    }
}
