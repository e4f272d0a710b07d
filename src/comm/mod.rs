//! `Comm`: the few collectives fo needs (broadcast, all-reduce of f64, barrier, scatter),
//! over one of three backends: an in-process group of threads (`local`), a table of C
//! callbacks driven by the host's own process group (`callbacks`), or NCCL (`nccl`,
//! behind the `cuda` feature).
mod agree;
mod callbacks;
mod local;
#[cfg(feature = "cuda")]
mod nccl;
mod nccl_lib;
mod nccl_wait;
mod scratch;

/// The NCCL library a NCCL communicator would use (its path and `ncclGetVersion` code),
/// found as `nccl_lib` describes; loading it needs no GPU.
#[cfg(feature = "cuda")]
pub fn nccl_library() -> Result<(String, i32)> {
    nccl::library()
}

pub use agree::agree;
pub use callbacks::{AllReduceF64Fn, BarrierFn, BroadcastFn, Callbacks, ScatterFn};
pub use local::{LocalGroupOptions, MAX_LOCAL_WORLD, MAX_TIMEOUT_S};

use crate::error::{Error, Result};

crate::codes::code_table! {
    /// How `all_reduce_f64` combines values; the codes are what callbacks receive as `op`.
    /// `Max` propagates NaN.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum ReduceOp {
        noun = "reduce op", c_prefix = "FO_REDUCE_", c_type = i32,
        c_doc = "`all_reduce_f64`'s `op`: ";
        Sum = 0, "sum", "sum.";
        Max = 1, "max", "max (must propagate NaN).";
    }
}

impl ReduceOp {
    /// Combines `b` into `a`; `Max` returns NaN when either side is NaN.
    pub fn combine(self, a: f64, b: f64) -> f64 {
        match self {
            ReduceOp::Sum => a + b,
            ReduceOp::Max if a.is_nan() || b.is_nan() => f64::NAN,
            ReduceOp::Max => a.max(b),
        }
    }
}

/// What a backend implements. Arguments arrive validated by `Comm`.
pub(crate) trait Backend: Send {
    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<()>;
    fn all_reduce_f64(&self, vals: &mut [f64], op: ReduceOp) -> Result<()>;
    fn barrier(&self) -> Result<()>;
    /// Whether `scatter` is available; without it fo broadcasts whole tensors.
    fn supports_scatter(&self) -> bool;
    /// Root sends `parts[r]` to rank `r`; every rank receives exactly `recv.len()` bytes.
    /// The parts are owned so an in-process backend can hand them over without a copy.
    fn scatter(&self, parts: Option<Vec<Vec<u8>>>, recv: &mut [u8], root: usize) -> Result<()>;
    /// The CUDA stream the host gave with the communicator (NCCL's), 0 when none.
    fn cuda_stream(&self) -> usize {
        0
    }
}

/// One rank's handle on a communicator. Every rank must call the same collectives in
/// the same order; a failed collective leaves the communicator unusable.
pub struct Comm {
    rank: usize,
    world_size: usize,
    backend: Box<dyn Backend>,
    /// The `CUstream` device tensors of the clip and the broadcast are read and written
    /// on (0: the legacy default stream); a NCCL communicator starts with its own.
    stream: usize,
}

impl Comm {
    pub(crate) fn from_backend(
        rank: usize,
        world_size: usize,
        backend: Box<dyn Backend>,
    ) -> Result<Comm> {
        if world_size == 0 {
            return Err(Error::invalid("world_size", "must be >= 1, got 0"));
        }
        if rank >= world_size {
            return Err(Error::invalid(
                "rank",
                format!("{rank} is outside a group of {world_size} ranks"),
            ));
        }
        let stream = backend.cuda_stream();
        Ok(Comm {
            rank,
            world_size,
            backend,
            stream,
        })
    }

    /// `local_group_with` for caller-supplied sizes: `world_size` outside
    /// `1..=MAX_LOCAL_WORLD` is an error, not an allocation that aborts the process.
    pub fn try_local_group(world_size: usize, opts: LocalGroupOptions) -> Result<Vec<Comm>> {
        local::check_world(world_size)?;
        Ok(local::group(world_size, opts))
    }

    /// An in-process group: `world_size` handles (index = rank), to be moved to one
    /// thread each. Collectives time out after 10 minutes; a handle that is dropped
    /// makes every later collective on the other handles fail instead of hang.
    pub fn local_group(world_size: usize) -> Vec<Comm> {
        Comm::local_group_with(world_size, LocalGroupOptions::default())
    }

    /// `local_group` with options (a shorter timeout for tests).
    pub fn local_group_with(world_size: usize, opts: LocalGroupOptions) -> Vec<Comm> {
        local::group(world_size, opts)
    }

