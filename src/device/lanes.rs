//! A device's copy lanes, for the offload pipeline: one stream per direction with a few
//! pinned slots each, made on first use and reused by every later step.
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
}

#[derive(Default)]
struct Slot {
    ptr: u64,
    /// The event recorded after the slot's last copy, not yet waited for.
    event: Option<u64>,
}

struct Lane {
    stream: usize,
    slots: [Slot; LANE_SLOTS],
}

/// The lanes of one device (kept by its backend for the process).
#[derive(Default)]
pub struct Lanes {
    state: Mutex<Option<[Lane; 2]>>,
}

/// The lanes held by one step (`Lanes::hold`); other steps on the device wait.
pub struct Held<'a> {
    b: &'a dyn LaneStreams,
    lanes: MutexGuard<'a, Option<[Lane; 2]>>,
}

impl Lanes {
    /// Holds the lanes for one step, making the streams and slots on first use.
    ///
    /// # Safety
    /// `b` is the backend these lanes belong to, every time.
    pub unsafe fn hold<'a>(&'a self, b: &'a dyn LaneStreams) -> Result<Held<'a>> {
        let mut lanes = crate::sync::lock(&self.state);
        if lanes.is_none() {
            let mut made: Vec<Lane> = Vec::with_capacity(2);
            for _ in 0..2 {
                let stream = b.create_stream()?;
                let mut slots: [Slot; LANE_SLOTS] = Default::default();
                for s in &mut slots {
                    match b.alloc_pinned(LANE_SLOT_BYTES) {
                        Ok(p) => s.ptr = p,
                        Err(e) => {
                            // Nothing half-made is kept: the next step tries again.
                            for s in made.iter().flat_map(|l| &l.slots).chain(&slots) {
                                if s.ptr != 0 {
                                    b.free_pinned(s.ptr);
                                }
                            }
                            return Err(e);
                        }
                    }
                }
                made.push(Lane { stream, slots });
            }
            let up = made.pop().expect("two lanes");
            let down = made.pop().expect("two lanes");
            *lanes = Some([down, up]);
        }
        Ok(Held { b, lanes })
    }

    /// Pinned bytes the lanes hold now.
    pub fn held_bytes(&self) -> usize {
        let lanes = crate::sync::lock(&self.state);
        lanes.as_ref().map_or(0, |_| LANES_BYTES)
    }
}

impl Held<'_> {
    fn lane(&mut self, dir: Dir) -> &mut Lane {
        let lanes = self.lanes.as_mut().expect("made in hold");
        &mut lanes[dir as usize]
    }

    /// The stream of direction `dir`.
    pub fn stream(&mut self, dir: Dir) -> usize {
        self.lane(dir).stream
    }

    /// Slot `k` of `dir`, idle: its last copy has completed.
    ///
    /// # Safety
    /// As the backend's `wait_event`.
    unsafe fn idle(&mut self, dir: Dir, k: usize) -> Result<u64> {
        let b = self.b;
        let s = &mut self.lane(dir).slots[k % LANE_SLOTS];
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
        self.lane(Dir::Down).slots[k % LANE_SLOTS].event = Some(ev);
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
        let src = self.lane(Dir::Up).slots[k % LANE_SLOTS].ptr;
        b.copy_to_device(dst, src, bytes, stream)?;
        let ev = b.record_event(stream)?;
        self.lane(Dir::Up).slots[k % LANE_SLOTS].event = Some(ev);
        Ok(())
    }
}
