//! A communicator over the host's `ncclComm_t` and CUDA stream (feature `cuda`). fo's
//! buffers are host memory, so each collective stages through a device buffer on the
//! stream: copy in, NCCL collective, copy out, then a wait that polls NCCL's asynchronous
//! error with a timeout (`nccl_wait`). Payloads move in pieces of at most `MAX_STAGED`
//! bytes through one buffer kept with the communicator (`Scratch`), so a collective
//! allocates nothing once it has grown, and the buffer never exceeds that bound. NCCL is loaded by `nccl_lib` (where torch's wheel puts it), CUDA through
//! cudarc; their absence is a clear `Unsupported` error, checked before any call. Every
//! CUDA call runs with the device's primary context pushed and the caller's restored
//! (`device::context::Current`).
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use cudarc::driver::{result as cu, sys as cusys};

use super::nccl_lib::{self as nl, NcclComm, NcclLib};
use super::nccl_wait::{self, Pending};
use super::scratch::{DeviceAlloc, Scratch};
use super::{Backend, ReduceOp};
use crate::device::context::Current;
use crate::error::{Error, Result};

pub(super) struct NcclBackend {
    lib: &'static NcclLib,
    comm: NcclComm,
    stream: cusys::CUstream,
    /// The staging buffer, and the retained primary context it lives in (released
    /// after the buffer is freed).
    scratch: Mutex<Scratch<CudaAlloc>>,
    rank: usize,
    timeout: Duration,
    /// Set once fo aborted the communicator: later collectives fail at once.
    aborted: AtomicBool,
}

/// Device memory of one device's primary context (retained for the allocator's life).
struct CudaAlloc {
    ctx: cusys::CUcontext,
    dev: cusys::CUdevice,
}

impl DeviceAlloc for CudaAlloc {
    unsafe fn alloc(&self, bytes: usize) -> Result<u64> {
        let _cur = Current::push(self.ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))?;
        cu::malloc_sync(bytes).map_err(|e| cuda_err("cuMemAlloc", e))
    }

    unsafe fn free(&self, ptr: u64) {
        if let Ok(_cur) = Current::push(self.ctx) {
            let _ = cu::free_sync(ptr);
        }
    }
}

impl Drop for CudaAlloc {
    fn drop(&mut self) {
        // SAFETY: the retain in `NcclBackend::new`; the scratch buffer is freed already
        // (Scratch's drop runs before its allocator's).
        unsafe {
            let _ = cu::primary_ctx::release(self.dev);
        }
    }
}

// SAFETY: the handles are plain pointers the host promised stay valid; one thread uses
// a communicator at a time (the C ABI's contract).
unsafe impl Send for NcclBackend {}

fn cuda_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Comm(format!("{what}: CUDA error {e:?}"))
}

/// The NCCL library fo uses and its version (loading needs no GPU).
pub fn library() -> Result<(String, i32)> {
    let l = nl::lib()?;
    Ok((l.path.clone(), l.version()?))
}

/// One collective in flight on the communicator's stream.
struct InFlight<'a>(&'a NcclBackend);

impl Pending for InFlight<'_> {
    fn done(&self) -> Result<bool> {
        let b = self.0;
        let mut r = nl::NCCL_SUCCESS;
        // SAFETY: a valid communicator (the host's promise); writes one int.
        unsafe { (b.lib.comm_get_async_error)(b.comm, &mut r) };
        if r == nl::NCCL_IN_PROGRESS {
            return Ok(false); // a non-blocking communicator is still enqueueing
        }
        // SAFETY: the host's stream; the device's context is current (`staged`).
        match unsafe { cusys::cuStreamQuery(b.stream) } {
            cusys::CUresult::CUDA_SUCCESS => Ok(true),
            cusys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(cuda_err("cuStreamQuery", e)),
        }
    }

    fn failure(&self) -> Option<String> {
        let b = self.0;
        let mut r = nl::NCCL_SUCCESS;
        // SAFETY: as in `done`.
        let q = unsafe { (b.lib.comm_get_async_error)(b.comm, &mut r) };
        [q, r]
            .into_iter()
            .find(|&r| r != nl::NCCL_SUCCESS && r != nl::NCCL_IN_PROGRESS)
            .map(|r| b.lib.describe(r, b.comm))
    }

    fn abort(&self) {
        let b = self.0;
        b.aborted.store(true, Ordering::SeqCst);
        // SAFETY: the host's communicator; fo uses it no more.
        unsafe { (b.lib.comm_abort)(b.comm) };
    }
}