    /// A communicator whose collectives are the host's callbacks (see `Callbacks`).
    pub fn from_callbacks(rank: usize, world_size: usize, callbacks: Callbacks) -> Result<Comm> {
        Comm::from_backend(
            rank,
            world_size,
            Box::new(callbacks::CallbackBackend {
                rank,
                cb: callbacks,
            }),
        )
    }

    /// A communicator over an existing `ncclComm_t` and `cudaStream_t` (feature `cuda`).
    /// Host buffers are staged through device memory on `stream`.
    ///
    /// # Safety
    /// `nccl_comm` and `stream` must be valid handles that outlive the communicator.
    pub unsafe fn from_nccl(
        nccl_comm: *mut std::ffi::c_void,
        stream: *mut std::ffi::c_void,
        rank: usize,
        world_size: usize,
    ) -> Result<Comm> {
        #[cfg(feature = "cuda")]
        {
            let backend = nccl::NcclBackend::new(nccl_comm, stream, rank, world_size)?;
            Comm::from_backend(rank, world_size, Box::new(backend))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (nccl_comm, stream, rank, world_size);
            Err(Error::Unsupported(
                "NCCL communicators need libfo built with the `cuda` feature (cargo build --features cuda)".into(),
            ))
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The `CUstream` the clip's and the broadcast's device tensors are used on, after
    /// the work queued there (0: the legacy default stream).
    pub fn stream(&self) -> usize {
        self.stream
    }

    /// Sets the stream `stream()` returns (torch: the current stream of the gradients'
    /// device). Checked against each device tensor's device when it is used.
    pub fn set_stream(&mut self, stream: usize) -> Result<()> {
        if stream != 0 {
            crate::device::stream_support().map_err(|e| match e {
                Error::Unsupported(m) => {
                    Error::Unsupported(m.replace("fo_optimizer_set_stream", "fo_comm_set_stream"))
                }
                e => e,
            })?;
        }
        self.stream = stream;
        Ok(())
    }

    fn check_root(&self, root: usize, op: &str) -> Result<()> {
        if root >= self.world_size {
            return Err(Error::invalid(
                "root",
                format!(
                    "{op}: root {root} is outside a group of {} ranks",
                    self.world_size
                ),
            ));
        }
        Ok(())
    }

    /// Root's `buf` is copied into every other rank's `buf` (all of the same length).
    pub fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<()> {
        self.check_root(root, "broadcast")?;
        self.backend.broadcast(buf, root)
    }

    /// Element-wise reduction across ranks; every rank gets the result.
    pub fn all_reduce_f64(&self, vals: &mut [f64], op: ReduceOp) -> Result<()> {
        self.backend.all_reduce_f64(vals, op)
    }

    /// Sums f32 values across ranks, accumulating in f64 (gradient averaging: divide after).
    pub fn all_reduce_f32_sum(&self, vals: &mut [f32]) -> Result<()> {
        const CHUNK: usize = 1 << 20;
        let mut wide = Vec::with_capacity(vals.len().min(CHUNK));
        // Ranks must issue the same number of collectives: an empty slice still does one.
        if vals.is_empty() {
            return self.all_reduce_f64(&mut [], ReduceOp::Sum);
        }
        for chunk in vals.chunks_mut(CHUNK) {
            wide.clear();
            wide.extend(chunk.iter().map(|&v| v as f64));
            self.all_reduce_f64(&mut wide, ReduceOp::Sum)?;
            for (v, w) in chunk.iter_mut().zip(&wide) {
                *v = *w as f32;
            }
        }
        Ok(())
    }

    pub fn barrier(&self) -> Result<()> {
        self.backend.barrier()
    }

    pub fn supports_scatter(&self) -> bool {
        self.backend.supports_scatter()
    }

    /// Root passes one part per rank (`Some`, `world_size` entries; others pass `None`);
    /// every rank receives its part into `recv`, whose length it knows in advance.
    pub fn scatter(&self, parts: Option<Vec<Vec<u8>>>, recv: &mut [u8], root: usize) -> Result<()> {
        self.check_root(root, "scatter")?;
        if !self.supports_scatter() {
            return Err(Error::Unsupported(
                "scatter: this communicator has no scatter".into(),
            ));
        }
        if self.rank == root {
            match &parts {
                Some(p) if p.len() == self.world_size => {
                    if p[root].len() != recv.len() {
                        return Err(Error::invalid(
                            "recv",
                            format!(
                                "scatter: root's own part has {} bytes, recv has {}",
                                p[root].len(),
                                recv.len()
                            ),
                        ));
                    }
                }
                _ => {
                    return Err(Error::invalid(
                        "parts",
                        format!("scatter: root must pass {} parts", self.world_size),
                    ))
                }
            }
        }
        self.backend.scatter(parts, recv, root)
    }
}
