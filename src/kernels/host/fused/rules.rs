//! The `fast` rules on 16 lanes: FlashOptim's algorithms with bias corrections folded into
//! two scalars (`lr/bc1`, `1/sqrt(bc2)`), fused multiply-adds wherever a product is
//! added, and quant8 variance carried as its root (one square root per element).
use super::lanes::Lanes;

/// One rule's element-wise update. `m` and `v` are the algorithm's states (unused lanes
/// where it has none); with `ROOT` states `v` holds `sqrt(v)` in and out.
pub trait Update<L: Lanes> {
    /// Writes a momentum state.
    const M: bool;
    /// Reads it (SGD's first step only writes it).
    const READ_M: bool;
    /// Reads and writes a variance state.
    const V: bool;
    fn apply(&self, l: L, p: &mut L::F, g: L::F, m: &mut L::F, v: &mut L::F);
}

/// Adam and AdamW (`L2`: Adam's weight decay added to the gradient; `ROOT`: the variance
/// state holds `sqrt(v)`, as the quantized formats store it).
pub struct Adam<const L2: bool, const ROOT: bool> {
    pub wd: f32,
    pub decay: f32,
    pub b1: f32,
    pub w1: f32,
    pub b2: f32,
    pub w2: f32,
    /// `lr / bc1`.
    pub step: f32,
    /// `1 / sqrt(bc2)`.
    pub inv_sqrt_bc2: f32,
    pub eps: f32,
}

impl<L: Lanes, const L2: bool, const ROOT: bool> Update<L> for Adam<L2, ROOT> {
    const M: bool = true;
    const READ_M: bool = true;
    const V: bool = true;
    #[inline(always)]
    fn apply(&self, l: L, p: &mut L::F, g: L::F, m: &mut L::F, v: &mut L::F) {
        let g = if L2 {
            l.fma(*p, l.splat(self.wd), g)
        } else {
            g
        };
        let mi = l.fma(g, l.splat(self.w1), l.mul(*m, l.splat(self.b1)));
        let prev = if ROOT { l.mul(*v, *v) } else { *v };
        let vi = l.fma(l.mul(g, g), l.splat(self.w2), l.mul(prev, l.splat(self.b2)));
        let r = l.sqrt(vi);
        let denom = l.fma(r, l.splat(self.inv_sqrt_bc2), l.splat(self.eps));
        *p = l.fms(
            *p,
            l.splat(self.decay),
            l.div(l.mul(l.splat(self.step), mi), denom),
        );
        *m = mi;
        *v = if ROOT { r } else { vi };
    }
}

/// SGD and SGDW, specialized like the exact loops: `K` 0 no momentum, 1 momentum,
/// 2 Nesterov, 3 and 4 the same on the buffer's first step (set to the gradient).
pub struct Sgd<const L2: bool, const K: u8> {
    pub wd: f32,
    pub decay: f32,
    pub mom: f32,
    pub wdamp: f32,
    pub neg_lr: f32,
}

impl<L: Lanes, const L2: bool, const K: u8> Update<L> for Sgd<L2, K> {
    const M: bool = K != 0;
    const READ_M: bool = K == 1 || K == 2;
    const V: bool = false;
    #[inline(always)]
    fn apply(&self, l: L, p: &mut L::F, g: L::F, m: &mut L::F, _v: &mut L::F) {
        let g = if L2 {
            l.fma(*p, l.splat(self.wd), g)
        } else {
            g
        };
        let pd = l.mul(*p, l.splat(self.decay));
        let d = if K == 0 {
            g
        } else {
            let b = if K >= 3 {
                g
            } else {
                l.fma(g, l.splat(self.wdamp), l.mul(*m, l.splat(self.mom)))
            };
            *m = b;
            if K == 2 || K == 4 {
                l.fma(l.splat(self.mom), b, g)
            } else {
                b
            }
        };
        *p = l.fma(d, l.splat(self.neg_lr), pd);
    }
}

pub struct Lion {
    pub decay: f32,
    pub b1: f32,
    pub w1: f32,
    pub b2: f32,
    pub w2: f32,
    pub neg_lr: f32,
}

impl<L: Lanes> Update<L> for Lion {
    const M: bool = true;
    const READ_M: bool = true;
    const V: bool = false;
    #[inline(always)]
    fn apply(&self, l: L, p: &mut L::F, g: L::F, m: &mut L::F, _v: &mut L::F) {
        let c = l.fma(g, l.splat(self.w1), l.mul(*m, l.splat(self.b1)));
        // sign(c): 0 for 0 and NaN.
        let u = l.select(
            l.gt(c, l.splat(0.0)),
            l.splat(1.0),
            l.select(l.lt(c, l.splat(0.0)), l.splat(-1.0), l.splat(0.0)),
        );
        *m = l.fma(g, l.splat(self.w2), l.mul(*m, l.splat(self.b2)));
        *p = l.fma(u, l.splat(self.neg_lr), l.mul(*p, l.splat(self.decay)));
    }
}
