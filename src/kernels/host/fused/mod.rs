//! The `fast` arithmetic's step, fused: each 32-element quantization group is loaded,
//! decoded, updated, re-quantized and stored while it sits in registers (two vectors of
//! 16 lanes), so no stage writes its f32 values back to memory. The kernel is written
//! once against `Lanes`; its AVX-512 backend and the portable one (AVX2 and plain code)
//! give the same bits, since every lane operation has one exact result.
//!
//! - `lanes`: the lane operations and the portable backend; `avx512`: the AVX-512 one;
//! - `codec`: stored formats ⇄ f32 lanes (split masters, bf16/f16, quant8);
//!
//! The algorithms' updates are `optim::math::rule`'s, run here over lanes.
#[cfg(target_arch = "x86_64")]
mod avx512;
mod codec;
mod lanes;

#[cfg(target_arch = "x86_64")]
pub use avx512::Avx512;
pub use lanes::{Lanes, Portable, W};

use std::mem::MaybeUninit;

use crate::optim::math::master_split::Half;
use crate::optim::math::state::Root;
use codec::{ErrPtr, GradPtr, MomentPtr, ParamPtr};

use super::job::Job;
use crate::optim::math::quant8::GROUP;
use crate::optim::math::rule::fast::FastRule;
use crate::optim::math::rule::update::{Elem, Elementwise, Runner};
use crate::optim::math::state::{ErrChunk, GradChunk, MomentChunk, MomentView, ParamChunk};

/// A job's memory as raw pointers (valid for the job's `n` elements). The moments are
/// read through `m_in` / `v_in` (their values before the step: `Job::old`, else the same
/// as `m` / `v`) and written through `m` / `v`.
struct Ptrs {
    p: ParamPtr,
    g: GradPtr,
    m: MomentPtr,
    v: MomentPtr,
    m_in: MomentPtr,
    v_in: MomentPtr,
    n: usize,
}

/// A read-only view as the kernel's pointer (only ever read through).
fn view_ptr(v: &MomentView<'_>) -> MomentPtr {
    match v {
        MomentView::F32(s) => MomentPtr::F32(s.as_ptr() as *mut f32),
        MomentView::Half(h, s) => MomentPtr::Half(*h, s.as_ptr() as *mut u16),
        MomentView::Signed(q, s) => MomentPtr::Signed(q.as_ptr() as *mut i8, s.as_ptr() as *mut _),
        MomentView::Unsigned(q, s, r) => {
            MomentPtr::Unsigned(q.as_ptr() as *mut u8, s.as_ptr() as *mut _, *r)
        }
    }
}

fn moment_ptr(c: &mut Option<MomentChunk<'_>>) -> MomentPtr {
    match c {
        None => MomentPtr::F32(std::ptr::null_mut()),
        Some(MomentChunk::F32(s)) => MomentPtr::F32(s.as_mut_ptr()),
        Some(MomentChunk::Half(h, s)) => MomentPtr::Half(*h, s.as_mut_ptr()),
        Some(MomentChunk::Signed(q, s)) => MomentPtr::Signed(q.as_mut_ptr(), s.as_mut_ptr()),
        Some(MomentChunk::Unsigned(q, s, r)) => {
            MomentPtr::Unsigned(q.as_mut_ptr(), s.as_mut_ptr(), *r)
        }
    }
}

impl Ptrs {
    fn new(job: &mut Job<'_>) -> Ptrs {
        let n = job.p.len();
        let p = match &mut job.p {
            ParamChunk::F32(s) => ParamPtr::F32(s.as_mut_ptr()),
            ParamChunk::Half { h, bits, err } => ParamPtr::Half {
                h: *h,
                bits: bits.as_mut_ptr(),
                err: match err {
                    ErrChunk::None => ErrPtr::None,
                    ErrChunk::I8(e) => ErrPtr::I8(e.as_mut_ptr()),
                    ErrChunk::I16(e) => ErrPtr::I16(e.as_mut_ptr()),
                },
            },
        };
        let g = match &job.g {
            GradChunk::F32(s) => GradPtr::F32(s.as_ptr()),
            GradChunk::Half(h, s) => GradPtr::Half(*h, s.as_ptr()),
        };
        let (m, v) = (moment_ptr(&mut job.m), moment_ptr(&mut job.v));
        Ptrs {
            p,
            g,
            m,
            v,
            m_in: job.old[0].as_ref().map_or(m, view_ptr),
            v_in: job.old[1].as_ref().map_or(v, view_ptr),
            n,
        }
    }
}

/// Groups per block: one lane each in the vectors of group scales.
const BLOCK_GROUPS: usize = W;

