//! A device's copy lanes, for the offload pipeline: one stream per direction with a few
//! pinned slots each, made on first use and reused by every later step; and a third
//! stream, without slots, for the overlapped step's early device steps (`Dir::Step`).
//!
//! Why two streams: a GPU runs a host-to-device and a device-to-host copy at once (two copy
//! engines) only when they are on different streams; on one stream the gradients coming
//! down and the updated parameters going up take turns. Why slots kept for the process:
//! allocating pinned memory costs more than the copies it serves (`cuMemHostAlloc` maps
//! and locks pages), so a step that allocated would be slower than the bus; and the slots
//! bound fo's pinned memory at `LANES_BYTES` per device whatever the model.
//!
//! A slot is reused only after the event recorded behind its last copy has completed, so
//! a step that failed half-way leaves nothing to clean: the next user of a slot waits.
use std::sync::{Mutex, MutexGuard};

use super::ring::PinnedCopy;
use crate::error::Result;

/// Slots per direction: the pieces one direction can have in flight.
pub const LANE_SLOTS: usize = 4;
/// One slot (one piece of a tensor). Small in unit tests, so test tensors span many.
#[cfg(not(test))]
pub const LANE_SLOT_BYTES: usize = 4 << 20;
#[cfg(test)]
pub const LANE_SLOT_BYTES: usize = 128 << 10;
/// The pinned memory one device's lanes hold (both directions).
pub const LANES_BYTES: usize = 2 * LANE_SLOTS * LANE_SLOT_BYTES;

/// What the lanes need of a device beyond the ring's copies and events: streams of their
/// own.
pub trait LaneStreams: PinnedCopy {
    /// A new stream of this device that does not wait for the legacy default stream
    /// (`CU_STREAM_NON_BLOCKING`), kept for the process.
    ///
    /// # Safety
    /// None beyond the backend's own.
    unsafe fn create_stream(&self) -> Result<usize>;
}

/// A direction of copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// Device to host (gradients).
    Down,
    /// Host to device (updated parameters into their mirrors).
    Up,
    /// No copies: the overlapped step's early device steps (`overlap::device_early`), on
    /// a stream of their own so that they run beside backward, not behind it.
    Step,
}

#[derive(Default)]
struct Slot {
    ptr: u64,
    /// The event recorded after the slot's last copy, not yet waited for.
    event: Option<u64>,
}

type Slots = [[Slot; LANE_SLOTS]; 2];

/// The lanes of one device (kept by its backend for the process).
#[derive(Default)]
pub struct Lanes {
    /// The down, up and step streams, made on first use; apart from the slots, so that a
    /// stream can be had (to order a copy) while a step holds the slots.
    streams: Mutex<Option<[usize; 3]>>,
    slots: Mutex<Option<Slots>>,
}

/// The lanes held by one step (`Lanes::hold`); other steps on the device wait.
pub struct Held<'a> {
    b: &'a dyn LaneStreams,
    streams: [usize; 2],
    slots: MutexGuard<'a, Option<Slots>>,
}

impl Lanes {
    /// The stream of direction `dir`, made on first use.
    ///
    /// # Safety
    /// `b` is the backend these lanes belong to, every time.
    pub unsafe fn stream(&self, b: &dyn LaneStreams, dir: Dir) -> Result<usize> {
        let mut s = crate::sync::lock(&self.streams);
        if s.is_none() {
            *s = Some([b.create_stream()?, b.create_stream()?, b.create_stream()?]);
        }
        Ok(s.expect("made above")[dir as usize])
    }

