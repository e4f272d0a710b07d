//! The async save C ABI: `fo_state_save_async`, `fo_save_wait`, `fo_save_poll`,
//! `fo_save_stats`, `fo_save_destroy`. Thin: convert, call `crate::ckpt::save::async_save`.
use std::ffi::c_char;
use std::sync::{Arc, Mutex};

use crate::sync::lock;
use std::time::Duration;

use super::args::{arg_mut, arg_path, arg_ref};
use super::ckpt::fo_pack_options;
use super::comm::{fo_comm, CommLink};
use super::handle::{destroy, enter, Guarded, Handle};
use super::optim::{enter_opt, fo_optimizer};
use super::status::{fo_status, guard, guard_void};
use crate::ckpt::{self, AsyncSave};
use crate::error::Error;

/// How to save asynchronously: `pack` as for `fo_state_save`, and
/// `staging_budget_bytes`, the most the copy-on-write pool may hold (0: as much as the
/// save could copy, i.e. this rank's stored state it writes, so no step waits for the
/// disk; at most half the memory available at the call, 256 MiB where unknown). A
/// mutation of state the writer has not taken yet copies it into the pool first, or waits
/// for the writer when the pool is full: the budget bounds memory, never correctness.
/// The pool keeps its copies' buffers for the next save of the same optimizer (at most
/// the budget; freed with the optimizer), so later saves copy without page faults.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fo_save_options {
    pub pack: fo_pack_options,
    pub staging_budget_bytes: u64,
}

/// What an async save has done so far (`fo_save_stats`). `done`: 1 once the background
/// work is over (its outcome is ready for `fo_save_wait`). `bytes_written`: bytes of
/// state the writer has taken, of `bytes_total`. `staging_high_water`: the most the
/// copy-on-write pool held, never more than `staging_budget`. `device_staged`: bytes of
/// device-resident state copied to the host at the call (outside the pool). `copies`:
/// parameters copied into the pool before a mutation.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct fo_save_stats {
    pub done: i32,
    pub bytes_written: u64,
    pub bytes_total: u64,
    pub staging_high_water: u64,
    pub staging_budget: u64,
    pub device_staged: u64,
    pub copies: u64,
}

/// An async save (opaque), from `fo_state_save_async`, freed by `fo_save_destroy`. Like
/// every handle it takes one call at a time (FO_ERR_BUSY for a second caller).
pub struct fo_save {
    inner: Handle<SaveState>,
}

pub(crate) struct SaveState {
    save: AsyncSave,
    /// The communicator given at the call: the commit collective runs on it in
    /// `fo_save_wait`, entered there like any call on it (never from the writer thread).
    comm: Option<Arc<CommLink>>,
}

impl Guarded for fo_save {
    type Inner = SaveState;
    const ARG: &'static str = "save";
    fn handle(&self) -> &Handle<SaveState> {
        &self.inner
    }
}

/// Starts saving the optimizer's state into `dir` in the background and returns once a
/// copy-on-write snapshot of it is registered: the checkpoint holds the state as of this
/// call, byte-identical to what `fo_state_save` (or `fo_state_save_comm`) would write
/// now, however the optimizer steps, loads or sets state meanwhile.
///
/// Contract while a save is in flight (until `fo_save_wait` or `fo_save_destroy`):
/// - change registered parameters only through `fo_optimizer_step` (or fo's own set /
///   load calls): fo copies what the save still needs before it writes them, but cannot
///   see a write the caller makes directly to its memory;
/// - `fo_optimizer_add_param` is refused (FO_ERR_INVALID_ARGUMENT) until the writer has
///   read everything; destroying the optimizer waits for the writer;
/// - a second `fo_state_save_async` of the same optimizer, or into the same directory
///   from any optimizer of this process (the ranks of one save excepted), waits until
///   the first save has committed (or failed) without a communicator, so the directory
///   always ends holding the newest save; while the first has a communicator and its
///   `fo_save_wait` has not begun (its commit runs there), the second is refused with
///   FO_ERR_BUSY naming the save in flight, changing nothing: wait for the first, then
///   save again. Saves from other processes into one directory are not coordinated.
///
/// The writer yields to the step: while `fo_optimizer_step` runs it pauses before its
/// next read (unless the step waits for it), so steps lose little and the save completes
/// between them (during forward and backward).
///
/// `comm` (NULL: none; else its rank and world size must be the options'): every rank
/// must call this (the ranks agree here, on this thread, on every rank's argument checks,
/// the directory, mode, params and save id, before anything is written: a rank's bad
/// argument or a difference is every rank's FO_ERR_INVALID_ARGUMENT, naming the rank and
/// both values) and `fo_save_wait`, where
/// the commit collective runs, on the calling thread; the writer thread never touches
/// the communicator. `fo_comm_destroy` before that wait waits for the save's writer and
/// then detaches the save: its `fo_save_wait` returns FO_ERR_COMM (not committed; the
/// previous checkpoint stays the visible one), never touching the freed handle. Without a communicator the
/// last rank to finish commits in the background, as `fo_state_save` does. Device-
/// resident state is copied to the host at the call. `*out` receives the handle.
#[no_mangle]
pub unsafe extern "C" fn fo_state_save_async(
    opt: *mut fo_optimizer,
    dir: *const c_char,
    options: *const fo_save_options,
    comm: *const fo_comm,
    out: *mut *mut fo_save,
) -> fo_status {
    guard(|| {
        let c = match comm.is_null() {
            true => None,
            false => Some(enter(comm, "fo_state_save_async")?),
        };
        // Every local check feeds the ranks' agreement (with a communicator), so a bad
        // argument on one rank is every rank's error instead of the others' timeout.
        let out = arg_mut(out, "out");
        let mut held = enter_opt(opt, "fo_state_save_async");
        let args = (|| {
            out.as_ref().map_err(Error::clone)?;
            let o = arg_ref(options, "options")?;
            let so = o.pack.to_options()?;
            let budget = usize::try_from(o.staging_budget_bytes).map_err(|_| {
                Error::invalid("options.staging_budget_bytes", "does not fit this machine")
            })?;
            Ok((arg_path(dir, "dir")?, so, budget))
        })();
        let local = match held.as_mut() {
            Err(busy) => Err(busy.clone()),
            Ok(o) => args.map(|(dir, so, budget)| (&mut **o, dir, so, budget)),
        };
        let save = ckpt::save::async_save::save_async_checked(c.as_deref(), local)?;
        let out = out?;
        let comm = comm.as_ref().map(|fc| {
            let link = Arc::new(CommLink {
                comm: Mutex::new(fc as *const fo_comm),
                background: save.background(),
            });
            let mut saves = lock(&fc.saves);
            saves.retain(|w| w.strong_count() > 0);
            saves.push(Arc::downgrade(&link));
            link
        });
        let state = SaveState { save, comm };
        *out = Box::into_raw(Box::new(fo_save {
            inner: Handle::new("the save", state),
        }));
        Ok(())
    })
}

