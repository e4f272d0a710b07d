//! `fo_comm` (callbacks, in-process group, NCCL), `fo_broadcast_state_dict` and
//! `fo_clip_grad_norm`. Argument conversion failures are handed to the core's `_checked`
//! entry points, so a bad argument on one rank becomes every rank's error, not a hang.
use std::ffi::c_void;
use std::sync::{Arc, Mutex, Weak};

use crate::sync::lock;

use super::args::{arg_count, arg_flag, arg_mut, arg_ref, arg_slice, arg_str};
use super::code_tables::BROADCAST_STRATEGY;
use super::codes::{FO_BROADCAST_STRATEGY_FULL_BROADCAST, FO_BROADCAST_STRATEGY_SCATTER};
use super::handle::{enter, Guarded, Handle};
use super::status::{fo_status, guard, guard_void};
use super::types::{fo_shard_spec, fo_tensor};
use crate::broadcast::{
    broadcast_state_dict_checked, BroadcastDest, BroadcastOptions, BroadcastStats, Strategy,
};
use crate::ckpt::Background;
use crate::clip::{clip_grad_norm_checked, ClipGrad};
use crate::comm::{Callbacks, Comm, LocalGroupOptions};
use crate::error::{Error, Result};
use crate::tensor::TensorView;

/// One rank's communicator (opaque). One call at a time per handle: a call made while
/// another thread is inside a call on the same handle returns FO_ERR_BUSY at once (on that
/// thread only: the other ranks see the caller's collective as usual).
pub struct fo_comm {
    inner: Handle<Comm>,
    /// The async saves that commit through this communicator at their `fo_save_wait`:
    /// `fo_comm_destroy` waits for their writers and detaches them (`ffi::save`).
    pub(crate) saves: Mutex<Vec<Weak<CommLink>>>,
}

/// An async save's claim on the communicator it commits through, registered with it
/// (`fo_comm.saves`): `fo_comm_destroy` waits for the save's writer, then detaches the
/// save (nulls `comm`) before freeing, so `fo_save_wait` never enters a freed handle.
pub(crate) struct CommLink {
    pub(super) comm: Mutex<*const fo_comm>,
    pub(super) background: Background,
}

// SAFETY: the pointer is dereferenced only in `fo_save_wait`, under `comm`'s lock, and
// only while it is non-null: `fo_comm_destroy` nulls it under the same lock before it
// frees the communicator, and a wait that entered the communicator first holds its guard,
// which destroy waits for.
unsafe impl Send for CommLink {}
unsafe impl Sync for CommLink {}

/// `fo_comm_destroy`'s part (the communicator is held by the destroy, so no wait can
/// enter it meanwhile): waits for the writers of the saves that would commit through it,
/// then detaches them; their `fo_save_wait` then fails with FO_ERR_COMM, not committed.
pub(crate) fn detach_saves(saves: &Mutex<Vec<Weak<CommLink>>>) {
    let links: Vec<Arc<CommLink>> = lock(saves).drain(..).filter_map(|w| w.upgrade()).collect();
    for l in links {
        l.background.wait(None);
        *lock(&l.comm) = std::ptr::null();
    }
}

impl Guarded for fo_comm {
    type Inner = Comm;
    const ARG: &'static str = "comm";
    fn handle(&self) -> &Handle<Comm> {
        &self.inner
    }
}

fn boxed(c: Comm) -> *mut fo_comm {
    Box::into_raw(Box::new(fo_comm {
        inner: Handle::new("the communicator", c),
        saves: Mutex::new(Vec::new()),
    }))
}

