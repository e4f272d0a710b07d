//! A communicator driven by the host: each collective is one call into a C function the
//! host supplies (torch.distributed over gloo or NCCL, MPI, a test's own transport).
//! A non-zero return becomes `Error::Comm` naming the operation and the code.
use std::ffi::c_void;

use super::{Backend, ReduceOp};
use crate::error::{Error, Result};

/// Copies root's `nbytes` at `buf` into every rank's `buf`.
pub type BroadcastFn =
    unsafe extern "C" fn(user: *mut c_void, buf: *mut c_void, nbytes: usize, root: i32) -> i32;
/// Reduces `count` doubles in place across ranks; `op` 0 = sum, 1 = max (NaN-propagating).
pub type AllReduceF64Fn =
    unsafe extern "C" fn(user: *mut c_void, vals: *mut f64, count: usize, op: i32) -> i32;
/// Returns once every rank has entered.
pub type BarrierFn = unsafe extern "C" fn(user: *mut c_void) -> i32;
/// Root sends `send_nbytes[r]` bytes at `send_bufs[r]` to rank `r` (both arrays have
/// `world_size` entries on root, NULL elsewhere); every rank receives its part into
/// `recv_buf`, whose size `recv_nbytes` it knows in advance (root included).
pub type ScatterFn = unsafe extern "C" fn(
    user: *mut c_void,
    send_bufs: *const *const c_void,
    send_nbytes: *const usize,
    recv_buf: *mut c_void,
    recv_nbytes: usize,
    root: i32,
) -> i32;

/// The host's collectives and the opaque pointer passed back to each of them.
/// `scatter` is optional: without it, sharded entries are broadcast whole and sliced
/// on arrival (correct, but every rank receives every full tensor).
#[derive(Clone, Copy)]
pub struct Callbacks {
    pub user: *mut c_void,
    pub broadcast: BroadcastFn,
    pub all_reduce_f64: AllReduceF64Fn,
    pub barrier: BarrierFn,
    pub scatter: Option<ScatterFn>,
}

// SAFETY: the host promises (fo_comm_create_callbacks' contract) that its callbacks may
// be called from whichever thread uses this rank's communicator.
unsafe impl Send for Callbacks {}

pub(super) struct CallbackBackend {
    pub(super) rank: usize,
    pub(super) cb: Callbacks,
}

impl CallbackBackend {
    fn check(&self, op: &str, code: i32) -> Result<()> {
        if code == 0 {
            Ok(())
        } else {
            Err(Error::Comm(format!(
                "{op} callback returned {code} on rank {}",
                self.rank
            )))
        }
    }
}

impl Backend for CallbackBackend {
    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<()> {
        let code = unsafe {
            (self.cb.broadcast)(
                self.cb.user,
                buf.as_mut_ptr() as *mut c_void,
                buf.len(),
                root as i32,
            )
        };
        self.check("broadcast", code)
    }

    fn all_reduce_f64(&self, vals: &mut [f64], op: ReduceOp) -> Result<()> {
        let code = unsafe {
            (self.cb.all_reduce_f64)(self.cb.user, vals.as_mut_ptr(), vals.len(), op.code())
        };
        self.check("all_reduce_f64", code)
    }

    fn barrier(&self) -> Result<()> {
        let code = unsafe { (self.cb.barrier)(self.cb.user) };
        self.check("barrier", code)
    }

    fn supports_scatter(&self) -> bool {
        self.cb.scatter.is_some()
    }

    fn scatter(&self, parts: Option<Vec<Vec<u8>>>, recv: &mut [u8], root: usize) -> Result<()> {
        let f = self
            .cb
            .scatter
            .ok_or_else(|| Error::Unsupported("scatter: no scatter callback".into()))?;
        let (ptrs, lens): (Vec<*const c_void>, Vec<usize>) = match &parts {
            Some(p) if self.rank == root => p
                .iter()
                .map(|s| (s.as_ptr() as *const c_void, s.len()))
                .unzip(),
            _ => (Vec::new(), Vec::new()),
        };
        let (pp, lp) = if ptrs.is_empty() {
            (std::ptr::null(), std::ptr::null())
        } else {
            (ptrs.as_ptr(), lens.as_ptr())
        };
        let code = unsafe {
            f(
                self.cb.user,
                pp,
                lp,
                recv.as_mut_ptr() as *mut c_void,
                recv.len(),
                root as i32,
            )
        };
        self.check("scatter", code)
    }
}
