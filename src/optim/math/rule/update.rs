//! How a rule meets memory. A rule's update is written once (`Update`), generic over the
//! arithmetic backend and specialized on its loop-invariant choices; `Rule::with` turns
//! a step's runtime choices into those compile-time ones once per chunk and hands the
//! fixed update (`Elementwise`) to a `Runner`: the slice loop below, or the fused group
//! kernel of `kernels::host::fused`.
use super::arith::{Arith, Scalar};

/// Which states an update touches.
#[derive(Debug, Clone, Copy)]
pub struct States {
    /// Writes a momentum state.
    pub m: bool,
    /// Reads it (SGD's first step only writes it).
    pub read_m: bool,
    /// Reads and writes a variance state.
    pub v: bool,
}

const ADAM: States = States {
    m: true,
    read_m: true,
    v: true,
};
pub(super) const MOMENTUM: States = States {
    m: true,
    read_m: true,
    v: false,
};

/// One element's (or one vector of lanes') values: the parameter, its gradient, and the
/// algorithm's states `m` and `v` (a scratch value where it has none).
#[derive(Clone, Copy)]
pub struct Elem<F> {
    pub p: F,
    pub g: F,
    pub m: F,
    pub v: F,
}

/// One rule's element-wise update: the new `p`, `m` and `v` (`g` passed through).
/// `L2`: weight decay added to the gradient (Adam, SGD). `K`: the rule's variant, 0
/// where it has one; SGD: 0 no momentum, 1 momentum, 2 Nesterov, 3 and 4 the same on
/// the buffer's first step (set to the gradient); the fast Adam: 1 where the variance
/// state holds `sqrt(v)`, as the quantized formats store it.
pub trait Update: Copy {
    /// The states touched, by `K` (Adam's: both moments, read and written).
    const STATES: [States; 5] = [ADAM; 5];
    fn update<A: Arith, const L2: bool, const K: u8>(&self, a: A, x: Elem<A::F>) -> Elem<A::F>;
}

/// An update with its choices fixed: what a runner's loop calls for each element (or
/// each vector of lanes).
pub trait Elementwise {
    const M: bool;
    const READ_M: bool;
    const V: bool;
    fn apply<A: Arith>(&self, a: A, x: Elem<A::F>) -> Elem<A::F>;
}

/// `U` with `L2` and `K` fixed. It holds its own copy of the scalars, which the loops
/// then keep in registers.
pub struct Fixed<U, const L2: bool, const K: u8>(pub U);

impl<U: Update, const L2: bool, const K: u8> Elementwise for Fixed<U, L2, K> {
    const M: bool = U::STATES[K as usize].m;
    const READ_M: bool = U::STATES[K as usize].read_m;
    const V: bool = U::STATES[K as usize].v;
    #[inline(always)]
    fn apply<A: Arith>(&self, a: A, x: Elem<A::F>) -> Elem<A::F> {
        self.0.update::<A, L2, K>(a, x)
    }
}

/// Runs a fixed update over memory.
pub trait Runner {
    type Out;
    fn run<E: Elementwise>(self, e: &E) -> Self::Out;
}

/// `u` with its weight decay choice fixed (rules with one variant).
#[inline(always)]
pub(super) fn with_l2<U: Update, R: Runner>(u: &U, l2: bool, r: R) -> R::Out {
    if l2 {
        r.run(&Fixed::<U, true, 0>(*u))
    } else {
        r.run(&Fixed::<U, false, 0>(*u))
    }
}

/// The exact arithmetic's loop: equal-length f32 slices (`m`, `v` empty where the rule
/// has no such state), one element at a time, which the compiler vectorizes.
pub struct Slices<'a> {
    pub p: &'a mut [f32],
    pub g: &'a [f32],
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
}

impl Runner for Slices<'_> {
    type Out = ();
    #[inline(always)]
    fn run<E: Elementwise>(self, e: &E) {
        let n = self.p.len();
        let (p, g) = (self.p, &self.g[..n]);
        let x = |p, g, m, v| e.apply(Scalar, Elem { p, g, m, v });
        match (E::M, E::V) {
            (true, true) => {
                let (m, v) = (&mut self.m[..n], &mut self.v[..n]);
                for i in 0..n {
                    let y = x(p[i], g[i], m[i], v[i]);
                    (p[i], m[i], v[i]) = (y.p, y.m, y.v);
                }
            }
            (true, false) => {
                let m = &mut self.m[..n];
                for i in 0..n {
                    let y = x(p[i], g[i], m[i], 0.0);
                    (p[i], m[i]) = (y.p, y.m);
                }
            }
            (false, _) => {
                for i in 0..n {
                    p[i] = x(p[i], g[i], 0.0, 0.0).p;
                }
            }
        }
    }
}
