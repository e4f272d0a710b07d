//! Devices emulated in host memory, for the unit tests (compiled under `cfg(test)` only):
//! "device memory" is host memory and a launch runs the kernel text built for the host by
//! g++ (`-ffp-contract=off`, through the shim header, as ctest builds it). Ordinals
//! `EMULATED`, `EMULATED + 1`, `CHECKER` and `COUNTED` resolve to them in `open::backend`, so
//! registration, device state, the hybrid step and state staging run end to end in CI;
//! only the CUDA calls behind `cuda::Device` are left to a GPU. Unavailable (tests skip,
//! saying why) without g++. The host kernels are `kernels`, a stream `stream`, the
//! `Backend` calls `backend`.
//!
//! Adversarial, so that ordering and lifetime bugs show on the host: each stream (the
//! legacy default one of each device, and every `create_stream`) runs its work on its
//! own thread after random delays; only events (`order_streams`) and waits order two
//! streams; a stream of one device is refused by the other; fresh memory holds
//! `POISON_NEW` until its zeroing runs, freed memory `POISON_FREED`. An asynchronous copy
//! checks, when it runs, that its host side is pinned memory of the device still
//! allocated; a violation is recorded and reported by `synchronize_all` (a pageable or
//! freed source would be read late on a GPU). Pinned and stream-ordered device bytes
//! are counted with their high-water marks, so tests can bound fo's staging memory.
mod backend;
mod kernels;
mod stream;

use std::alloc::{alloc, dealloc, Layout};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

pub use kernels::{
    encode, host_kernel, host_kernels, values, HostKernels, RunNorm, RunScale, RunTable, VecCounts,
};
pub use stream::create_stream;
use stream::{streams, Job, Worker};

use super::backend::Backend;
use super::ring::Ring;
use crate::error::{Error, Result};
use crate::tensor::{Device, TensorView};

/// The ordinal tests register emulated device parameters on (far above any real GPU's).
pub const EMULATED: i32 = 77;

/// Poison written into memory fresh from `alloc_zeroed` before its zeroing runs, and into
/// pinned memory (uninitialized on CUDA too).
pub const POISON_NEW: u8 = 0xA5;
/// Poison written into freed memory, which stays mapped a while (`QUARANTINE`) so a late
/// read sees poison instead of another allocation's data.
pub const POISON_FREED: u8 = 0xDB;
/// Freed blocks kept mapped (poisoned) before they are really freed.
const QUARANTINE: usize = 256;

/// Host memory posing as one device's, with the host kernel as its launcher.
pub struct Emulated {
    ordinal: i32,
    run: HostKernels,
    /// The legacy default stream (0) of this device.
    default: Arc<Worker>,
    /// Live allocations and their sizes; tests check that every one is freed.
    live: Mutex<HashMap<u64, usize>>,
    /// Live pinned host allocations (a subset of `live`), read by queued copies.
    pinned: Arc<Mutex<HashMap<u64, usize>>>,
    /// Freed blocks, poisoned, not yet returned to the allocator.
    freed: Mutex<VecDeque<(u64, usize)>>,
    /// What queued copies found wrong when they ran (see the module doc).
    violations: Arc<Mutex<Vec<String>>>,
    /// Recorded events not yet waited for.
    events: Mutex<HashMap<u64, Arc<Event>>>,
    /// Bytes now and at most: pinned, and stream-ordered device memory (`alloc_async`).
    usage: Mutex<Usage>,
    ring: Ring,
    lanes: super::lanes::Lanes,
}

/// Staging bytes held by an emulated device, now and at their high-water mark.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Usage {
    pub pinned: usize,
    pub pinned_peak: usize,
    pub stream_ordered: usize,
    pub stream_ordered_peak: usize,
}

/// A CUDA event: set by its stream's worker when the work before it has run.
type Event = (Mutex<bool>, Condvar);

const ALIGN: usize = 256;