/// Beyond this many seconds (a week) a wait's timeout means "no limit": a host passes
/// INFINITY or a huge number for that, and no caller means a longer finite wait.
const NO_LIMIT_BEYOND_S: f64 = 7.0 * 24.0 * 3600.0;

/// `fo_save_wait`'s `timeout_s`: None (no limit) when negative, INFINITY or beyond a
/// week; NaN is refused.
fn wait_timeout(timeout_s: f64) -> Result<Option<Duration>, Error> {
    if timeout_s.is_nan() {
        return Err(Error::invalid("timeout_s", "is NaN"));
    }
    if !(0.0..=NO_LIMIT_BEYOND_S).contains(&timeout_s) {
        return Ok(None);
    }
    Ok(Some(Duration::from_secs_f64(timeout_s)))
}

/// Waits up to `timeout_s` seconds (negative, INFINITY or more than a week: no limit;
/// NaN: FO_ERR_INVALID_ARGUMENT) for the save, then returns the status of the whole save, its commit included: FO_OK once committed (with a
/// communicator: on every rank, after the commit collective that runs here; every rank
/// must call it). FO_ERR_TIMEOUT when the writer is still at work (the save goes on:
/// wait again). A failure (an I/O error names the path and cause) leaves the previous
/// checkpoint the visible one. Later calls return the same status.
#[no_mangle]
pub unsafe extern "C" fn fo_save_wait(save: *mut fo_save, timeout_s: f64) -> fo_status {
    guard(|| {
        let mut s = enter(save, "fo_save_wait")?;
        let timeout = wait_timeout(timeout_s)?;
        let Some(link) = s.comm.clone() else {
            return s.save.wait(timeout, None);
        };
        // Entered under the link's lock: a destroy either detached the save before (null)
        // or waits for this call's guard before it frees the communicator.
        let c = {
            let p = lock(&link.comm);
            if p.is_null() {
                drop(p);
                let why = Error::Comm(
                    "the communicator given to fo_state_save_async was destroyed before \
                     fo_save_wait: the save is not committed (a later save into the same \
                     directory removes its staged files)"
                        .into(),
                );
                return s.save.wait_without_commit(timeout, why);
            }
            enter(*p, "fo_save_wait")?
        };
        s.save.wait(timeout, Some(&c))
    })
}

/// Whether the background work is over (`*done` 1 or 0) and how many bytes of state the
/// writer has taken. Either output may be NULL. Never blocks.
#[no_mangle]
pub unsafe extern "C" fn fo_save_poll(
    save: *const fo_save,
    done: *mut i32,
    bytes_written: *mut u64,
) -> fo_status {
    guard(|| {
        let s = enter(save, "fo_save_poll")?;
        if let Some(d) = done.as_mut() {
            *d = s.save.is_done() as i32;
        }
        if let Some(b) = bytes_written.as_mut() {
            *b = s.save.stats().bytes_written;
        }
        Ok(())
    })
}

/// The save's counters (see `fo_save_stats`). Never blocks.
#[no_mangle]
pub unsafe extern "C" fn fo_save_stats_get(
    save: *const fo_save,
    out: *mut fo_save_stats,
) -> fo_status {
    guard(|| {
        let s = enter(save, "fo_save_stats_get")?;
        let out = arg_mut(out, "out")?;
        let st = s.save.stats();
        *out = fo_save_stats {
            done: s.save.is_done() as i32,
            bytes_written: st.bytes_written,
            bytes_total: st.bytes_total,
            staging_high_water: st.staging_high_water,
            staging_budget: st.staging_budget,
            device_staged: st.device_staged,
            copies: st.copies,
        };
        Ok(())
    })
}

/// Frees a save (NULL is a no-op), after waiting for its writer thread. A save with a
/// communicator that was never waited for is not committed (its staged files are removed
/// by a later commit in the same directory). A call in progress on another thread is
/// waited for first, as for every handle.
#[no_mangle]
pub unsafe extern "C" fn fo_save_destroy(save: *mut fo_save) {
    guard_void(|| destroy(save, "fo_save_destroy"))
}