/// Steps the block of `n` elements (at most `BLOCK_GROUPS` groups; `FULL`: exactly that
/// many, all full) from `lo`, in three passes:
/// 1. per group: decode, update, store the parameter (and unquantized states); quantized
///    states' new values wait in registers or L1 with their lane-wise maxima;
/// 2. all the block's group scales at once: one transpose of maxima, one fp16 conversion,
///    one division for the encode factors;
/// 3. per group: encode and store the quantized states.
///
/// So no group waits on its own maximum's reduction and reciprocal before the next
/// starts, and the per-group scalar work becomes a few vector operations per block.
///
/// # Safety
/// As `run_groups`.
#[inline(always)]
unsafe fn block<L: Lanes, U: Elementwise, const FULL: bool>(
    l: L,
    u: &U,
    x: &Ptrs,
    lo: usize,
    n: usize,
) {
    let ng = if FULL {
        BLOCK_GROUPS
    } else {
        n.div_ceil(GROUP)
    };
    let g0 = lo / GROUP;
    let zero = l.splat(0.0);
    let (qm, qv) = (
        U::M && codec::is_quantized(x.m),
        U::V && codec::is_quantized(x.v),
    );
    let mdec = if U::READ_M {
        codec::decode_factors(l, x.m_in, g0, ng)
    } else {
        [0.0; W]
    };
    let vdec = if U::V {
        codec::decode_factors(l, x.v_in, g0, ng)
    } else {
        [0.0; W]
    };
    // Written in pass 1 and read in pass 3 for groups `0..ng` only; left uninitialized
    // because zeroing them (4 KiB per block) cost a memset call per block.
    let mut mq = [MaybeUninit::<[L::F; 2]>::uninit(); BLOCK_GROUPS];
    let mut vq = [MaybeUninit::<[L::F; 2]>::uninit(); BLOCK_GROUPS];
    let (mut mmax, mut vmax) = ([zero; W], [zero; W]);
    let halves = |j: usize| {
        let len = if FULL {
            GROUP
        } else {
            (n - j * GROUP).min(GROUP)
        };
        [len.min(W), len.saturating_sub(W)]
    };
    for j in 0..ng {
        let at = lo + j * GROUP;
        let nn = halves(j);
        let mut m = if U::READ_M {
            codec::load_moment(l, x.m_in, at, nn, mdec[j])
        } else {
            [zero; 2]
        };
        let mut v = if U::V {
            codec::load_moment(l, x.v_in, at, nn, vdec[j])
        } else {
            [zero; 2]
        };
        for h in 0..2 {
            if nn[h] > 0 {
                let y = u.apply(
                    l,
                    Elem {
                        p: codec::load_param(l, x.p, at + h * W, nn[h]),
                        g: codec::load_grad(l, x.g, at + h * W, nn[h]),
                        m: m[h],
                        v: v[h],
                    },
                );
                (m[h], v[h]) = (y.m, y.v);
                codec::store_param(l, x.p, at + h * W, nn[h], y.p);
            }
        }
        if qm {
            let (q, a) = codec::prepare(l, x.m, nn, m);
            mq[j].write(q);
            mmax[j] = a;
        } else if U::M {
            codec::store_plain(l, x.m, at, nn, m);
        }
        if qv {
            let (q, a) = codec::prepare(l, x.v, nn, v);
            vq[j].write(q);
            vmax[j] = a;
        } else if U::V {
            codec::store_plain(l, x.v, at, nn, v);
        }
    }
    if qm {
        let k = codec::encode_scales(l, x.m, g0, ng, &mmax);
        for j in 0..ng {
            // SAFETY: pass 1 wrote group j (j < ng) when `qm`.
            let q = mq[j].assume_init();
            codec::store_codes(l, x.m, lo + j * GROUP, halves(j), q, k[j]);
        }
    }
    if qv {
        let k = codec::encode_scales(l, x.v, g0, ng, &vmax);
        for j in 0..ng {
            // SAFETY: pass 1 wrote group j (j < ng) when `qv`.
            let q = vq[j].assume_init();
            codec::store_codes(l, x.v, lo + j * GROUP, halves(j), q, k[j]);
        }
    }
}

