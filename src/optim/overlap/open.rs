//! What the optimizer holds while an overlapped step is open (`overlap.rs`): the step's
//! options and counters, the gradients handed over, and the tasks still out on the pool.
use super::device_early::DeviceUndo;
use super::task::Inbox;
use crate::error::Error;
use crate::tensor::TensorView;

/// How an overlapped step clips and how much it may keep to undo early steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OverlapOptions {
    /// Clip the gradients' total norm to this (torch's `clip_grad_norm_`); <= 0: no clipping.
    pub max_norm: f64,
    /// The norm's order: > 0, or `f64::INFINITY` for the max norm (default 2).
    pub norm_type: f64,
    /// A non-finite total norm fails the step (nothing changed, nothing scaled).
    pub error_if_nonfinite: bool,
    /// The most the undo records of early steps may hold (parameter bytes + state bytes);
    /// a parameter that would pass it waits for `step_end`. `usize::MAX`: no bound.
    pub undo_budget_bytes: usize,
}

impl Default for OverlapOptions {
    fn default() -> Self {
        OverlapOptions {
            max_norm: 0.0,
            norm_type: 2.0,
            error_if_nonfinite: false,
            undo_budget_bytes: usize::MAX,
        }
    }
}

impl OverlapOptions {
    pub(super) fn clipping(&self) -> bool {
        self.max_norm > 0.0
    }
}

/// What an overlapped step did (filled by `step_end`, also when it fails).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OverlapStats {
    /// Parameters whose gradients were handed over.
    pub handed_over: u64,
    /// Of those, stepped before `step_end` (speculatively, with an undo record): on the
    /// pool, or on a device's step lane for a device parameter.
    pub speculative: u64,
    /// Of those, kept for `step_end` (past the undo budget, no device memory for a device
    /// parameter's record, or handed over as the step ends).
    pub deferred: u64,
    /// Early steps undone (the clip scaled the gradients, or the step failed).
    pub rolled_back: u64,
    /// Bytes the rollbacks copied back (parameters and state).
    pub rolled_back_bytes: u64,
    /// Time spent rolling back, in nanoseconds.
    pub rollback_ns: u64,
    /// The most the undo records held at once.
    pub undo_high_water_bytes: u64,
    /// The total gradient norm (`clip_grad_norm`'s bits); -1 when not clipping.
    pub total_norm: f64,
    /// The clip coefficient was below 1: the gradients were scaled and re-stepped.
    pub clipped: bool,
}

/// A handed-over gradient.
pub(super) struct Given {
    pub grad: TensorView,
    pub early: bool,
}

/// The step in progress (`Optimizer::open`).
///
/// SAFETY (the invariant that makes the background work sound): a parameter handed to
/// the pool is touched by its task alone until `step_end` (or drop) has waited for it.
/// Its state is moved out of the optimizer's table into the task, so nothing else can
/// reach it; its memory is written through the task's view, and nothing else reads or
/// writes it because (1) a parameter is handed over once per step (`ready twice` is
/// refused), (2) while a step is open every other call that reads or writes parameters or
/// state refuses (`refuse_if_step_open` in the core's mutators; the C ABI refuses every
/// other call on the handle), (3) registration keeps parameter memory disjoint and
/// `check_grad` keeps gradients off it, (4) `step_end` and `Drop` wait for every task
/// before anything else touches the memory, and the caller keeps gradients valid and
/// unchanged until `step_end` (the contract of `grads_ready`).
pub(crate) struct OpenStep {
    pub(super) opts: OverlapOptions,
    pub(super) given: Vec<Option<Given>>,
    pub(super) inbox: std::sync::Arc<Inbox>,
    /// Kept alive (and so its threads) until every task is back.
    pub(super) pool: std::sync::Arc<rayon::ThreadPool>,
    pub(super) undo_bytes: usize,
    /// The clip was found certain to scale (`overlap::clip_is_certain`): it stays so.
    pub(super) clip_certain: bool,
    /// The first bad gradient handed over: the step fails at `step_end`.
    pub(super) failed: Option<Error>,
    pub(super) stats: OverlapStats,
    /// The undo records of device parameters stepped early (`device_early`).
    pub(super) device: Vec<DeviceUndo>,
}

impl Drop for OpenStep {
    /// An open step dropped without `step_end` (the optimizer destroyed meanwhile) is
    /// abandoned: waits for its tasks (and early device steps), then puts the parameters'
    /// memory back.
    fn drop(&mut self) {
        for d in self.inbox.wait_all() {
            // SAFETY: the task is over; the parameter memory outlives the optimizer.
            unsafe { d.restore_memory() };
        }
        // SAFETY: as above; the copies back are waited for.
        unsafe { DeviceUndo::restore_params_and_free(std::mem::take(&mut self.device)) };
    }
}

pub(super) fn no_step(call: &str) -> Error {
    Error::invalid(
        "opt",
        format!("{call}: no overlapped step is open (call step_begin first)"),
    )
}
