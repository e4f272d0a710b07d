//! Devices emulated in host memory, for the unit tests (compiled under `cfg(test)` only):
//! "device memory" is host memory and a launch runs the kernel text built for the host by
//! g++ (`-ffp-contract=off`, through the shim header, as ctest builds it). Ordinals
//! `EMULATED` and `EMULATED + 1` resolve to them in `backend::backend`, so registration,
//! device state, the hybrid step and state staging run end to end in CI; only the CUDA
//! calls behind `launch::Device` are left to a GPU. Unavailable (tests skip, saying why)
//! without g++.
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
use std::alloc::{alloc, dealloc, Layout};
use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{mpsc, Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use super::backend::Backend;
use super::check::Memory;
use super::norm_table::{FoNormTensor, NormTable};
use super::ring::Ring;
use super::table::FoStepTensor;
use crate::error::{Error, Result};

/// The ordinal tests register emulated device parameters on (far above any real GPU's).
pub const EMULATED: i32 = 77;

/// The host build of `fo_step_kernel` over a table, on a small grid.
pub type RunTable = unsafe extern "C" fn(*const FoStepTensor, i32, u64);
/// The host build of the two norm kernels: (table, rows, chunks, power, out).
pub type RunNorm = unsafe extern "C" fn(*const FoNormTensor, i32, u64, i32, *mut f64);
/// The host build of `fo_scale_kernel`: (table, rows, chunks, coef, coef64).
pub type RunScale = unsafe extern "C" fn(*const FoNormTensor, i32, u64, f32, f64);

/// The kernels' host build, loaded from one shared object.
#[derive(Clone, Copy)]
pub struct HostKernels {
    pub step: RunTable,
    pub norm: RunNorm,
    pub scale: RunScale,
}

/// Builds the host kernels into a shared object and loads them (once per process).
pub fn host_kernels() -> std::result::Result<HostKernels, String> {
    static K: OnceLock<std::result::Result<[usize; 3], String>> = OnceLock::new();
    let f = K.get_or_init(build).clone()?;
    // SAFETY: the addresses of the functions `build` defines, with these signatures.
    Ok(unsafe {
        HostKernels {
            step: std::mem::transmute::<usize, RunTable>(f[0]),
            norm: std::mem::transmute::<usize, RunNorm>(f[1]),
            scale: std::mem::transmute::<usize, RunScale>(f[2]),
        }
    })
}

/// The host build of `fo_step_kernel` (see `host_kernels`).
pub fn host_kernel() -> std::result::Result<RunTable, String> {
    host_kernels().map(|k| k.step)
}

/// A small grid, so the grid-stride loops and the table searches all get exercised.
const HOST_RUNNERS: &str = r#"#include "fo_step.cuh"
#include "fo_norm.cuh"
#include <vector>
extern "C" void fo_test_run(const fo_step_tensor* t, int n, unsigned long long g) {
  fo_host_launch(3, 4, [&] { fo_step_kernel(t, n, g); });
}
extern "C" void fo_test_norm(const fo_norm_tensor* t, int n, unsigned long long chunks, int power,
                             double* out) {
  std::vector<double> s(chunks * FO_NORM_LANES), m(chunks * FO_NORM_LANES);
  fo_host_launch(3, 4, [&] { fo_norm_lanes_kernel(t, n, chunks, power, s.data(), m.data()); });
  fo_host_launch(2, 3, [&] { fo_norm_chunks_kernel(s.data(), m.data(), chunks, out); });
}
extern "C" void fo_test_scale(const fo_norm_tensor* t, int n, unsigned long long chunks, float c,
                              double c64) {
  fo_host_launch(3, 4, [&] { fo_scale_kernel(t, n, chunks, c, c64); });
}
"#;

fn build() -> std::result::Result<[usize; 3], String> {
    let dir = std::env::temp_dir().join(format!("fo-host-kernel-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let src = dir.join("run.cpp");
    std::fs::write(&src, HOST_RUNNERS).map_err(|e| e.to_string())?;
    let so = dir.join("run.so");
    let kernels = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/optim/gpu/kernels");
    let out = Command::new("g++")
        .args([
            "-std=c++17",
            "-O1",
            "-ffp-contract=off",
            "-shared",
            "-fPIC",
            "-I",
        ])
        .arg(&kernels)
        .arg(&src)
        .arg("-o")
        .arg(&so)
        .output()
        .map_err(|e| format!("g++ not runnable: {e}"))?;
    if !out.status.success() {
        panic!("g++ failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let path = CString::new(so.to_str().unwrap()).unwrap();
    // SAFETY: a library built just above, defining the three C functions looked up.
    unsafe {
        let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOW);
        assert!(!h.is_null(), "dlopen {so:?}");
        let sym = |name: &std::ffi::CStr| {
            let f = libc::dlsym(h, name.as_ptr());
            assert!(!f.is_null(), "dlsym {name:?}");
            f as usize
        };
        Ok([
            sym(c"fo_test_run"),
            sym(c"fo_test_norm"),
            sym(c"fo_test_scale"),
        ])
    }
}

/// Poison written into memory fresh from `alloc_zeroed` before its zeroing runs, and into
/// pinned memory (uninitialized on CUDA too).
pub const POISON_NEW: u8 = 0xA5;
/// Poison written into freed memory, which stays mapped a while (`QUARANTINE`) so a late
/// read sees poison instead of another allocation's data.
pub const POISON_FREED: u8 = 0xDB;
/// Freed blocks kept mapped (poisoned) before they are really freed.
const QUARANTINE: usize = 256;

type Job = Box<dyn FnOnce() + Send>;

/// One stream: a worker thread running its jobs in order, each after a random delay, so
/// work on different streams interleaves unpredictably. Only `order_streams` (events)
/// and waits order two streams, as on a GPU with non-blocking streams.
struct Worker {
    tx: Mutex<mpsc::Sender<Job>>,
    device: i32,
}

impl Worker {
    fn spawn(device: i32, seed: u64) -> Arc<Worker> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name(format!("fo-emulated-{device}-{seed:x}"))
            .spawn(move || {
                let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                for job in rx {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if x.is_multiple_of(2) {
                        std::thread::sleep(Duration::from_micros(x % 300));
                    }
                    job();
                }
            })
            .expect("a stream worker thread");
        Arc::new(Worker {
            tx: Mutex::new(tx),
            device,
        })
    }

    fn push(&self, job: Job) {
        let _ = self.tx.lock().unwrap().send(job);
    }

    /// Waits for every job queued so far.
    fn sync(&self) {
        let (tx, rx) = mpsc::channel();
        self.push(Box::new(move || {
            let _ = tx.send(());
        }));
        let _ = rx.recv();
    }
}

/// Streams made by `create_stream`, by handle.
fn streams() -> &'static Mutex<HashMap<usize, Arc<Worker>>> {
    static S: OnceLock<Mutex<HashMap<usize, Arc<Worker>>>> = OnceLock::new();
    S.get_or_init(Default::default)
}

/// A new stream of emulated device `ordinal` (a handle that is never 0).
pub fn create_stream(ordinal: i32) -> usize {
    let mut s = streams().lock().unwrap();
    let handle = 0x5000 + 0x10 * (s.len() + 1);
    s.insert(handle, Worker::spawn(ordinal, handle as u64));
    handle
}

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
}

/// Copies down made by this thread so far (a test counts a call's PCIe transfers).
pub fn downloads_on_this_thread() -> usize {
    DOWNLOADS.with(|d| d.get())
}

impl Emulated {
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

/// The emulated devices: ordinals `EMULATED`, `EMULATED + 1` and `CHECKER`.
pub const EMULATED_DEVICES: i32 = 3;
/// The device tests provoke violations on (to prove the checks): `synchronize_all`
/// leaves its violations to those tests.
pub const CHECKER: i32 = EMULATED + 2;

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

impl Backend for Emulated {
    unsafe fn alloc_zeroed(&self, bytes: usize, stream: usize) -> Result<u64> {
        let w = self.worker(stream)?;
        let p = self.raw_alloc(bytes)?;
        let (at, n) = (Addr(p as usize), bytes.max(1));
        w.push(Box::new(move || {
            let at = at;
            std::ptr::write_bytes(at.0 as *mut u8, 0, n)
        }));
        Ok(p)
    }

    unsafe fn free(&self, ptr: u64) {
        // cuMemFree waits for the device's work.
        self.synchronize();
        self.raw_free(ptr)
    }

    unsafe fn alloc_pinned(&self, bytes: usize) -> Result<u64> {
        let p = self.raw_alloc(bytes)?;
        self.pinned.lock().unwrap().insert(p, bytes.max(1));
        self.count(bytes.max(1) as isize, 0);
        Ok(p)
    }

    unsafe fn free_pinned(&self, ptr: u64) {
        let bytes = self.live.lock().unwrap().get(&ptr).copied().unwrap_or(0);
        self.raw_free(ptr);
        self.count(-(bytes as isize), 0);
    }

    unsafe fn alloc_async(&self, bytes: usize, stream: usize) -> Result<u64> {
        self.worker(stream)?;
        let p = self.raw_alloc(bytes)?;
        self.count(0, bytes.max(1) as isize);
        Ok(p)
    }

    unsafe fn free_async(&self, ptr: u64, stream: usize) {
        let Ok(w) = self.worker(stream) else { return };
        let d = device_at(self.ordinal).expect("an emulated device");
        let at = Addr(ptr as usize);
        w.push(Box::new(move || {
            let at = at;
            let bytes = d
                .live
                .lock()
                .unwrap()
                .get(&(at.0 as u64))
                .copied()
                .unwrap_or(0);
            d.raw_free(at.0 as u64);
            d.count(0, -(bytes as isize));
        }));
    }

    unsafe fn copy_to_device(&self, dst: u64, src: u64, bytes: usize, stream: usize) -> Result<()> {
        let w = self.worker(stream)?;
        w.push(self.checked_copy(
            src as usize,
            src as usize,
            dst as usize,
            bytes,
            "a copy to the device",
        ));
        Ok(())
    }

    unsafe fn copy_to_host(&self, dst: u64, src: u64, bytes: usize, stream: usize) -> Result<()> {
        let w = self.worker(stream)?;
        w.push(self.checked_copy(
            dst as usize,
            src as usize,
            dst as usize,
            bytes,
            "a copy to the host",
        ));
        Ok(())
    }

    unsafe fn record_event(&self, stream: usize) -> Result<u64> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let w = self.worker(stream)?;
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ev: Arc<Event> = Default::default();
        self.events.lock().unwrap().insert(id, ev.clone());
        w.push(Box::new(move || {
            *ev.0.lock().unwrap() = true;
            ev.1.notify_all();
        }));
        Ok(id)
    }

    unsafe fn wait_event(&self, event: u64) -> Result<()> {
        let ev = self.events.lock().unwrap().remove(&event).ok_or_else(|| {
            Error::Internal(format!(
                "emulated device {}: no event {event}",
                self.ordinal
            ))
        })?;
        let mut done = ev.0.lock().unwrap();
        while !*done {
            done = ev.1.wait(done).unwrap();
        }
        Ok(())
    }

    fn ring(&self) -> &Ring {
        &self.ring
    }

    unsafe fn memory_of(&self, ptr: u64) -> Result<Memory> {
        let p = ptr as usize;
        if host_marks()
            .lock()
            .unwrap()
            .iter()
            .any(|&(a, n)| a <= p && p < a + n)
        {
            return Ok(Memory::Host);
        }
        for d in devices().into_iter().flatten() {
            if holds(&d.pinned.lock().unwrap(), p) {
                return Ok(Memory::Host);
            }
            if holds(&d.live.lock().unwrap(), p) {
                return Ok(Memory::Device(d.ordinal));
            }
        }
        Ok(Memory::Untracked)
    }

    unsafe fn download(&self, src: u64, dst: &mut [u8], stream: usize) -> Result<()> {
        let w = self.worker(stream)?;
        DOWNLOADS.with(|d| d.set(d.get() + 1));
        let (s, d, n) = (
            Addr(src as usize),
            Addr(dst.as_mut_ptr() as usize),
            dst.len(),
        );
        w.push(Box::new(move || {
            let (s, d) = (s, d);
            std::ptr::copy_nonoverlapping(s.0 as *const u8, d.0 as *mut u8, n)
        }));
        w.sync();
        Ok(())
    }

    unsafe fn upload(&self, dst: u64, src: &[u8], stream: usize) -> Result<()> {
        let w = self.worker(stream)?;
        // Staged now (as CUDA stages a pageable source), written in stream order.
        let staged = src.to_vec();
        let d = Addr(dst as usize);
        w.push(Box::new(move || {
            let d = d;
            std::ptr::copy_nonoverlapping(staged.as_ptr(), d.0 as *mut u8, staged.len())
        }));
        Ok(())
    }

    unsafe fn launch_step(
        &self,
        table: u64,
        count: i32,
        total_groups: u64,
        stream: usize,
    ) -> Result<()> {
        let w = self.worker(stream)?;
        let (run, t) = (self.run.step, Addr(table as usize));
        let failed = self.violations.clone();
        w.push(Box::new(move || {
            let t = t;
            // After a violation the table may be garbage: a sticky error, as a fault on a
            // GPU is, so the test reports the violation instead of crashing.
            if failed.lock().unwrap().is_empty() {
                run(t.0 as *const FoStepTensor, count, total_groups)
            }
        }));
        Ok(())
    }

    unsafe fn norm_chunks(&self, table: &NormTable, power: u32, stream: usize) -> Result<Vec<f64>> {
        let w = self.worker(stream)?;
        let mut out = vec![0f64; 2 * table.total_chunks as usize];
        if !table.tensors.is_empty() {
            let (run, t, chunks) = (self.run.norm, table.tensors.clone(), table.total_chunks);
            let o = Addr(out.as_mut_ptr() as usize);
            w.push(Box::new(move || {
                let o = o;
                run(
                    t.as_ptr(),
                    t.len() as i32,
                    chunks,
                    power as i32,
                    o.0 as *mut f64,
                )
            }));
            w.sync();
        }
        Ok(out)
    }

    unsafe fn scale(&self, table: &NormTable, coef: f64, stream: usize) -> Result<()> {
        let w = self.worker(stream)?;
        if !table.tensors.is_empty() {
            let (run, t, chunks) = (self.run.scale, table.tensors.clone(), table.total_chunks);
            w.push(Box::new(move || {
                run(t.as_ptr(), t.len() as i32, chunks, coef as f32, coef)
            }));
            w.sync();
        }
        Ok(())
    }

    unsafe fn check_stream(&self, stream: usize) -> Result<()> {
        self.worker(stream).map(|_| ())
    }

    unsafe fn order_streams(&self, from: usize, to: usize) -> Result<()> {
        let (f, t) = (self.worker(from)?, self.worker(to)?);
        if Arc::ptr_eq(&f, &t) {
            return Ok(());
        }
        let event = Arc::new((Mutex::new(false), Condvar::new()));
        let recorded = event.clone();
        f.push(Box::new(move || {
            *recorded.0.lock().unwrap() = true;
            recorded.1.notify_all();
        }));
        t.push(Box::new(move || {
            let mut done = event.0.lock().unwrap();
            while !*done {
                done = event.1.wait(done).unwrap();
            }
        }));
        Ok(())
    }
}

/// Test inputs: values over many magnitudes with exact zeros, deterministic in `seed`.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            match i % 7 {
                0 => 0.0,
                1 => u * 1e-5,
                2 => u * 300.0,
                _ => u,
            }
        })
        .collect()
}

/// `v` as little-endian `dt` elements (rounded to nearest even), as tests store them.
pub fn encode(dt: crate::dtype::DType, v: &[f32]) -> Vec<u8> {
    let f32s = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    crate::cast::cast(f32s, crate::dtype::DType::F32, dt, "test values").unwrap()
}
