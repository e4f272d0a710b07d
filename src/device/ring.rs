//! A device's pinned staging ring: every asynchronous copy between host and device memory
//! that fo starts without waiting for it goes through a few page-locked slots, each reused
//! only after the event recorded behind its last copy has completed.
//!
//! Why: a copy from pageable memory (a `Vec` dropped when the call returns) may still be
//! pending when the `Vec` is gone, and a pinned buffer sized to a tensor makes fo's memory
//! grow with the largest tensor. The ring is `SLOTS` slots of at most `SLOT_BYTES`, so fo's
//! pinned memory per device is at most `RING_BYTES`; larger payloads move in slot-sized
//! pieces (at most `SLOTS` in flight).
//!
//! Small uploads (a step table: 96 bytes a row) take one of `SMALL_SLOTS` small slots
//! instead, cut from one pinned block (`SMALL_BYTES`). An overlapped step uploads a table
//! per hand-over, on a step lane that waits for the gradient's producer: with only the
//! `SLOTS` slots the fifth hand-over waited on the host for the first one's copy, so for
//! backward's progress on the GPU, and the thread driving backward could no longer queue
//! its kernels ahead (an H200 ran such a loop at 0.35x torch's fused AdamW). A small slot
//! is reused `SMALL_SLOTS` uploads later, when its copy has long run.
use std::sync::Mutex;

use crate::error::Result;

/// Slots in a ring: the pieces that can be in flight at once.
pub const SLOTS: usize = 4;
/// The largest slot (one piece of a larger payload). Small in unit tests, so that a test
/// payload of a few hundred KiB spans many pieces.
#[cfg(not(test))]
pub const SLOT_BYTES: usize = 4 << 20;
#[cfg(test)]
pub const SLOT_BYTES: usize = 16 << 10;
/// The smallest slot allocated (a launch table fits many times).
const MIN_SLOT: usize = 4 << 10;
/// The pinned memory of one device's ring in slots (the small slots aside).
pub const RING_BYTES: usize = SLOTS * SLOT_BYTES;
/// Small slots: uploads queued at once before one waits for the device.
pub const SMALL_SLOTS: usize = 256;
/// The largest payload a small slot takes (ten table rows).
pub const SMALL_SLOT_BYTES: usize = 1 << 10;
/// The pinned block of the small slots (allocated at the first small upload).
pub const SMALL_BYTES: usize = SMALL_SLOTS * SMALL_SLOT_BYTES;

/// What the ring needs of a device (a part of `Backend`): pinned host memory, copies
/// between it and device memory that return at once, and events to know when they are done.
pub trait PinnedCopy: Send + Sync {
    /// `bytes` (at least 1) of page-locked host memory, for copies that overlap work.
    ///
    /// # Safety
    /// None beyond the backend's own; the memory is freed with `free_pinned`.
    unsafe fn alloc_pinned(&self, bytes: usize) -> Result<u64>;

    /// Frees memory from `alloc_pinned` (no copy into or out of it may be in flight).
    ///
    /// # Safety
    /// `ptr` came from `alloc_pinned` of this backend and is not used afterwards.
    unsafe fn free_pinned(&self, ptr: u64);

    /// Copies `bytes` from pinned host memory `src` (from `alloc_pinned`) to device memory
    /// `dst`, in order on `stream`; returns at once. `src` must stay allocated and
    /// unchanged until an event recorded after the copy has completed (`Ring` does this).
    ///
    /// # Safety
    /// `dst` must be `bytes` writable bytes of this device; `stream` valid or 0.
    unsafe fn copy_to_device(&self, dst: u64, src: u64, bytes: usize, stream: usize) -> Result<()>;

    /// Copies `bytes` from device memory `src` to pinned host memory `dst`, in order on
    /// `stream`; returns at once (the data is there once an event recorded after it
    /// completed).
    ///
    /// # Safety
    /// As `copy_to_device`, the other way.
    unsafe fn copy_to_host(&self, dst: u64, src: u64, bytes: usize, stream: usize) -> Result<()>;

    /// Records an event on `stream` (after the work queued there so far): a handle for
    /// `wait_event`.
    ///
    /// # Safety
    /// `stream` valid or 0.
    unsafe fn record_event(&self, stream: usize) -> Result<u64>;

    /// Waits (on the host) until `event` has completed, and releases it.
    ///
    /// # Safety
    /// `event` came from `record_event` of this backend and is waited for once.
    unsafe fn wait_event(&self, event: u64) -> Result<()>;
}

#[derive(Default)]
struct Slot {
    ptr: u64,
    cap: usize,
    /// The event recorded after the slot's last copy, not yet waited for.
    event: Option<u64>,
}

/// The ring of one device (kept by its backend for the process).
#[derive(Default)]
pub struct Ring {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    slots: [Slot; SLOTS],
    next: usize,
    small: Small,
}