    /// Holds the lanes' slots for one step, making the streams and slots on first use.
    ///
    /// # Safety
    /// `b` is the backend these lanes belong to, every time.
    pub unsafe fn hold<'a>(&'a self, b: &'a dyn LaneStreams) -> Result<Held<'a>> {
        let streams = [self.stream(b, Dir::Down)?, self.stream(b, Dir::Up)?];
        let mut slots = crate::sync::lock(&self.slots);
        if slots.is_none() {
            let mut made: Slots = Default::default();
            for s in made.iter_mut().flatten() {
                match b.alloc_pinned(LANE_SLOT_BYTES) {
                    Ok(p) => s.ptr = p,
                    Err(e) => {
                        // Nothing half-made is kept: the next step tries again.
                        for s in made.iter().flatten().filter(|s| s.ptr != 0) {
                            b.free_pinned(s.ptr);
                        }
                        return Err(e);
                    }
                }
            }
            *slots = Some(made);
        }
        Ok(Held { b, streams, slots })
    }

    /// Pinned bytes the lanes hold now.
    pub fn held_bytes(&self) -> usize {
        let slots = crate::sync::lock(&self.slots);
        slots.as_ref().map_or(0, |_| LANES_BYTES)
    }
}

impl Held<'_> {
    fn slot(&mut self, dir: Dir, k: usize) -> &mut Slot {
        let slots = self.slots.as_mut().expect("made in hold");
        &mut slots[dir as usize][k % LANE_SLOTS]
    }

    /// The stream of direction `dir`.
    pub fn stream(&self, dir: Dir) -> usize {
        self.streams[dir as usize]
    }

    /// Slot `k` of `dir`, idle: its last copy has completed.
    ///
    /// # Safety
    /// As the backend's `wait_event`.
    unsafe fn idle(&mut self, dir: Dir, k: usize) -> Result<u64> {
        let b = self.b;
        let s = self.slot(dir, k);
        if let Some(ev) = s.event.take() {
            b.wait_event(ev)?;
        }
        Ok(s.ptr)
    }

    /// Queues a copy of `bytes` (at most `LANE_SLOT_BYTES`) of device memory at `src`
    /// into down slot `k`, on the down stream, after the work queued there.
    ///
    /// # Safety
    /// `src` must be `bytes` readable bytes of the device until the copy has run.
    pub unsafe fn start_down(&mut self, k: usize, src: u64, bytes: usize) -> Result<()> {
        assert!(bytes <= LANE_SLOT_BYTES, "a piece fits its slot");
        let dst = self.idle(Dir::Down, k)?;
        let (b, stream) = (self.b, self.stream(Dir::Down));
        b.copy_to_host(dst, src, bytes, stream)?;
        let ev = b.record_event(stream)?;
        self.slot(Dir::Down, k).event = Some(ev);
        Ok(())
    }

    /// Waits for down slot `k`'s copy: its bytes are then at the returned address,
    /// until the slot's next `start_down`.
    ///
    /// # Safety
    /// As the backend's `wait_event`.
    pub unsafe fn finish_down(&mut self, k: usize) -> Result<*const u8> {
        Ok(self.idle(Dir::Down, k)? as *const u8)
    }

    /// Up slot `k`, idle, for the caller to fill before `start_up`.
    ///
    /// # Safety
    /// As the backend's `wait_event`; the memory is the slot's until `start_up`.
    pub unsafe fn up_slot(&mut self, k: usize) -> Result<*mut u8> {
        Ok(self.idle(Dir::Up, k)? as *mut u8)
    }

    /// Queues a copy of the first `bytes` of up slot `k` (filled since `up_slot`) to
    /// device memory `dst`, on the up stream, after the work queued there.
    ///
    /// # Safety
    /// `dst` must be `bytes` writable bytes of the device.
    pub unsafe fn start_up(&mut self, k: usize, dst: u64, bytes: usize) -> Result<()> {
        assert!(bytes <= LANE_SLOT_BYTES, "a piece fits its slot");
        let (b, stream) = (self.b, self.stream(Dir::Up));
        let src = self.slot(Dir::Up, k).ptr;
        b.copy_to_device(dst, src, bytes, stream)?;
        let ev = b.record_event(stream)?;
        self.slot(Dir::Up, k).event = Some(ev);
        Ok(())
    }
}
