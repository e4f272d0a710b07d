//! The arithmetic the update rules are written in: f32 operations with one exact result
//! each (a fused multiply-add rounds once), over one value or over a vector of lanes.
//! `Scalar` runs a rule over slices (the exact loops, which the compiler vectorizes); the
//! host SIMD backends (`kernels::host::fused`) implement it for 16 lanes, so each rule is
//! defined once and every backend gives its bits.

/// f32 values (`F`) and per-value truth (`M`) with the operations the rules use.
pub trait Arith: Copy {
    type F: Copy;
    type M: Copy;
    fn splat(self, x: f32) -> Self::F;
    fn add(self, a: Self::F, b: Self::F) -> Self::F;
    fn sub(self, a: Self::F, b: Self::F) -> Self::F;
    fn mul(self, a: Self::F, b: Self::F) -> Self::F;
    fn div(self, a: Self::F, b: Self::F) -> Self::F;
    fn sqrt(self, a: Self::F) -> Self::F;
    /// `a·b + c` with one rounding.
    fn fma(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// `a·b − c` with one rounding.
    fn fms(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// `a < b`, ordered (false where either is NaN).
    fn lt(self, a: Self::F, b: Self::F) -> Self::M;
    fn gt(self, a: Self::F, b: Self::F) -> Self::M;
    /// `m ? a : b`.
    fn select(self, m: Self::M, a: Self::F, b: Self::F) -> Self::F;

    /// torch's `sign`: −1, 0 or 1; 0 for ±0 and NaN.
    #[inline(always)]
    fn sign(self, x: Self::F) -> Self::F {
        let zero = self.splat(0.0);
        let neg = self.select(self.lt(x, zero), self.splat(-1.0), zero);
        self.select(self.gt(x, zero), self.splat(1.0), neg)
    }
}

/// One f32 at a time: Rust's own operations (`mul_add` is fused; Rust never contracts
/// `a*b + c`), which the compiler vectorizes in the slice loops.
#[derive(Clone, Copy)]
pub struct Scalar;

impl Arith for Scalar {
    type F = f32;
    type M = bool;
    #[inline(always)]
    fn splat(self, x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn add(self, a: f32, b: f32) -> f32 {
        a + b
    }
    #[inline(always)]
    fn sub(self, a: f32, b: f32) -> f32 {
        a - b
    }
    #[inline(always)]
    fn mul(self, a: f32, b: f32) -> f32 {
        a * b
    }
    #[inline(always)]
    fn div(self, a: f32, b: f32) -> f32 {
        a / b
    }
    #[inline(always)]
    fn sqrt(self, a: f32) -> f32 {
        a.sqrt()
    }
    #[inline(always)]
    fn fma(self, a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    fn fms(self, a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, -c)
    }
    #[inline(always)]
    fn lt(self, a: f32, b: f32) -> bool {
        a < b
    }
    #[inline(always)]
    fn gt(self, a: f32, b: f32) -> bool {
        a > b
    }
    #[inline(always)]
    fn select(self, m: bool, a: f32, b: f32) -> f32 {
        if m {
            a
        } else {
            b
        }
    }
}

/// Where torch's arithmetic and FlashOptim's differ in the rules they share (SGD, Lion):
/// whether `x·y + z` is one fused multiply-add, and a learning-rate step added by one
/// (`lr` held negative) or subtracted after a product (`lr` positive).
pub trait Ops: Copy + Default + std::fmt::Debug {
    const FUSED: bool;

    /// `x·y + z`, as this arithmetic rounds it.
    #[inline(always)]
    fn mad<A: Arith>(a: A, x: A::F, y: A::F, z: A::F) -> A::F {
        if Self::FUSED {
            a.fma(x, y, z)
        } else {
            a.add(a.mul(x, y), z)
        }
    }

    /// The gradient `g` with `L2` weight decay `wd·p` added (torch's `g.add(p, alpha=wd)`).
    #[inline(always)]
    fn l2<A: Arith, const L2: bool>(a: A, p: A::F, g: A::F, wd: Option<f32>) -> A::F {
        if L2 {
            Self::mad(a, p, a.splat(wd.unwrap_or(0.0)), g)
        } else {
            g
        }
    }

    /// `base` moved by `d` times the learning rate `lr` (negative where `FUSED`).
    #[inline(always)]
    fn step<A: Arith>(a: A, d: A::F, lr: A::F, base: A::F) -> A::F {
        if Self::FUSED {
            a.fma(d, lr, base)
        } else {
            a.sub(base, a.mul(d, lr))
        }
    }
}

/// torch.optim's (and the `fast` arithmetic's) operations.
#[derive(Debug, Clone, Copy, Default)]
pub struct Torch;
impl Ops for Torch {
    const FUSED: bool = true;
}

/// FlashOptim's: no fused multiply-add anywhere.
#[derive(Debug, Clone, Copy, Default)]
pub struct Flash;
impl Ops for Flash {
    const FUSED: bool = false;
}