/// The small slots: one pinned block, slot `k` at `k * SMALL_SLOT_BYTES`, taken in turn.
#[derive(Default)]
struct Small {
    ptr: u64,
    /// The event recorded after each slot's last copy, not yet waited for.
    events: Vec<Option<u64>>,
    next: usize,
}

impl Small {
    /// The address of the next small slot, idle (its last copy done).
    unsafe fn take(&mut self, b: &dyn PinnedCopy) -> Result<(usize, u64)> {
        if self.ptr == 0 {
            self.ptr = b.alloc_pinned(SMALL_BYTES)?;
            self.events = vec![None; SMALL_SLOTS];
        }
        let k = self.next;
        self.next = (k + 1) % SMALL_SLOTS;
        if let Some(ev) = self.events[k].take() {
            b.wait_event(ev)?;
        }
        Ok((k, self.ptr + (k * SMALL_SLOT_BYTES) as u64))
    }
}

impl State {
    /// The next slot, idle (its last copy done) and at least `bytes` large.
    unsafe fn take(&mut self, b: &dyn PinnedCopy, bytes: usize) -> Result<usize> {
        let k = self.next;
        self.next = (k + 1) % SLOTS;
        let s = &mut self.slots[k];
        if let Some(ev) = s.event.take() {
            b.wait_event(ev)?;
        }
        if s.cap < bytes {
            if s.cap > 0 {
                b.free_pinned(s.ptr);
                (s.ptr, s.cap) = (0, 0);
            }
            let want = bytes.next_power_of_two().clamp(MIN_SLOT, SLOT_BYTES);
            s.ptr = b.alloc_pinned(want)?;
            s.cap = want;
        }
        Ok(k)
    }
}

