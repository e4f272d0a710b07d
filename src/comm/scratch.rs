//! A device buffer a communicator keeps across collectives, grown when a larger one is
//! needed, so staging a host buffer through it allocates and frees no device memory per
//! call. Kept behind a small allocator trait so the policy is tested without a device.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use crate::error::Result;

/// Where the buffer comes from (CUDA device memory for NCCL).
pub(crate) trait DeviceAlloc {
    /// # Safety
    /// As the allocator requires (a current context for CUDA).
    unsafe fn alloc(&self, bytes: usize) -> Result<u64>;
    /// # Safety
    /// `ptr` came from `alloc` and no work still uses it.
    unsafe fn free(&self, ptr: u64);
}

/// The smallest buffer kept: the clip's and barrier's few f64 values fit many times.
pub(crate) const MIN_BYTES: usize = 4096;

pub(crate) struct Scratch<A: DeviceAlloc> {
    alloc: A,
    ptr: u64,
    cap: usize,
}

impl<A: DeviceAlloc> Scratch<A> {
    pub(crate) fn new(alloc: A) -> Scratch<A> {
        Scratch {
            alloc,
            ptr: 0,
            cap: 0,
        }
    }

    pub(crate) fn allocator(&self) -> &A {
        &self.alloc
    }

    /// A buffer of at least `bytes` (and never none, even for 0): the kept one when it is large enough, else a new one
    /// of the next power of two (the old one is freed first, so a large collective does
    /// not hold two buffers).
    ///
    /// # Safety
    /// No work may still use the kept buffer when it has to grow (collectives synchronize
    /// their stream before returning).
    pub(crate) unsafe fn get(&mut self, bytes: usize) -> Result<u64> {
        if self.cap > 0 && bytes <= self.cap {
            return Ok(self.ptr);
        }
        self.release();
        let want = bytes.max(MIN_BYTES).next_power_of_two();
        self.ptr = self.alloc.alloc(want)?;
        self.cap = want;
        Ok(self.ptr)
    }

    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.cap
    }

    fn release(&mut self) {
        if self.cap > 0 {
            // SAFETY: allocated by `get`; its users have synchronized (get's contract).
            unsafe { self.alloc.free(self.ptr) };
            (self.ptr, self.cap) = (0, 0);
        }
    }
}

impl<A: DeviceAlloc> Drop for Scratch<A> {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use std::cell::RefCell;

    /// Records every allocation and free; fails allocations above `limit`.
    #[derive(Default)]
    struct Log {
        calls: RefCell<Vec<String>>,
        limit: usize,
    }

    impl DeviceAlloc for &Log {
        unsafe fn alloc(&self, bytes: usize) -> Result<u64> {
            if bytes > self.limit {
                return Err(Error::Comm(format!("out of memory for {bytes}")));
            }
            self.calls.borrow_mut().push(format!("alloc {bytes}"));
            Ok(bytes as u64 * 16)
        }
        unsafe fn free(&self, ptr: u64) {
            self.calls.borrow_mut().push(format!("free {}", ptr / 16));
        }
    }

    #[test]
    fn grows_by_powers_of_two_and_frees_once() {
        let log = Log {
            limit: 1 << 20,
            ..Log::default()
        };
        {
            let mut s = Scratch::new(&log);
            for n in [0, 24, 4096, 100] {
                assert_eq!(unsafe { s.get(n) }.unwrap(), 4096 * 16, "{n}");
            }
            assert_eq!(unsafe { s.get(5000) }.unwrap(), 8192 * 16);
            assert_eq!(unsafe { s.get(8) }.unwrap(), 8192 * 16);
            assert_eq!(s.capacity(), 8192);
            // A failed growth leaves no buffer behind and the next call tries again.
            let e = unsafe { s.get(1 << 21) }.unwrap_err().to_string();
            assert!(e.contains("out of memory"), "{e}");
            assert_eq!(s.capacity(), 0);
            assert_eq!(unsafe { s.get(8) }.unwrap(), 4096 * 16);
        }
        assert_eq!(
            *log.calls.borrow(),
            [
                "alloc 4096",
                "free 4096",
                "alloc 8192",
                "free 8192",
                "alloc 4096",
                "free 4096"
            ]
        );
    }
}