/// The host's collectives. Each returns 0 on success; any other value fails the fo call
/// with FO_ERR_COMM naming the operation. `user` is passed back to every callback.
/// - `broadcast`: copy root's `nbytes` at `buf` into every rank's `buf`.
/// - `all_reduce_f64`: reduce `count` doubles in place; `op` is FO_REDUCE_SUM or FO_REDUCE_MAX.
/// - `barrier`: return once every rank has entered.
/// - `scatter` (may be NULL): root sends `send_nbytes[r]` bytes at `send_bufs[r]` to rank
///   `r` (arrays of world_size entries on root, NULL on other ranks); every rank, root
///   included, receives its part into `recv_buf` (`recv_nbytes`, known in advance).
///   Without it, sharded tensors are broadcast whole and sliced on arrival.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct fo_comm_callbacks {
    pub user: *mut c_void,
    pub broadcast: Option<
        unsafe extern "C" fn(user: *mut c_void, buf: *mut c_void, nbytes: usize, root: i32) -> i32,
    >,
    pub all_reduce_f64: Option<
        unsafe extern "C" fn(user: *mut c_void, vals: *mut f64, count: usize, op: i32) -> i32,
    >,
    pub barrier: Option<unsafe extern "C" fn(user: *mut c_void) -> i32>,
    pub scatter: Option<
        unsafe extern "C" fn(
            user: *mut c_void,
            send_bufs: *const *const c_void,
            send_nbytes: *const usize,
            recv_buf: *mut c_void,
            recv_nbytes: usize,
            root: i32,
        ) -> i32,
    >,
}

/// One entry of rank 0's full state dict.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct fo_broadcast_source {
    pub key: *const std::ffi::c_char,
    pub tensor: fo_tensor,
}

/// One destination: the key, this rank's tensor, and `spec` (NULL: the whole tensor;
/// otherwise where this rank's shard lies: its mesh must span the group, with
/// rank = row-major index of `coord`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct fo_broadcast_dest {
    pub key: *const std::ffi::c_char,
    pub tensor: fo_tensor,
    pub spec: *const fo_shard_spec,
}

/// `strategy`: `FO_BROADCAST_STRATEGY_SCATTER` (each rank receives only its shard) or
/// `FO_BROADCAST_STRATEGY_FULL_BROADCAST` (every rank receives every full tensor; for
/// comparison). `allow_int_float_cast`: 1 allows conversions involving integer or bool
/// dtypes.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct fo_broadcast_options {
    pub allow_int_float_cast: i32,
    pub strategy: i32,
}

/// What one rank moved: payload bytes received (in rank 0's dtype; a shard, or a whole
/// tensor), the table's bytes, payload rank 0 sent to others, agreement bytes, entries filled.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct fo_broadcast_stats {
    pub bytes_received: u64,
    pub table_bytes: u64,
    pub bytes_sent: u64,
    pub control_bytes: u64,
    pub tensors: u64,
}

/// One gradient for `fo_clip_grad_norm`: `is_shard` 1 when it is this rank's
/// shard of a sharded gradient (summed across ranks), 0 when replicated or plain
/// (identical on every rank: counted once).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct fo_clip_grad {
    pub tensor: fo_tensor,
    pub is_shard: i32,
}

impl From<BroadcastStats> for fo_broadcast_stats {
    fn from(s: BroadcastStats) -> Self {
        fo_broadcast_stats {
            bytes_received: s.bytes_received,
            table_bytes: s.table_bytes,
            bytes_sent: s.bytes_sent,
            control_bytes: s.control_bytes,
            tensors: s.tensors,
        }
    }
}

impl fo_comm_callbacks {
    fn to_callbacks(self) -> Result<Callbacks> {
        let need = |name: &str| Error::invalid(format!("callbacks.{name}"), "NULL (required)");
        Ok(Callbacks {
            user: self.user,
            broadcast: self.broadcast.ok_or_else(|| need("broadcast"))?,
            all_reduce_f64: self.all_reduce_f64.ok_or_else(|| need("all_reduce_f64"))?,
            barrier: self.barrier.ok_or_else(|| need("barrier"))?,
            scatter: self.scatter,
        })
    }
}

