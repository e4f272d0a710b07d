//! An async save's staging pool (`snapshot.rs`): its default budget, and the copies it
//! holds, made on the step's path: a parameter's state is copied before the step writes
//! it, so this memcpy is what a step with a save in flight pays. Into fresh memory it
//! costs a page fault per 4 KiB: on the 2-core test machine a 64 MiB copy took 26-70 ms
//! that way (1-2.5 GB/s), 3-8 ms into memory already faulted in (8-19 GB/s). So the pool
//! recycles: the buffers of copies the writer is done with are kept ([`Recycled`]) and
//! reused by later copies of the same shape, in this save and in the next save of the
//! same optimizer. The kept buffers count against the budget: copies alive plus buffers
//! kept never exceed it. (Advising fresh buffers as transparent huge pages was tried: 7 ms
//! per 64 MiB when the kernel has huge pages free, 250-700 ms when it must compact memory
//! first, as it did with the page cache full of the save's own writes; not kept.)
use std::any::Any;

use crate::optim::math::state::{ErrorBits, Moment, ParamState};

/// The staging pool's budget when the caller gives none (0) and the host does not say how
/// much memory is available: 256 MiB.
pub const FALLBACK_STAGING_BUDGET: usize = 256 << 20;

/// The staging pool's budget when the caller gives none (0): `full_copy`, every byte the
/// save could ever copy (what torch's `dcp.async_save` always stages), so no step waits for
/// the disk; but at most half the memory `available` at the call, where a step may then
/// wait for the writer instead (correctness never depends on the budget). Unknown
/// available memory: at most `FALLBACK_STAGING_BUDGET`.
pub fn default_staging_budget(full_copy: usize, available: Option<u64>) -> usize {
    let cap = available.map_or(FALLBACK_STAGING_BUDGET, |a| {
        usize::try_from(a / 2).unwrap_or(usize::MAX)
    });
    full_copy.min(cap)
}

/// Buffers of finished copies, kept for the next copies of the same shapes.
#[derive(Default)]
pub(in crate::ckpt) struct Recycled {
    /// `Vec<T>`s of some element type each, with their capacity in bytes.
    bufs: Vec<(Box<dyn Any + Send>, usize)>,
    bytes: usize,
}

impl Recycled {
    /// Bytes held.
    #[cfg(test)]
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Drops kept buffers (the oldest first) until at most `max` bytes are kept.
    pub(super) fn trim(&mut self, max: usize) {
        while self.bytes > max && !self.bufs.is_empty() {
            let (_, b) = self.bufs.remove(0);
            self.bytes -= b;
        }
    }

    /// Keeps the buffers `kit` still holds (a copy did not need them) while the kept
    /// bytes stay within `max`.
    pub(super) fn absorb(&mut self, kit: Recycled, max: usize) {
        for (v, b) in kit.bufs {
            if self.bytes + b <= max {
                self.bufs.push((v, b));
                self.bytes += b;
            }
        }
    }

    fn put<T: Send + 'static>(&mut self, mut v: Vec<T>, max: usize) {
        let b = v.capacity() * std::mem::size_of::<T>();
        if b == 0 || self.bytes + b > max {
            return;
        }
        v.clear();
        self.bufs.push((Box::new(v), b));
        self.bytes += b;
    }

    /// Keeps the buffers of `st` while the kept bytes stay within `max`.
    pub(super) fn put_state(&mut self, st: ParamState, max: usize) {
        for m in [st.m, st.v].into_iter().flatten() {
            match m {
                Moment::F32(v) => {
                    if let Some(v) = v.into_vec() {
                        self.put(v, max)
                    }
                }
                Moment::Half(_, v) => self.put(v, max),
                Moment::Signed { codes, scales } => {
                    self.put(codes, max);
                    self.put(scales, max)
                }
                Moment::Unsigned { codes, scales, .. } => {
                    self.put(codes, max);
                    self.put(scales, max)
                }
            }
        }
        match st.error_bits {
            Some(ErrorBits::I8(v)) => self.put(v, max),
            Some(ErrorBits::I16(v)) => self.put(v, max),
            None => {}
        }
    }

    /// Moves out the kept buffers a copy of `st` can reuse (same element type and
    /// length), into a kit for [`copy_state`].
    pub(super) fn kit_for(&mut self, st: &ParamState) -> Recycled {
        let mut kit = Recycled::default();
        let mut want = |t: std::any::TypeId, n: usize, size: usize| {
            let b = n * size;
            if let Some(k) = self
                .bufs
                .iter()
                .position(|(v, cap)| (**v).type_id() == t && *cap == b)
            {
                let (v, cap) = self.bufs.remove(k);
                self.bytes -= cap;
                kit.bufs.push((v, cap));
                kit.bytes += cap;
            }
        };
        fn id<T: 'static>(v: &[T]) -> (std::any::TypeId, usize, usize) {
            (
                std::any::TypeId::of::<Vec<T>>(),
                v.len(),
                std::mem::size_of::<T>(),
            )
        }
        let mut slices = Vec::new();
        for m in [&st.m, &st.v].into_iter().flatten() {
            match m {
                Moment::F32(v) => slices.push(id(v)),
                Moment::Half(_, v) => slices.push(id(v)),
                Moment::Signed { codes, scales } => slices.extend([id(codes), id(scales)]),
                Moment::Unsigned { codes, scales, .. } => slices.extend([id(codes), id(scales)]),
            }
        }
        match &st.error_bits {
            Some(ErrorBits::I8(v)) => slices.push(id(v)),
            Some(ErrorBits::I16(v)) => slices.push(id(v)),
            None => {}
        }
        for (t, n, size) in slices {
            want(t, n, size);
        }
        kit
    }

    /// A kept `Vec<T>` of capacity exactly `n`, if any.
    fn take<T: 'static>(&mut self, n: usize) -> Option<Vec<T>> {
        let b = n * std::mem::size_of::<T>();
        let k = self
            .bufs
            .iter()
            .position(|(v, cap)| *cap == b && v.is::<Vec<T>>())?;
        let (v, cap) = self.bufs.remove(k);
        self.bytes -= cap;
        v.downcast::<Vec<T>>().ok().map(|v| *v)
    }
}