impl Ring {
    /// Copies `src` to device memory `dst` of `b` in order on `stream`, through the ring;
    /// returns once every piece is in a slot (`src` may be dropped), without waiting for
    /// the device.
    ///
    /// # Safety
    /// `dst` must be `src.len()` writable bytes of `b`'s device; `stream` valid or 0.
    pub unsafe fn upload(
        &self,
        b: &dyn PinnedCopy,
        dst: u64,
        src: &[u8],
        stream: usize,
    ) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if !src.is_empty() && src.len() <= SMALL_SLOT_BYTES {
            let (k, at) = st.small.take(b)?;
            std::ptr::copy_nonoverlapping(src.as_ptr(), at as *mut u8, src.len());
            b.copy_to_device(dst, at, src.len(), stream)?;
            st.small.events[k] = Some(b.record_event(stream)?);
            return Ok(());
        }
        for (n, piece) in src.chunks(SLOT_BYTES).enumerate() {
            let k = st.take(b, piece.len())?;
            let s = &mut st.slots[k];
            std::ptr::copy_nonoverlapping(piece.as_ptr(), s.ptr as *mut u8, piece.len());
            let at = dst + (n * SLOT_BYTES) as u64;
            b.copy_to_device(at, s.ptr, piece.len(), stream)?;
            s.event = Some(b.record_event(stream)?);
        }
        Ok(())
    }

    /// Copies `dst.len()` bytes of device memory `src` of `b` into `dst`, after the work
    /// queued on `stream`, through the ring (up to `SLOTS` pieces in flight); waits for them.
    ///
    /// # Safety
    /// `src` must be `dst.len()` readable bytes of `b`'s device; `stream` valid or 0.
    pub unsafe fn download(
        &self,
        b: &dyn PinnedCopy,
        src: u64,
        dst: &mut [u8],
        stream: usize,
    ) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        // Pieces in flight: (slot, piece index), oldest first.
        let mut flight: std::collections::VecDeque<(usize, usize)> = Default::default();
        let drain = |st: &mut State, (k, n): (usize, usize), dst: &mut [u8]| -> Result<()> {
            let s = &mut st.slots[k];
            b.wait_event(s.event.take().expect("a piece in flight has an event"))?;
            let len = SLOT_BYTES.min(dst.len() - n * SLOT_BYTES);
            let piece = &mut dst[n * SLOT_BYTES..][..len];
            std::ptr::copy_nonoverlapping(s.ptr as *const u8, piece.as_mut_ptr(), piece.len());
            Ok(())
        };
        let pieces = dst.len().div_ceil(SLOT_BYTES);
        let mut out = Ok(());
        for n in 0..pieces {
            if flight.len() == SLOTS {
                let f = flight.pop_front().expect("full");
                out = drain(&mut st, f, dst);
                if out.is_err() {
                    break;
                }
            }
            let len = SLOT_BYTES.min(dst.len() - n * SLOT_BYTES);
            let r = st.take(b, len).and_then(|k| {
                let s = &mut st.slots[k];
                b.copy_to_host(s.ptr, src + (n * SLOT_BYTES) as u64, len, stream)?;
                s.event = Some(b.record_event(stream)?);
                Ok(k)
            });
            match r {
                Ok(k) => flight.push_back((k, n)),
                Err(e) => {
                    out = Err(e);
                    break;
                }
            }
        }
        // Every piece started is waited for, even after a failure: its slot is reused later.
        for f in flight {
            let r = drain(&mut st, f, dst);
            out = out.and(r);
        }
        out
    }

    /// Pinned bytes the ring holds now (its small slots' block included).
    pub fn held_bytes(&self) -> usize {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let small = if st.small.ptr != 0 { SMALL_BYTES } else { 0 };
        st.slots.iter().map(|s| s.cap).sum::<usize>() + small
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::backend::Backend;
    use crate::device::emulated;

    #[test]
    fn payloads_larger_than_the_ring_move_in_pieces_and_pinned_memory_stays_bounded() {
        if emulated::skip() {
            return;
        }
        let dev = emulated::device_at(emulated::EMULATED + 1).unwrap();
        let b: &dyn Backend = &*dev;
        let stream = emulated::create_stream(emulated::EMULATED + 1);
        let n = 9 * RING_BYTES + 123; // beyond the bound below, were it held whole
        let src: Vec<u8> = (0..n).map(|i| (i * 7 + i / 251) as u8).collect();
        unsafe {
            let d = b.alloc_async(n, stream).unwrap();
            dev.stall(stream, 10);
            b.ring().upload(b, d, &src, stream).unwrap();
            let mut back = vec![0u8; n];
            b.ring().download(b, d, &mut back, stream).unwrap();
            assert!(back == src, "the bytes came back");
            b.free_async(d, stream);
        }
        emulated::synchronize_all();
        // Only rings allocate pinned memory: no test ever holds more than one ring's worth,
        // its slots and its small slots (another test's step tables on this device take
        // those, and may have run first).
        assert!(b.ring().held_bytes() <= RING_BYTES + SMALL_BYTES);
        assert!(
            dev.usage().pinned_peak <= RING_BYTES + SMALL_BYTES,
            "{:?}",
            dev.usage()
        );
    }

    /// Small uploads queue copies behind a stalled stream without a host wait until a
    /// slot comes round again, whose copy is still stalled: that upload waits for it.
    /// (Other tests' step tables take small slots of this device too, so: the first 200
    /// do not wait, and by the `SMALL_SLOTS + 1`-th one has.)
    #[test]
    fn small_uploads_wait_for_the_device_only_when_every_small_slot_is_in_flight() {
        if emulated::skip() {
            return;
        }
        // Not CHECKER: its tests take the violations they provoke, and this one checks
        // there are none.
        let dev = emulated::device_at(emulated::EMULATED + 1).unwrap();
        let b: &dyn Backend = &*dev;
        let stream = emulated::create_stream(emulated::EMULATED + 1);
        let payload = |k: usize| -> Vec<u8> {
            let n = 1 + (k * 37) % SMALL_SLOT_BYTES;
            (0..n).map(|i| (k * 13 + i) as u8).collect()
        };
        let n = SMALL_SLOTS + 1;
        unsafe {
            let d: Vec<u64> = (0..n)
                .map(|_| b.alloc_async(SMALL_SLOT_BYTES, stream).unwrap())
                .collect();
            dev.stall(stream, 400);
            let waits = emulated::blocking_waits_on_this_thread();
            for (k, &at) in d.iter().enumerate() {
                b.ring().upload(b, at, &payload(k), stream).unwrap();
                if k + 1 == 200 {
                    assert_eq!(emulated::blocking_waits_on_this_thread(), waits);
                }
            }
            assert!(emulated::blocking_waits_on_this_thread() > waits);
            for (k, &at) in d.iter().enumerate() {
                let mut back = vec![0u8; payload(k).len()];
                b.ring().download(b, at, &mut back, stream).unwrap();
                assert!(back == payload(k), "upload {k}");
                b.free_async(at, stream);
            }
        }
        dev.synchronize();
        assert!(dev.take_violations().is_empty());
    }

    #[test]
    fn the_emulated_device_reports_an_async_copy_from_pageable_memory() {
        if emulated::skip() {
            return;
        }
        let dev = emulated::device_at(emulated::CHECKER).unwrap();
        let stream = emulated::create_stream(emulated::CHECKER);
        let src = [1u8; 64];
        unsafe {
            let d = dev.alloc_async(64, stream).unwrap();
            dev.copy_to_device(d, src.as_ptr() as u64, 64, stream)
                .unwrap();
            dev.free_async(d, stream);
        }
        dev.synchronize();
        let v = dev.take_violations();
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(
            v[0].contains("not pinned memory of this device"),
            "{}",
            v[0]
        );
    }
}
