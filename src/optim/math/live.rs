//! The buffer of an f32 moment, which fo can lend out as live memory
//! (`fo_optimizer_share_state`): torch's `state_dict()` hands out references to its live
//! state tensors, and a DCP async save stages them with one copy; fo.torch does the same
//! with fo's fp32 state instead of decoding it into fresh tensors first (a second copy of
//! every byte, issue 38).
//!
//! A lent buffer must outlive every borrower and keep its address, whatever the optimizer
//! does meanwhile. So the buffer is reference counted, lenders hold a [`Share`] (a count,
//! never a Rust reference), and whatever replaces a moment's values wholesale (a load, an
//! overlapped step's rollback, a numerics undo) goes through [`F32Buf::adopt`], which
//! copies into a lent buffer instead of swapping buffers, so borrowers keep seeing the
//! state. A moment dropped or re-laid out leaves its lent buffer alive but detached.
use std::cell::UnsafeCell;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

struct Store(UnsafeCell<Vec<f32>>);

// SAFETY: Rust reaches the values only through the one `F32Buf` that owns the store (its
// `Clone` copies the values into a new store), under the optimizer's own exclusion; a
// `Share` gives out a raw pointer and never a reference. What a borrower does through
// that pointer is its own business, as with any caller memory fo is handed.
unsafe impl Send for Store {}
unsafe impl Sync for Store {}

/// An f32 moment's values: a fixed-length slice at a stable address.
pub struct F32Buf(Arc<Store>);

/// A borrower's hold on an [`F32Buf`]'s memory: keeps it allocated, at the same address,
/// after the optimizer has dropped or replaced the moment.
pub struct Share(Arc<Store>);

impl F32Buf {
    pub fn zeros(n: usize) -> F32Buf {
        F32Buf::from(vec![0.0; n])
    }

    /// Whether a [`Share`] of this buffer is alive (its memory must keep its address).
    pub fn is_shared(&self) -> bool {
        Arc::strong_count(&self.0) > 1
    }

    pub fn share(&self) -> Share {
        Share(self.0.clone())
    }

    /// The values as an owned vector, unless a borrower holds the buffer (then `None`:
    /// recycling would hand its memory to someone else).
    pub fn into_vec(self) -> Option<Vec<f32>> {
        Arc::try_unwrap(self.0).ok().map(|s| s.0.into_inner())
    }

    /// Makes `new`'s values this buffer's: a swap of buffers when nobody borrows this
    /// one, else a copy into it, so a borrower keeps seeing the state. Afterwards `new`
    /// holds the values this buffer had when swapped, and unspecified ones when copied
    /// (callers only recycle it).
    pub fn adopt(&mut self, new: &mut F32Buf) {
        if self.is_shared() && self.len() == new.len() {
            self.copy_from_slice(new);
        } else {
            std::mem::swap(self, new);
        }
    }
}

impl Share {
    pub fn as_ptr(&self) -> *mut f32 {
        // SAFETY: only the pointer is taken; the vector is never resized (an `F32Buf`
        // gives out slices, not the vector), so it stays valid while `self` lives.
        unsafe { (*self.0 .0.get()).as_mut_ptr() }
    }

    pub fn len(&self) -> usize {
        // SAFETY: as in `as_ptr`; the length never changes.
        unsafe { (*self.0 .0.get()).len() }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Deref for F32Buf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: this `F32Buf` is the store's only Rust owner (see `Store`).
        unsafe { &*self.0 .0.get() }
    }
}

impl DerefMut for F32Buf {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, and `&mut self` excludes every other Rust access.
        unsafe { &mut *self.0 .0.get() }
    }
}

impl From<Vec<f32>> for F32Buf {
    fn from(v: Vec<f32>) -> F32Buf {
        F32Buf(Arc::new(Store(UnsafeCell::new(v))))
    }
}

impl FromIterator<f32> for F32Buf {
    fn from_iter<I: IntoIterator<Item = f32>>(it: I) -> F32Buf {
        F32Buf::from(it.into_iter().collect::<Vec<f32>>())
    }
}

/// A copy of the values in a buffer of its own (never a second owner of the same store).
impl Clone for F32Buf {
    fn clone(&self) -> F32Buf {
        F32Buf::from(self.to_vec())
    }

    /// Keeps this buffer when the lengths match (no allocation; a lent buffer stays live).
    fn clone_from(&mut self, src: &F32Buf) {
        if self.len() == src.len() {
            self.copy_from_slice(src);
        } else {
            *self = src.clone();
        }
    }
}

impl PartialEq for F32Buf {
    fn eq(&self, other: &F32Buf) -> bool {
        **self == **other
    }
}

impl fmt::Debug for F32Buf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_outlives_the_buffer_at_the_same_address() {
        let b = F32Buf::from(vec![1.0, 2.0, 3.0]);
        let s = b.share();
        assert!(b.is_shared());
        assert_eq!(s.as_ptr() as *const f32, b.as_ptr());
        drop(b);
        // SAFETY: the share keeps the store alive.
        let v = unsafe { std::slice::from_raw_parts(s.as_ptr(), s.len()) };
        assert_eq!(v, &[1.0, 2.0, 3.0]);
    }

    #[test]
    fn adopt_swaps_unless_lent_then_copies_in_place() {
        let (mut a, mut b) = (F32Buf::from(vec![1.0; 4]), F32Buf::from(vec![2.0; 4]));
        let pb = b.as_ptr();
        a.adopt(&mut b);
        assert_eq!(
            (a.as_ptr(), &a[..]),
            (pb, &[2.0; 4][..]),
            "unlent: the buffers swap"
        );
        let s = a.share();
        let mut c = F32Buf::from(vec![5.0; 4]);
        a.adopt(&mut c);
        assert_eq!(
            a.as_ptr(),
            s.as_ptr() as *const f32,
            "lent: the address stays"
        );
        // SAFETY: the share keeps the store alive.
        assert_eq!(
            unsafe { *s.as_ptr().add(3) },
            5.0,
            "the borrower sees the new values"
        );
        // A lent buffer of another length cannot take the values in place: it is
        // detached (still alive for its borrower) and the moment moves on.
        let mut d = F32Buf::from(vec![7.0; 2]);
        a.adopt(&mut d);
        assert_eq!(&a[..], &[7.0, 7.0]);
        assert_eq!(s.len(), 4);
    }

    #[test]
    fn clones_are_copies_and_a_lent_buffer_does_not_recycle() {
        let a = F32Buf::from(vec![1.0, 2.0]);
        let mut c = a.clone();
        assert!(!a.is_shared() && c.as_ptr() != a.as_ptr() && c == a);
        let s = c.share();
        c.clone_from(&F32Buf::from(vec![3.0, 4.0]));
        assert_eq!(c.as_ptr(), s.as_ptr() as *const f32);
        assert!(
            c.into_vec().is_none(),
            "a lent buffer is never handed to a recycler"
        );
        assert_eq!(a.into_vec(), Some(vec![1.0, 2.0]));
    }
}