/// A copy of `src`: into a kit buffer of its shape when there is one, else into a fresh
/// allocation of exactly its length (so that it can serve the same shape later).
pub(super) fn copy_slice<T: Copy + 'static>(src: &[T], kit: &mut Recycled) -> Vec<T> {
    let mut v = kit
        .take::<T>(src.len())
        .unwrap_or_else(|| Vec::with_capacity(src.len()));
    v.extend_from_slice(src);
    v
}

fn copy_moment(m: &Moment, kit: &mut Recycled) -> Moment {
    match m {
        Moment::F32(v) => Moment::F32(copy_slice(v, kit).into()),
        Moment::Half(h, v) => Moment::Half(*h, copy_slice(v, kit)),
        Moment::Signed { codes, scales } => Moment::Signed {
            codes: copy_slice(codes, kit),
            scales: copy_slice(scales, kit),
        },
        Moment::Unsigned {
            codes,
            scales,
            root,
        } => Moment::Unsigned {
            codes: copy_slice(codes, kit),
            scales: copy_slice(scales, kit),
            root: *root,
        },
    }
}

/// A copy of `st`, equal to `st.clone()`, in `kit`'s buffers where they fit.
pub(super) fn copy_state(st: &ParamState, kit: &mut Recycled) -> ParamState {
    ParamState {
        step: st.step,
        m: st.m.as_ref().map(|m| copy_moment(m, kit)),
        v: st.v.as_ref().map(|m| copy_moment(m, kit)),
        error_bits: st.error_bits.as_ref().map(|e| match e {
            ErrorBits::I8(v) => ErrorBits::I8(copy_slice(v, kit)),
            ErrorBits::I16(v) => ErrorBits::I16(copy_slice(v, kit)),
        }),
        m_valid: st.m_valid,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::math::master_split::Half;
    use crate::optim::math::state::Root;
    use half::f16;

    #[test]
    fn copies_equal_clones_small_and_large() {
        for n in [0usize, 33, (5 << 20) + 7] {
            let f: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
            let st = ParamState {
                step: 7,
                m: Some(Moment::Signed {
                    codes: (0..n).map(|i| i as i8).collect(),
                    scales: (0..n / 32).map(|i| f16::from_f32(i as f32)).collect(),
                }),
                v: Some(Moment::Unsigned {
                    codes: (0..n).map(|i| (i * 3) as u8).collect(),
                    scales: vec![f16::ONE; n / 32],
                    root: Root::Sqrt,
                }),
                error_bits: Some(ErrorBits::I16((0..n).map(|i| i as i16).collect())),
                m_valid: true,
            };
            let mut pool = Recycled::default();
            let a = copy_state(&st, &mut Recycled::default());
            assert_eq!(a, st);
            // Its buffers kept, then reused by the next copy of the same shapes.
            pool.put_state(a, usize::MAX);
            let kept = pool.bytes();
            assert_eq!(kept > 0, n > 0);
            let mut kit = pool.kit_for(&st);
            assert_eq!((kit.bytes(), pool.bytes()), (kept, 0));
            assert_eq!(copy_state(&st, &mut kit), st);
            assert_eq!(kit.bytes(), 0, "every kept buffer was reused");
            // Kept bytes stay within the bound given.
            pool.put_state(st.clone(), kept / 2);
            assert!(pool.bytes() <= kept / 2);
            pool.trim(0);
            assert_eq!(pool.bytes(), 0);
            let h = ParamState {
                step: 1,
                m: Some(Moment::F32(f.clone().into())),
                v: Some(Moment::Half(Half::BF16, (0..n).map(|i| i as u16).collect())),
                error_bits: Some(ErrorBits::I8(vec![3; n])),
                m_valid: false,
            };
            assert_eq!(copy_state(&h, &mut Recycled::default()), h);
        }
    }
}

#[cfg(test)]
mod budget_tests {
    use super::{default_staging_budget, FALLBACK_STAGING_BUDGET};

    #[test]
    fn the_default_is_every_copy_within_half_the_available_memory() {
        assert_eq!(default_staging_budget(512 << 20, Some(24 << 30)), 512 << 20);
        assert_eq!(
            default_staging_budget(512 << 20, Some(600 << 20)),
            300 << 20
        );
        assert_eq!(
            default_staging_budget(1 << 30, None),
            FALLBACK_STAGING_BUDGET
        );
        assert_eq!(default_staging_budget(4096, None), 4096);
        assert_eq!(default_staging_budget(0, Some(1 << 30)), 0);
    }
}