impl NcclBackend {
    /// # Safety
    /// `comm` and `stream` must be a valid `ncclComm_t` and `cudaStream_t`.
    pub(super) unsafe fn new(
        comm: *mut c_void,
        stream: *mut c_void,
        rank: usize,
        world: usize,
    ) -> Result<NcclBackend> {
        if !cusys::is_culib_present() {
            return Err(Error::Unsupported(
                "NCCL communicator: the CUDA driver library (libcuda) is not present".into(),
            ));
        }
        let lib = nl::lib().map_err(|e| match e {
            Error::Unsupported(m) => Error::Unsupported(format!("NCCL communicator: {m}")),
            e => e,
        })?;
        if comm.is_null() {
            return Err(Error::invalid("nccl_comm", "NULL"));
        }
        let timeout = nccl_wait::timeout()?;
        let int = |what: &str, f: unsafe extern "C" fn(NcclComm, *mut i32) -> i32| {
            let mut v = 0;
            lib.check(what, f(comm, &mut v), comm).map(|()| v)
        };
        cu::init().map_err(|e| cuda_err("cuInit", e))?;
        let count = int("ncclCommCount", lib.comm_count)? as usize;
        let me = int("ncclCommUserRank", lib.comm_user_rank)? as usize;
        if count != world || me != rank {
            return Err(Error::invalid(
                "rank/world_size",
                format!("the NCCL communicator is rank {me} of {count}, but rank {rank} of {world} was given"),
            ));
        }
        let ordinal = int("ncclCommCuDevice", lib.comm_cu_device)?;
        let dev = cu::device::get(ordinal).map_err(|e| cuda_err("cuDeviceGet", e))?;
        let ctx =
            cu::primary_ctx::retain(dev).map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", e))?;
        Ok(NcclBackend {
            lib,
            comm,
            stream: stream as cusys::CUstream,
            scratch: Mutex::new(Scratch::new(CudaAlloc { ctx, dev })),
            rank,
            timeout,
            aborted: AtomicBool::new(false),
        })
    }

    /// Runs `f` with the communicator's device buffer (at least `n` bytes) with this
    /// device's context pushed, then waits for the stream (`nccl_wait`), so the buffer
    /// is free again; the caller's context is restored on return.
    fn staged<T>(
        &self,
        what: &str,
        n: usize,
        f: impl FnOnce(cusys::CUdeviceptr) -> Result<T>,
    ) -> Result<T> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(Error::Comm(format!(
                "{what}: the NCCL communicator was aborted by an earlier failed collective"
            )));
        }
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        unsafe {
            let _cur = Current::push(scratch.allocator().ctx).map_err(|e| cuda_err(what, e))?;
            // SAFETY: every collective waits for its stream before releasing the lock.
            let d = scratch.get(n)?;
            let out = f(d);
            // Waited for even when `f` failed midway: the buffer may be in use.
            let waited = nccl_wait::wait(&InFlight(self), self.timeout, what);
            let out = out?;
            waited?;
            Ok(out)
        }
    }

    fn s(&self) -> nl::CudaStream {
        self.stream as nl::CudaStream
    }

    fn nccl(&self, what: &str, r: nl::NcclResult) -> Result<()> {
        self.lib.check(what, r, self.comm)
    }
}

/// The most bytes staged at once: larger payloads move in pieces of this size, so the
/// device buffer kept outside the caller's allocator stays at most this large (a 5 GB
/// tensor left an 8 GB buffer before).
pub(super) const MAX_STAGED: usize = 16 << 20;