thread_local! {
    static DOWNLOADS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    static POINTER_QUERIES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    static TABLE_UPLOADS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    static BLOCKING_WAITS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    static DEVICE_COPIES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Copies down made by this thread so far (a test counts a call's PCIe transfers).
pub fn downloads_on_this_thread() -> usize {
    DOWNLOADS.with(|d| d.get())
}

/// Pointer look-ups (`memory_of`, `allocation_of`: what `cuPointerGetAttribute` answers
/// on a GPU) made by this thread so far, on any emulated device: a test counts a step's.
/// Per thread, because the tests run in parallel on the same emulated devices.
pub fn pointer_queries_on_this_thread() -> usize {
    POINTER_QUERIES.with(|q| q.get())
}

/// Step-table uploads (`upload_table`) made by this thread so far, on any emulated device.
pub fn table_uploads_on_this_thread() -> usize {
    TABLE_UPLOADS.with(|u| u.get())
}

/// Device-to-device copies (`copy_on_device`) this thread queued so far, on any emulated
/// device: a test counts a hand-over's (each is a driver call on a GPU).
pub fn device_copies_on_this_thread() -> usize {
    DEVICE_COPIES.with(|c| c.get())
}

/// Host waits (`wait_event`) by this thread so far that found their event not yet
/// completed, so the thread blocked for the device: a test counts a call's.
pub fn blocking_waits_on_this_thread() -> usize {
    BLOCKING_WAITS.with(|w| w.get())
}

impl Emulated {
    /// This device's context current on this thread until the guard drops (as the CUDA
    /// backend pushes the primary context in every call).
    fn enter(&self) -> crate::device::context::Guard<crate::device::context::Emulated> {
        // SAFETY: an emulated context is a number; nothing to keep alive.
        match unsafe { crate::device::context::Guard::push(self.context()) } {
            Ok(g) => g,
            Err(never) => match never {},
        }
    }

    /// The handle of this device's (emulated) primary context.
    pub fn context(&self) -> usize {
        0xC0_0000 + self.ordinal as usize
    }

    pub fn live_allocations(&self) -> usize {
        self.live.lock().unwrap().len()
    }

    /// Staging bytes now and their high-water marks since the last `reset_peaks`.
    pub fn usage(&self) -> Usage {
        *self.usage.lock().unwrap()
    }

    /// Starts the high-water marks again from what is held now.
    pub fn reset_peaks(&self) {
        let mut u = self.usage.lock().unwrap();
        (u.pinned_peak, u.stream_ordered_peak) = (u.pinned, u.stream_ordered);
    }

    /// Takes the violations recorded so far (see the module doc).
    pub fn take_violations(&self) -> Vec<String> {
        std::mem::take(&mut *self.violations.lock().unwrap())
    }

    fn count(&self, pinned: isize, stream_ordered: isize) {
        let mut u = self.usage.lock().unwrap();
        u.pinned = u.pinned.checked_add_signed(pinned).expect("pinned bytes");
        u.stream_ordered = u
            .stream_ordered
            .checked_add_signed(stream_ordered)
            .expect("device bytes");
        u.pinned_peak = u.pinned_peak.max(u.pinned);
        u.stream_ordered_peak = u.stream_ordered_peak.max(u.stream_ordered);
    }

    /// A copy job that checks, when it runs, that `[host, host + n)` lies in pinned memory
    /// of this device still allocated, then copies `n` bytes `from` -> `to`.
    fn checked_copy(
        &self,
        host: usize,
        from: usize,
        to: usize,
        n: usize,
        what: &'static str,
    ) -> Job {
        let (pinned, violations, ordinal) =
            (self.pinned.clone(), self.violations.clone(), self.ordinal);
        Box::new(move || {
            let ok = pinned
                .lock()
                .unwrap()
                .iter()
                .any(|(&p, &len)| p as usize <= host && host + n <= p as usize + len);
            if !ok {
                violations.lock().unwrap().push(format!(
                    "emulated device {ordinal}: {what} of {n} bytes at host address {host:#x}, \
                     which is not pinned memory of this device allocated when the copy ran \
                     (pageable or freed memory)"
                ));
                return;
            }
            // SAFETY: both sides checked or the caller's to keep valid (as on a GPU).
            unsafe { std::ptr::copy_nonoverlapping(from as *const u8, to as *mut u8, n) }
        })
    }

    /// The worker of `stream` on this device; a stream of another device is refused as
    /// CUDA refuses it (the error `check_stream` gives).
    fn worker(&self, stream: usize) -> Result<Arc<Worker>> {
        if stream == 0 {
            return Ok(self.default.clone());
        }
        let w = streams().lock().unwrap().get(&stream).cloned();
        match w {
            None => Err(Error::invalid(
                "stream",
                format!("{stream:#x} is not a CUDA stream (emulated)"),
            )),
            Some(w) if w.device != self.ordinal => Err(Error::invalid(
                "stream",
                format!(
                    "{stream:#x} is a stream of another CUDA context than device {}'s primary \
                     context (emulated device {} made it)",
                    self.ordinal, w.device
                ),
            )),
            Some(w) => Ok(w),
        }
    }

    /// Waits for every stream of this device (as `cudaDeviceSynchronize`).
    pub fn synchronize(&self) {
        self.default.sync();
        let mine: Vec<Arc<Worker>> = streams()
            .lock()
            .unwrap()
            .values()
            .filter(|w| w.device == self.ordinal)
            .cloned()
            .collect();
        for w in mine {
            w.sync();
        }
    }

    /// Queues `ms` milliseconds of "work" on `stream`: what comes after it on that stream
    /// runs late, so a missing wait shows.
    pub fn stall(&self, stream: usize, ms: u64) {
        let w = self.worker(stream).expect("a stream of this device");
        w.push(Box::new(move || {
            std::thread::sleep(Duration::from_millis(ms))
        }));
    }

    unsafe fn raw_alloc(&self, bytes: usize) -> Result<u64> {
        let layout = Layout::from_size_align(bytes.max(1), ALIGN)
            .map_err(|e| Error::Internal(e.to_string()))?;
        let p = alloc(layout);
        if p.is_null() {
            return Err(Error::Internal(format!("emulated device: {bytes} bytes")));
        }
        std::ptr::write_bytes(p, POISON_NEW, bytes.max(1));
        self.live.lock().unwrap().insert(p as u64, bytes.max(1));
        Ok(p as u64)
    }

    unsafe fn raw_free(&self, ptr: u64) {
        let bytes = self
            .live
            .lock()
            .unwrap()
            .remove(&ptr)
            .expect("freeing memory the emulated device did not allocate");
        self.pinned.lock().unwrap().remove(&ptr);
        std::ptr::write_bytes(ptr as *mut u8, POISON_FREED, bytes);
        let mut q = self.freed.lock().unwrap();
        q.push_back((ptr, bytes));
        while q.len() > QUARANTINE {
            let (p, b) = q.pop_front().unwrap();
            dealloc(p as *mut u8, Layout::from_size_align(b, ALIGN).unwrap());
        }
    }
}

/// The emulated devices: ordinals `EMULATED`, `EMULATED + 1`, `CHECKER` and `COUNTED`.
pub const EMULATED_DEVICES: i32 = 4;
/// The device tests provoke violations on (to prove the checks): `synchronize_all`
/// leaves its violations to those tests.
pub const CHECKER: i32 = EMULATED + 2;
/// The device of the tests that count its live allocations (`live_allocations`, which
/// is per device and process): no other test allocates there, so tests running in
/// parallel elsewhere cannot move the count (on a 16-core host they did).
pub const COUNTED: i32 = EMULATED + 3;

fn devices() -> Option<&'static [Arc<Emulated>]> {
    static D: OnceLock<Option<Vec<Arc<Emulated>>>> = OnceLock::new();
    D.get_or_init(|| {
        let run = host_kernels().ok()?;
        Some(
            (0..EMULATED_DEVICES)
                .map(|k| {
                    let ordinal = EMULATED + k;
                    Arc::new(Emulated {
                        ordinal,
                        run,
                        default: Worker::spawn(ordinal, 0x77 + k as u64),
                        live: Mutex::new(HashMap::new()),
                        pinned: Default::default(),
                        freed: Mutex::new(VecDeque::new()),
                        violations: Default::default(),
                        events: Default::default(),
                        usage: Default::default(),
                        ring: Ring::default(),
                        lanes: Default::default(),
                    })
                })
                .collect(),
        )
    })
    .as_deref()
}

/// The emulated device for `ordinal` (None for any other ordinal, or where g++ cannot
/// build the kernel).
pub fn backend(ordinal: i32) -> Option<Arc<dyn Backend>> {
    device_at(ordinal).map(|d| d as Arc<dyn Backend>)
}

/// Emulated device `ordinal`, if it is one.
pub fn device_at(ordinal: i32) -> Option<Arc<Emulated>> {
    let k = ordinal.checked_sub(EMULATED)?;
    devices()?.get(usize::try_from(k).ok()?).cloned()
}

/// The emulated device `EMULATED`, or None where the host kernel cannot be built.
pub fn device() -> Option<Arc<Emulated>> {
    device_at(EMULATED)
}

/// Emulated device `ordinal` as the `Device` a tensor view carries.
pub fn dev(ordinal: i32) -> Device {
    Device::Cuda(ordinal as u32)
}

/// `t`'s memory claimed as `device`'s. Emulated device memory is host memory, so tests
/// hand the same buffers to a host optimizer and (through this) to a device one.
pub fn on(device: Device, t: &TensorView) -> TensorView {
    let shape: Vec<i64> = t.shape().iter().map(|&n| n as i64).collect();
    let strides: Vec<i64> = t.strides().iter().map(|&n| n as i64).collect();
    // SAFETY: the same memory as `t`, which the test keeps valid.
    unsafe { TensorView::on(device, t.as_ptr(), t.dtype(), &shape, Some(&strides), "t") }
        .expect("an existing view")
}

/// `on` for a step's gradients, `devices[i]` for `grads[i]`.
pub fn each_on(devices: &[Device], grads: &[Option<TensorView>]) -> Vec<Option<TensorView>> {
    assert_eq!(devices.len(), grads.len(), "one device per gradient");
    grads
        .iter()
        .zip(devices)
        .map(|(g, &d)| g.as_ref().map(|g| on(d, g)))
        .collect()
}

/// Waits for every stream of every emulated device (before a test reads "device" memory
/// on the host).
/// Panics, listing them, if a queued copy found its host memory unpinned or freed.
pub fn synchronize_all() {
    for d in devices().into_iter().flatten() {
        d.synchronize();
        if d.ordinal == CHECKER {
            continue;
        }
        let v = d.take_violations();
        assert!(v.is_empty(), "{}", v.join("\n"));
    }
}

/// Why emulated-device tests skip here, or None when they can run.
pub fn unavailable() -> Option<String> {
    host_kernel().err()
}

/// For a test: true (after printing why) where the emulated device cannot run.
pub fn skip() -> bool {
    match unavailable() {
        Some(why) => {
            eprintln!("skipped: {why}");
            true
        }
        None => false,
    }
}

/// For a test: the emulated device `EMULATED` and a new stream of it, or None (after
/// printing why) where the emulated device cannot run.
pub fn device_and_stream() -> Option<(Arc<Emulated>, usize)> {
    if skip() {
        return None;
    }
    Some((device().unwrap(), create_stream(EMULATED)))
}

fn host_marks() -> &'static Mutex<Vec<(usize, usize)>> {
    static H: OnceLock<Mutex<Vec<(usize, usize)>>> = OnceLock::new();
    H.get_or_init(Default::default)
}

/// Host memory marked as such for `memory_of` while the mark lives (the tests' other
/// buffers are `Untracked`: taken to be the device memory the caller says they are).
pub struct HostMark((usize, usize));

/// Marks `b` as host memory (what `cuPointerGetAttribute` says of a pageable buffer).
pub fn mark_host(b: &[u8]) -> HostMark {
    let m = (b.as_ptr() as usize, b.len());
    host_marks().lock().unwrap().push(m);
    HostMark(m)
}

impl Drop for HostMark {
    fn drop(&mut self) {
        let mut h = host_marks().lock().unwrap();
        if let Some(k) = h.iter().position(|&m| m == self.0) {
            h.swap_remove(k);
        }
    }
}

fn holds(m: &HashMap<u64, usize>, p: usize) -> bool {
    m.iter()
        .any(|(&a, &n)| a as usize <= p && p < a as usize + n)
}

/// Addresses cross to a worker as integers (the memory is the caller's to keep valid
/// until the work has run, as on a GPU).
#[derive(Clone, Copy)]
struct Addr(usize);
