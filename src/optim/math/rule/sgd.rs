//! SGD and SGDW, in torch's operations and in FlashOptim's (`O`). Dampening as torch in
//! both: the buffer's first step sets it to the gradient undampened (FlashOptim dampens
//! it; identical when dampening = 0).
use std::marker::PhantomData;

use super::arith::{Arith, Ops};
use super::update::{Elem, Fixed, Runner, States, Update, MOMENTUM};

/// SGD's scalars for one step.
#[derive(Debug, Clone, Copy)]
pub struct Sgd<O> {
    /// SGD's weight decay, added to the gradient.
    pub l2: Option<f32>,
    /// `1 − lr·wd` (SGDW), else 1.
    pub decay: f32,
    pub momentum: Option<f32>,
    /// `1 − dampening`.
    pub wdamp: f32,
    pub nesterov: bool,
    /// The learning rate as `O` applies it: negative where `O::FUSED` adds it by a fused
    /// multiply-add, positive where it is subtracted.
    pub lr: f32,
    pub ops: PhantomData<O>,
}

/// The states SGD touches, by variant: none without momentum; the buffer only written on
/// its first step.
const SGD_STATES: [States; 5] = {
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

impl<O: Ops> Update for Sgd<O> {
    const STATES: [States; 5] = SGD_STATES;
    #[inline(always)]
    fn update<A: Arith, const L2: bool, const K: u8>(&self, a: A, x: Elem<A::F>) -> Elem<A::F> {
        let s = |x: f32| a.splat(x);
        let Elem { p, g, mut m, v } = x;
        let gi = O::l2::<A, L2>(a, p, g, self.l2);
        let mom = s(self.momentum.unwrap_or(0.0));
        let d = if K == 0 {
            gi
        } else {
            m = if K >= 3 {
                gi
            } else {
                O::mad(a, gi, s(self.wdamp), a.mul(m, mom))
            };
            if K == 2 || K == 4 {
                O::mad(a, m, mom, gi)
            } else {
                m
            }
        };
        let p = O::step(a, d, s(self.lr), a.mul(p, s(self.decay)));
        Elem { p, g, m, v }
    }
}

impl<O: Ops> Sgd<O> {
    /// Runs this SGD with `r`, its choices fixed: `K` from momentum, Nesterov and the
    /// buffer's first step (`first`).
    #[inline(always)]
    pub(super) fn with<R: Runner>(&self, first: bool, r: R) -> R::Out {
        macro_rules! run {
            ($k:literal) => {
                if self.l2.is_some() {
                    r.run(&Fixed::<Self, true, $k>(*self))
                } else {
                    r.run(&Fixed::<Self, false, $k>(*self))
                }
            };
        }
        match (self.momentum.is_some(), self.nesterov, first) {
            (false, _, _) => run!(0),
            (true, false, false) => run!(1),
            (true, true, false) => run!(2),
            (true, false, true) => run!(3),
            (true, true, true) => run!(4),
        }
    }
}