/// Steps every group of the job with update `u`.
///
/// The storage layout is known only at run time, and the block's code tests it for
/// every half group: on the AVX-512 path the compressed step's own layouts (bf16 params
/// with 8- or 16-bit error bits and bf16 grads; quant8 momentum; quant8 or quant8_wide
/// variance) get a copy of the block with those tests resolved at compile time, which
/// measured 1.3x faster. Every other layout runs the general block.
///
/// # Safety
/// The pointers are valid for `x.n` elements (and their groups' scales); the states the
/// update uses are present.
#[inline(always)]
unsafe fn run_groups<L: Lanes, U: Elementwise>(l: L, u: &U, x: &Ptrs) {
    let unused = MomentPtr::F32(std::ptr::null_mut());
    let signed = |p: MomentPtr| match p {
        MomentPtr::Signed(q, s) if U::M => Some(MomentPtr::Signed(q, s)),
        _ if !U::M => Some(unused),
        _ => None,
    };
    let layout = match (x.p, x.g) {
        (
            ParamPtr::Half {
                h: Half::BF16,
                bits,
                err,
            },
            GradPtr::Half(Half::BF16, g),
        ) => Some((bits, err, g)),
        _ => None,
    };
    if let (true, Some(m), Some(m_in), Some((bits, err, g))) =
        (L::SPECIALIZE, signed(x.m), signed(x.m_in), layout)
    {
        // Each arm rebuilds the pointers from constants and the matched fields, so the
        // inlined block sees every layout test's answer.
        macro_rules! known {
            ($err:expr, $v:expr, $v_in:expr) => {
                return blocks(
                    l,
                    u,
                    &Ptrs {
                        p: ParamPtr::Half {
                            h: Half::BF16,
                            bits,
                            err: $err,
                        },
                        g: GradPtr::Half(Half::BF16, g),
                        m,
                        v: $v,
                        m_in,
                        v_in: $v_in,
                        n: x.n,
                    },
                )
            };
        }
        use MomentPtr::Unsigned as U8;
        match (err, x.v, x.v_in) {
            (ErrPtr::I8(e), _, _) if !U::V => known!(ErrPtr::I8(e), unused, unused),
            (ErrPtr::I16(e), _, _) if !U::V => known!(ErrPtr::I16(e), unused, unused),
            (ErrPtr::I8(e), U8(q, s, Root::Sqrt), U8(qi, si, Root::Sqrt)) => {
                known!(ErrPtr::I8(e), U8(q, s, Root::Sqrt), U8(qi, si, Root::Sqrt))
            }
            (ErrPtr::I16(e), U8(q, s, Root::Sqrt), U8(qi, si, Root::Sqrt)) => {
                known!(ErrPtr::I16(e), U8(q, s, Root::Sqrt), U8(qi, si, Root::Sqrt))
            }
            (ErrPtr::I8(e), U8(q, s, Root::Fourth), U8(qi, si, Root::Fourth)) => {
                known!(
                    ErrPtr::I8(e),
                    U8(q, s, Root::Fourth),
                    U8(qi, si, Root::Fourth)
                )
            }
            (ErrPtr::I16(e), U8(q, s, Root::Fourth), U8(qi, si, Root::Fourth)) => {
                known!(
                    ErrPtr::I16(e),
                    U8(q, s, Root::Fourth),
                    U8(qi, si, Root::Fourth)
                )
            }
            _ => {}
        }
    }
    blocks(l, u, x)
}

/// `run_groups` for one layout.
///
/// # Safety
/// As `run_groups`.
#[inline(always)]
unsafe fn blocks<L: Lanes, U: Elementwise>(l: L, u: &U, x: &Ptrs) {
    // Full blocks with their lengths known at compile time (unmasked loads and stores),
    // then the rest, whose last group may be short.
    let step = BLOCK_GROUPS * GROUP;
    let full = x.n - x.n % step;
    for lo in (0..full).step_by(step) {
        block::<L, U, true>(l, u, x, lo, step);
    }
    if full < x.n {
        block::<L, U, false>(l, u, x, full, x.n - full);
    }
}

/// Runs a `fast` job on backend `l`: the chunk's states must be present as its rule
/// needs them (the optimizer creates them by its group's config).
#[inline(always)]
pub fn run<L: Lanes>(l: L, mut job: Job<'_>, rule: &FastRule) {
    let x = Ptrs::new(&mut job);
    let (has_m, has_v) = (job.m.is_some(), job.v.is_some());
    rule.with(
        job.first,
        Groups {
            l,
            x: &x,
            has_m,
            has_v,
        },
    )
}

/// The fused kernel as a rule's runner: every group of one job.
struct Groups<'a, L> {
    l: L,
    x: &'a Ptrs,
    has_m: bool,
    has_v: bool,
}

impl<L: Lanes> Runner for Groups<'_, L> {
    type Out = ();
    #[inline(always)]
    fn run<E: Elementwise>(self, e: &E) {
        assert!(
            (self.has_m || !E::M) && (self.has_v || !E::V),
            "a fast step without the states its rule updates"
        );
        // SAFETY: the pointers come from the job's slices, all of length `n` (scales: one
        // per group), and the states the update reads and writes are present (above).
        unsafe { run_groups(self.l, e, self.x) }
    }
}