impl fo_broadcast_options {
    fn to_options(self) -> Result<BroadcastOptions> {
        let strategy = match self.strategy {
            FO_BROADCAST_STRATEGY_SCATTER => Strategy::Scatter,
            FO_BROADCAST_STRATEGY_FULL_BROADCAST => Strategy::FullBroadcast,
            s => {
                return Err(Error::invalid(
                    "opts.strategy",
                    format!(
                        "unknown strategy {s} (valid: {})",
                        BROADCAST_STRATEGY.valid()
                    ),
                ))
            }
        };
        let allow_int_float_cast =
            arg_flag(self.allow_int_float_cast, "opts.allow_int_float_cast")?;
        Ok(BroadcastOptions {
            allow_int_float_cast,
            strategy,
        })
    }
}

unsafe fn sources(
    p: *const fo_broadcast_source,
    n: i64,
) -> Result<Option<Vec<(String, TensorView)>>> {
    if p.is_null() && n == 0 {
        return Ok(None);
    }
    let s = arg_slice(p, arg_count(n, "n_full")?, "full")?;
    let one = |(i, e): (usize, &fo_broadcast_source)| -> Result<(String, TensorView)> {
        Ok((
            arg_str(e.key, &format!("full[{i}].key"))?.to_string(),
            e.tensor.to_host(&format!("full[{i}].tensor"))?,
        ))
    };
    s.iter()
        .enumerate()
        .map(one)
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

unsafe fn dest_list(p: *const fo_broadcast_dest, n: i64) -> Result<Vec<BroadcastDest>> {
    let s = arg_slice(p, arg_count(n, "n_dests")?, "dests")?;
    let one =
        |(i, e): (usize, &fo_broadcast_dest)| -> Result<BroadcastDest> {
            let tensor = e.tensor.to_view(&format!("dests[{i}].tensor"))?;
            Ok(BroadcastDest {
                key: arg_str(e.key, &format!("dests[{i}].key"))?.to_string(),
                tensor,
                spec: match e.spec.as_ref() {
                    None => None,
                    Some(s) => Some(s.to_spec().map_err(|err| {
                        Error::invalid(format!("dests[{i}].spec"), err.to_string())
                    })?),
                },
            })
        };
    s.iter().enumerate().map(one).collect()
}

/// A communicator whose collectives are the host's callbacks (`*cb` is copied; `user`
/// must stay valid until `fo_comm_destroy`). The callbacks run on the calling thread.
#[no_mangle]
pub unsafe extern "C" fn fo_comm_create_callbacks(
    rank: i32,
    world_size: i32,
    callbacks: *const fo_comm_callbacks,
    out: *mut *mut fo_comm,
) -> fo_status {
    guard(|| {
        let cb = arg_ref(callbacks, "callbacks")?.to_callbacks()?;
        let out = arg_mut(out, "out")?;
        let comm = Comm::from_callbacks(
            arg_count(rank as i64, "rank")?,
            arg_count(world_size as i64, "world_size")?,
            cb,
        )?;
        *out = boxed(comm);
        Ok(())
    })
}

/// An in-process group: writes `world_size` handles to `out[0..world_size]` (index =
/// rank), each to be used by its own thread. `world_size` is 1..=1024
/// (`FO_MAX_LOCAL_WORLD`). A collective waiting longer than `timeout_s` seconds (finite,
/// > 0, at most one week: 604800) fails every rank; so does destroying a handle.
#[no_mangle]
pub unsafe extern "C" fn fo_comm_create_local_group(
    world_size: i32,
    timeout_s: f64,
    out: *mut *mut fo_comm,
) -> fo_status {
    guard(|| {
        let n = arg_count(world_size as i64, "world_size")?;
        let opts = LocalGroupOptions::with_timeout_s(timeout_s)?;
        let comms = Comm::try_local_group(n, opts)?;
        let out = super::args::arg_slice_mut(out, n, "out")?;
        for (o, c) in out.iter_mut().zip(comms) {
            *o = boxed(c);
        }
        Ok(())
    })
}

/// A communicator over an existing `ncclComm_t` and `cudaStream_t` (feature `cuda`;
/// NCCL and CUDA are loaded at run time). NCCL is looked for in `FO_NCCL_LIBRARY` (a
/// path), then as the copy already loaded (torch's), then beside loaded `site-packages`
/// libraries (`nvidia/nccl/lib/libnccl.so.2`, pip's `nvidia-nccl-cu*` wheel), then as
/// `libnccl.so.2` / `libnccl.so`. Each collective waits by polling NCCL's asynchronous
/// error, at most `FO_NCCL_TIMEOUT_S` seconds (default 600); on an error or the timeout
/// fo aborts `nccl_comm` (`ncclCommAbort`: the host must not use or destroy it again)
/// and returns FO_ERR_COMM with NCCL's message. `cuda_stream` is also the stream of the
/// clip's and the broadcast's device tensors (`fo_comm_set_stream`). Without the
/// feature, or when libcuda or libnccl cannot be loaded, returns FO_ERR_UNSUPPORTED
/// saying which.
#[no_mangle]
pub unsafe extern "C" fn fo_comm_create_nccl(
    nccl_comm: *mut c_void,
    cuda_stream: *mut c_void,
    rank: i32,
    world_size: i32,
    out: *mut *mut fo_comm,
) -> fo_status {
    guard(|| {
        let out = arg_mut(out, "out")?;
        let (r, w) = (
            arg_count(rank as i64, "rank")?,
            arg_count(world_size as i64, "world_size")?,
        );
        let comm = Comm::from_nccl(nccl_comm, cuda_stream, r, w)?;
        *out = boxed(comm);
        Ok(())
    })
}

/// Frees a communicator (NULL is ignored). For an in-process group, the other ranks'
/// pending and later collectives fail instead of waiting for this one. If another thread
/// is inside a call on `comm`, waits for it to return first; called from inside a call
/// on `comm` (a callback), frees nothing and records FO_ERR_BUSY's message. An async
/// save started with `comm` and not yet waited for: this waits for its writer, and its
/// `fo_save_wait` then returns FO_ERR_COMM (the commit cannot run without `comm`).
#[no_mangle]
pub unsafe extern "C" fn fo_comm_destroy(comm: *mut fo_comm) {
    guard_void(|| {
        let Some(c) = comm.as_ref() else {
            return Ok(());
        };
        c.handle().wait_idle("fo_comm_destroy")?;
        detach_saves(&c.saves);
        drop(Box::from_raw(comm));
        Ok(())
    })
}

/// Sets the CUDA stream (`cudaStream_t` / `CUstream`) on which `fo_clip_grad_norm` and
/// `fo_broadcast_state_dict` read and write device tensors through this communicator:
/// they run after the work queued there (torch: `torch.cuda.current_stream().cuda_stream`
/// of the gradients' device, so the norm never reads unfinished gradients). NULL is the
/// legacy default stream, the default of callback and local communicators; a NCCL
/// communicator starts with its own `cuda_stream`. Every device tensor given with the
/// communicator must be on the stream's device (else FO_ERR_INVALID_ARGUMENT naming
/// it, before anything is written). FO_ERR_UNSUPPORTED for a non-NULL stream without
/// the `cuda` build feature or libcuda.
#[no_mangle]
pub unsafe extern "C" fn fo_comm_set_stream(comm: *mut fo_comm, stream: *mut c_void) -> fo_status {
    guard(|| enter(comm, "fo_comm_set_stream")?.set_stream(stream as usize))
}

/// This rank's index and the group's size.
#[no_mangle]
pub unsafe extern "C" fn fo_comm_info(
    comm: *const fo_comm,
    rank: *mut i32,
    world_size: *mut i32,
) -> fo_status {
    guard(|| {
        let c = enter(comm, "fo_comm_info")?;
        *arg_mut(rank, "rank")? = c.rank() as i32;
        *arg_mut(world_size, "world_size")? = c.world_size() as i32;
        Ok(())
    })
}

/// Fills every rank's `dests` from rank 0's `full` (`n_full` entries; ignored on other
/// ranks, which may pass NULL, 0). Keys are matched by name, in sorted order. Rank 0
/// broadcasts a table (key, dtype, shape) first; a key missing on rank 0, a shape
/// mismatch, a forbidden cast or ranks that disagree fail every rank with the same
/// message, and no destination is written on any error. f32/bf16/f16/f64 convert
/// (round to nearest even); float8 never converts; integer/bool conversions need
/// `opts->allow_int_float_cast`. Every rank names the same keys, sharded alike (a mesh
/// spanning the group, the same placements); keys of rank 0 that no rank names are not
/// sent. A destination may be CUDA device memory (`device` >= 0, contiguous, `cuda`
/// build): it is written from host memory, in order on the communicator's stream
/// (`fo_comm_set_stream`), once every rank has everything. `opts` and `stats` may be NULL. Collective: every rank
/// calls it.
#[no_mangle]
pub unsafe extern "C" fn fo_broadcast_state_dict(
    comm: *mut fo_comm,
    full: *const fo_broadcast_source,
    n_full: i64,
    dests: *const fo_broadcast_dest,
    n_dests: i64,
    opts: *const fo_broadcast_options,
    stats: *mut fo_broadcast_stats,
) -> fo_status {
    guard(|| {
        let held = enter(comm, "fo_broadcast_state_dict")?;
        let comm = &*held;
        let local = opts
            .as_ref()
            .copied()
            .unwrap_or_default()
            .to_options()
            .and_then(|o| Ok((o, dest_list(dests, n_dests)?)));
        let (opts, dests) = match local {
            Ok((o, d)) => (o, Ok(d)),
            Err(e) => (BroadcastOptions::default(), Err(e)),
        };
        let s = broadcast_state_dict_checked(comm, sources(full, n_full), dests, &opts)?;
        if let Some(out) = stats.as_mut() {
            *out = s.into();
        }
        Ok(())
    })
}

/// The FSDP2-safe global gradient norm: shard gradients' `|g|^p` summed across ranks,
/// replicated ones counted once; `norm_type` > 0, or INFINITY for the max norm. Writes
/// the total to `*total_norm` and, when it exceeds `max_norm`, scales every gradient in
/// place by `max_norm / (total + 1e-6)`. With `error_if_nonfinite`, a NaN/inf total is
/// FO_ERR_NUMERICS on every rank and nothing is scaled. F32, BF16, F16 (and F64)
/// gradients; f64 accumulation. A gradient on a CUDA device (`device` >= 0, contiguous,
/// `cuda` build) is summed and scaled by fo's kernels on the communicator's stream
/// (`fo_comm_set_stream`), after the work queued there, and is scaled when the call
/// returns; only per-chunk partial
/// sums come to the host (for `norm_type` other than 1, 2 and INFINITY the gradient is
/// copied down to sum it). The total is the host computation's, bit for bit. Collective:
/// every rank calls it, with or without gradients.
#[no_mangle]
pub unsafe extern "C" fn fo_clip_grad_norm(
    comm: *mut fo_comm,
    grads: *const fo_clip_grad,
    n_grads: i64,
    max_norm: f64,
    norm_type: f64,
    error_if_nonfinite: i32,
    total_norm: *mut f64,
) -> fo_status {
    guard(|| {
        let held = enter(comm, "fo_clip_grad_norm")?;
        let comm = &*held;
        // Every local check feeds the collective's agreement, so a bad argument on one
        // rank fails every rank instead of leaving the others waiting.
        let local = arg_mut(total_norm, "total_norm").and_then(|out| {
            arg_flag(error_if_nonfinite, "error_if_nonfinite")?;
            let g = arg_slice(grads, arg_count(n_grads, "n_grads")?, "grads")?;
            let g = g.iter().enumerate().map(|(i, g)| {
                Ok(ClipGrad {
                    tensor: g.tensor.to_view(&format!("grads[{i}]"))?,
                    is_shard: arg_flag(g.is_shard, &format!("grads[{i}].is_shard"))?,
                })
            });
            Ok((out, g.collect::<Result<Vec<_>>>()?))
        });
        let (out, grads) = match local {
            Ok((o, g)) => (Some(o), Ok(g)),
            Err(e) => (None, Err(e)),
        };
        let total =
            clip_grad_norm_checked(comm, grads, max_norm, norm_type, error_if_nonfinite == 1)?;
        if let Some(o) = out {
            *o = total;
        }
        Ok(())
    })
}
