//! The undo record of an overlapped step's parameter (`Saved`): what its memory and state
//! were before the early step, filled at each step into the buffers the last one left
//! (`swap_moments`: moments change places with the record's instead of being copied;
//! `fill_par`: the bytes copied in pieces across the pool) and copied back by a rollback
//! (`copy_par`).
use rayon::prelude::*;

use crate::optim::math::state::{ErrorBits, Moment, ParamState};

/// What a parameter's memory and state were before its speculative step.
pub(in crate::optim) struct Saved {
    pub bytes: Vec<u8>,
    /// None when the step created the state.
    pub state: Option<ParamState>,
}

impl Saved {
    /// The record's size: the parameter's bytes and its state's.
    pub fn nbytes(&self) -> usize {
        self.bytes.len() + self.state.as_ref().map_or(0, ParamState::nbytes)
    }
}

/// The undo record's state. Moments change places with the record's buffers (no copy:
/// the record keeps the values before the step, which the step reads from there through
/// `Job::old` and writes into the live buffer, so each moment is written once and never
/// copied); an f32 moment lent out keeps its address, so its values are copied. The rest
/// (error bits) is copied into the record. Returns which moments changed places.
pub(super) fn swap_moments(rec: &mut Option<ParamState>, live: &mut ParamState) -> [bool; 2] {
    clone_state_into(rec, live, true);
    let rec = rec.as_mut().expect("just filled");
    let mut swapped = [false, false];
    for (k, (l, r)) in [(&mut live.m, &mut rec.m), (&mut live.v, &mut rec.v)]
        .into_iter()
        .enumerate()
    {
        // `clone_state_into` left `r` of `l`'s kind and size.
        swapped[k] = match (l.as_mut(), r.as_mut()) {
            (Some(Moment::F32(lb)), Some(Moment::F32(rb))) if lb.is_shared() => {
                rb.clone_from(lb);
                false
            }
            (Some(lm), Some(rm)) => {
                std::mem::swap(lm, rm);
                true
            }
            _ => false,
        };
    }
    swapped
}

/// `*dst = Some(src.clone())`, reusing the buffers `dst` already holds where their kinds
/// match (`Vec::clone_from` keeps its allocation). `skip_moments`: a moment of the right
/// kind and size keeps its buffer without the values (`swap_moments` swaps them in); one
/// of another kind or size is cloned.
fn clone_state_into(dst: &mut Option<ParamState>, src: &ParamState, skip_moments: bool) {
    let Some(d) = dst else {
        *dst = Some(src.clone());
        return;
    };
    d.step = src.step;
    d.m_valid = src.m_valid;
    clone_moment_into(&mut d.m, &src.m, skip_moments);
    clone_moment_into(&mut d.v, &src.v, skip_moments);
    match (&mut d.error_bits, &src.error_bits) {
        (Some(ErrorBits::I8(a)), Some(ErrorBits::I8(b))) => a.clone_from(b),
        (Some(ErrorBits::I16(a)), Some(ErrorBits::I16(b))) => a.clone_from(b),
        (a, b) => *a = b.clone(),
    }
}

fn clone_moment_into(dst: &mut Option<Moment>, src: &Option<Moment>, skip: bool) {
    if skip && same_layout(dst, src) {
        return;
    }
    match (dst, src) {
        (Some(Moment::F32(a)), Some(Moment::F32(b))) => a.clone_from(b),
        (Some(Moment::Half(ha, a)), Some(Moment::Half(hb, b))) => {
            *ha = *hb;
            a.clone_from(b)
        }
        (
            Some(Moment::Signed { codes, scales }),
            Some(Moment::Signed {
                codes: c,
                scales: s,
            }),
        ) => {
            codes.clone_from(c);
            scales.clone_from(s)
        }
        (
            Some(Moment::Unsigned {
                codes,
                scales,
                root,
            }),
            Some(Moment::Unsigned {
                codes: c,
                scales: s,
                root: r,
            }),
        ) => {
            codes.clone_from(c);
            scales.clone_from(s);
            *root = *r
        }
        (a, b) => *a = b.clone(),
    }
}

/// Whether `a` and `b` are moments of one kind and size (their values aside).
fn same_layout(a: &Option<Moment>, b: &Option<Moment>) -> bool {
    match (a, b) {
        (Some(Moment::F32(x)), Some(Moment::F32(y))) => x.len() == y.len(),
        (Some(Moment::Half(hx, x)), Some(Moment::Half(hy, y))) => hx == hy && x.len() == y.len(),
        (Some(Moment::Signed { codes: x, .. }), Some(Moment::Signed { codes: y, .. })) => {
            x.len() == y.len()
        }
        (
            Some(Moment::Unsigned {
                codes: x, root: rx, ..
            }),
            Some(Moment::Unsigned {
                codes: y, root: ry, ..
            }),
        ) => rx == ry && x.len() == y.len(),
        _ => false,
    }
}

/// Copies `src` into `dst` (whose capacity holds it), in pieces across the pool when it
/// is large: a bucket of one large parameter (FSDP2 hands over a layer at a time) would
/// otherwise copy its record on one thread while the pool's others wait for its chunk
/// jobs.
pub(super) fn fill_par(dst: &mut Vec<u8>, src: &[u8]) {
    dst.clear();
    if src.len() <= PIECE {
        dst.extend_from_slice(src);
        return;
    }
    dst.spare_capacity_mut()[..src.len()]
        .par_chunks_mut(PIECE)
        .zip(src.par_chunks(PIECE))
        .for_each(|(d, s)| {
            // SAFETY: one length; `MaybeUninit<u8>` is laid out as `u8`.
            unsafe { std::ptr::copy_nonoverlapping(s.as_ptr(), d.as_mut_ptr().cast(), s.len()) }
        });
    // SAFETY: the first `src.len()` bytes were all written above.
    unsafe { dst.set_len(src.len()) };
}

/// The pieces `fill_par` and `copy_par` split a large copy into.
const PIECE: usize = 1 << 20;

/// `dst.copy_from_slice(src)`, in 1 MiB pieces across the current pool when larger.
pub(super) fn copy_par(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "a copy between buffers of two sizes");
    if src.len() <= PIECE {
        dst.copy_from_slice(src);
        return;
    }
    dst.par_chunks_mut(PIECE)
        .zip(src.par_chunks(PIECE))
        .for_each(|(d, s)| d.copy_from_slice(s));
}
