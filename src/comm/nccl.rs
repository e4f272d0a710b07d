//! A communicator over the host's `ncclComm_t` and CUDA stream (feature `cuda`). fo's
//! buffers are host memory, so each collective stages through a device buffer on the
//! stream: copy in, NCCL collective, copy out, synchronize. The buffer is kept with the
//! communicator (`Scratch`), so a collective allocates nothing once it has grown to
//! the largest payload seen. NCCL and CUDA are loaded at
//! run time through cudarc; their absence is a clear `Unsupported` error, checked before
//! any call (cudarc panics when a library is missing).
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::driver::{result as cu, sys as cusys};
use cudarc::nccl::{result as nc, sys as ncsys};

use super::scratch::{DeviceAlloc, Scratch};
use super::{Backend, ReduceOp};
use crate::error::{Error, Result};

pub(super) struct NcclBackend {
    comm: ncsys::ncclComm_t,
    stream: cusys::CUstream,
    /// The staging buffer, and the retained primary context it lives in (released
    /// after the buffer is freed).
    scratch: Mutex<Scratch<CudaAlloc>>,
    rank: usize,
}

/// Device memory of one device's primary context (retained for the allocator's life).
struct CudaAlloc {
    ctx: cusys::CUcontext,
    dev: cusys::CUdevice,
}

impl DeviceAlloc for CudaAlloc {
    unsafe fn alloc(&self, bytes: usize) -> Result<u64> {
        cu::ctx::set_current(self.ctx).map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
        cu::malloc_sync(bytes).map_err(|e| cuda_err("cuMemAlloc", e))
    }

    unsafe fn free(&self, ptr: u64) {
        if cu::ctx::set_current(self.ctx).is_ok() {
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

fn nccl_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Comm(format!("{what}: NCCL error {e:?}"))
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
        if !ncsys::is_culib_present() {
            return Err(Error::Unsupported(
                "NCCL communicator: the NCCL library (libnccl) is not present".into(),
            ));
        }
        if comm.is_null() {
            return Err(Error::invalid("nccl_comm", "NULL"));
        }
        let comm = comm as ncsys::ncclComm_t;
        cu::init().map_err(|e| cuda_err("cuInit", e))?;
        let count = nc::comm_count(comm).map_err(|e| nccl_err("ncclCommCount", e))? as usize;
        let me = nc::comm_user_rank(comm).map_err(|e| nccl_err("ncclCommUserRank", e))? as usize;
        if count != world || me != rank {
            return Err(Error::invalid(
                "rank/world_size",
                format!("the NCCL communicator is rank {me} of {count}, but rank {rank} of {world} was given"),
            ));
        }
        let ordinal = nc::comm_cu_device(comm).map_err(|e| nccl_err("ncclCommCuDevice", e))?;
        let dev = cu::device::get(ordinal).map_err(|e| cuda_err("cuDeviceGet", e))?;
        let ctx =
            cu::primary_ctx::retain(dev).map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", e))?;
        Ok(NcclBackend {
            comm,
            stream: stream as cusys::CUstream,
            scratch: Mutex::new(Scratch::new(CudaAlloc { ctx, dev })),
            rank,
        })
    }

    /// Runs `f` with the communicator's device buffer (at least `n` bytes) with this
    /// device current, then synchronizes the stream, so the buffer is free again.
    fn staged<T>(
        &self,
        what: &str,
        n: usize,
        f: impl FnOnce(cusys::CUdeviceptr) -> Result<T>,
    ) -> Result<T> {
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        unsafe {
            // SAFETY: every collective synchronizes before releasing the lock.
            let d = scratch.get(n)?;
            cu::ctx::set_current(scratch.allocator().ctx).map_err(|e| cuda_err(what, e))?;
            let out = f(d);
            let synced = cu::stream::synchronize(self.stream).map_err(|e| cuda_err(what, e));
            let out = out?;
            synced?;
            Ok(out)
        }
    }

    fn s(&self) -> ncsys::cudaStream_t {
        self.stream as ncsys::cudaStream_t
    }
}

impl Backend for NcclBackend {
    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<()> {
        let n = buf.len();
        self.staged("broadcast", n, |d| unsafe {
            if self.rank == root {
                cu::memcpy_htod_async(d, &buf[..], self.stream)
                    .map_err(|e| cuda_err("broadcast", e))?;
            }
            let p = d as *mut c_void;
            nc::broadcast(
                p,
                p,
                n,
                ncsys::ncclDataType_t::ncclUint8,
                root as i32,
                self.comm,
                self.s(),
            )
            .map_err(|e| nccl_err("broadcast", e))?;
            cu::memcpy_dtoh_async(&mut buf[..], d, self.stream)
                .map_err(|e| cuda_err("broadcast", e))
        })
    }

    fn all_reduce_f64(&self, vals: &mut [f64], op: ReduceOp) -> Result<()> {
        let n = vals.len();
        let op = match op {
            ReduceOp::Sum => ncsys::ncclRedOp_t::ncclSum,
            ReduceOp::Max => ncsys::ncclRedOp_t::ncclMax,
        };
        self.staged("all_reduce_f64", n * 8, |d| unsafe {
            cu::memcpy_htod_async(d, &vals[..], self.stream)
                .map_err(|e| cuda_err("all_reduce_f64", e))?;
            let p = d as *mut c_void;
            nc::all_reduce(
                p,
                p,
                n,
                ncsys::ncclDataType_t::ncclFloat64,
                op,
                self.comm,
                self.s(),
            )
            .map_err(|e| nccl_err("all_reduce_f64", e))?;
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

    fn scatter(&self, parts: Option<Vec<Vec<u8>>>, recv: &mut [u8], root: usize) -> Result<()> {
        let u8t = ncsys::ncclDataType_t::ncclUint8;
        match parts {
            Some(parts) if self.rank == root => {
                recv.copy_from_slice(&parts[root]);
                let total: usize = parts.iter().map(|p| p.len()).sum();
                self.staged("scatter", total, |d| unsafe {
                    let mut off = 0usize;
                    let mut at = Vec::with_capacity(parts.len());
                    for p in &parts {
                        cu::memcpy_htod_async(d + off as u64, &p[..], self.stream)
                            .map_err(|e| cuda_err("scatter", e))?;
                        at.push(off);
                        off += p.len();
                    }
                    nc::group_start().map_err(|e| nccl_err("scatter", e))?;
                    for (r, p) in parts.iter().enumerate() {
                        if r != root && !p.is_empty() {
                            let src = (d + at[r] as u64) as *const c_void;
                            nc::send(src, p.len(), u8t, r as i32, self.comm, self.s())
                                .map_err(|e| nccl_err("scatter", e))?;
                        }
                    }
                    nc::group_end()
                        .map_err(|e| nccl_err("scatter", e))
                        .map(|_| ())
                })
            }
            _ => {
                if recv.is_empty() {
                    return Ok(()); // the root sends nothing to an empty shard
                }
                let n = recv.len();
                self.staged("scatter", n, |d| unsafe {
                    nc::recv(d as *mut c_void, n, u8t, root as i32, self.comm, self.s())
                        .map_err(|e| nccl_err("scatter", e))?;
                    cu::memcpy_dtoh_async(&mut recv[..], d, self.stream)
                        .map_err(|e| cuda_err("scatter", e))
                })
            }
        }
    }
}