impl Backend for NcclBackend {
    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<()> {
        if buf.len() > MAX_STAGED {
            // Every rank holds the same length, so every rank makes the same pieces.
            return buf
                .chunks_mut(MAX_STAGED)
                .try_for_each(|c| self.broadcast(c, root));
        }
        let n = buf.len();
        self.staged("broadcast", n, |d| unsafe {
            if self.rank == root {
                cu::memcpy_htod_async(d, &buf[..], self.stream)
                    .map_err(|e| cuda_err("broadcast", e))?;
            }
            let p = d as *mut c_void;
            let r = (self.lib.broadcast)(p, p, n, nl::NCCL_UINT8, root as i32, self.comm, self.s());
            self.nccl("broadcast", r)?;
            cu::memcpy_dtoh_async(&mut buf[..], d, self.stream)
                .map_err(|e| cuda_err("broadcast", e))
        })
    }

    fn all_reduce_f64(&self, vals: &mut [f64], op: ReduceOp) -> Result<()> {
        if vals.len() * 8 > MAX_STAGED {
            return vals
                .chunks_mut(MAX_STAGED / 8)
                .try_for_each(|c| self.all_reduce_f64(c, op));
        }
        let n = vals.len();
        let op = match op {
            ReduceOp::Sum => nl::NCCL_SUM,
            ReduceOp::Max => nl::NCCL_MAX,
        };
        self.staged("all_reduce_f64", n * 8, |d| unsafe {
            cu::memcpy_htod_async(d, &vals[..], self.stream)
                .map_err(|e| cuda_err("all_reduce_f64", e))?;
            let p = d as *mut c_void;
            let r = (self.lib.all_reduce)(p, p, n, nl::NCCL_FLOAT64, op, self.comm, self.s());
            self.nccl("all_reduce_f64", r)?;
            cu::memcpy_dtoh_async(&mut vals[..], d, self.stream)
                .map_err(|e| cuda_err("all_reduce_f64", e))
        })
    }

    fn barrier(&self) -> Result<()> {
        self.all_reduce_f64(&mut [0.0], ReduceOp::Sum)
    }

    fn supports_scatter(&self) -> bool {
        true
    }

    fn cuda_stream(&self) -> usize {
        self.stream as usize
    }

    fn scatter(&self, parts: Option<Vec<Vec<u8>>>, recv: &mut [u8], root: usize) -> Result<()> {
        let u8t = nl::NCCL_UINT8;
        match parts {
            Some(parts) if self.rank == root => {
                recv.copy_from_slice(&parts[root]);
                // One rank's part at a time, in pieces of at most MAX_STAGED bytes: the
                // root stages a piece, not every rank's part at once. A receiver takes its
                // pieces in order (NCCL keeps the order between two ranks).
                for (r, p) in parts.iter().enumerate().filter(|(r, _)| *r != root) {
                    for c in p.chunks(MAX_STAGED) {
                        self.staged("scatter", c.len(), |d| unsafe {
                            cu::memcpy_htod_async(d, c, self.stream)
                                .map_err(|e| cuda_err("scatter", e))?;
                            let res = (self.lib.send)(
                                d as *const c_void,
                                c.len(),
                                u8t,
                                r as i32,
                                self.comm,
                                self.s(),
                            );
                            self.nccl("scatter", res)
                        })?;
                    }
                }
                Ok(())
            }
            _ => {
                if recv.is_empty() {
                    return Ok(()); // the root sends nothing to an empty shard
                }
                let n = recv.len();
                self.staged("scatter", n, |d| unsafe {
                    let r =
                        (self.lib.recv)(d as *mut c_void, n, u8t, root as i32, self.comm, self.s());
                    self.nccl("scatter", r)?;
                    cu::memcpy_dtoh_async(&mut recv[..], d, self.stream)
                        .map_err(|e| cuda_err("scatter", e))
                })
            }
        }
    }
}
