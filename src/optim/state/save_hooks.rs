//! The optimizer's side of an async save (`ckpt::async_save`): the hook every mutation
//! of a parameter's state or memory calls first, the detached view the save's writer
//! reads the tables through, and the drop that waits for the writer.
//!
//! The optimizer defines the hook ([`SaveHook`]) and checkpoints implement it (ckpt's
//! `Snapshot`): the optimizer sits below the checkpoints and never names them.
use std::any::Any;
use std::sync::Arc;

use crate::error::Result;
use crate::optim::math::state::ParamState;
use crate::optim::optimizer::{Optimizer, Param};

/// What the optimizer calls on a save in flight (ckpt's `Snapshot` implements it).
pub(crate) trait SaveHook: Send + Sync {
    /// Called before anything changes parameter `i`'s state or memory: copies what the
    /// save still needs of it, or waits for the save's writer.
    fn before_write(&self, opt: &Optimizer, i: usize) -> Result<()>;
    /// Whether the save's writer still reads the optimizer.
    fn is_reading(&self) -> bool;
    /// Blocks until the save's writer no longer reads the optimizer.
    fn wait_released(&self);
    /// A step starts: the writer pauses before its next fetch until [`SaveHook::end_step`].
    fn begin_step(&self);
    /// The step begun by [`SaveHook::begin_step`] has ended: the writer goes on.
    fn end_step(&self);
    /// The hook as `Any`, for the checkpoint side to get its concrete type back.
    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
}

/// The last async save's snapshot, attached or not: the optimizer holds it (`save`) and
/// only this file opens it; every mutation of a parameter's state or memory calls
/// `before_write` first while it is read.
#[derive(Default)]
pub(in crate::optim) struct SaveSlot(Option<Arc<dyn SaveHook>>);

/// A step in progress, as a save in flight sees it (`Optimizer::mark_step`); dropping it
/// lets the save's writer go on.
pub(crate) struct StepMark(Arc<dyn SaveHook>);

impl Drop for StepMark {
    fn drop(&mut self) {
        self.0.end_step();
    }
}

impl Drop for Optimizer {
    /// Never frees state a save in flight still reads: waits for its writer to let go.
    fn drop(&mut self) {
        if let Some(s) = self.save_slot_mut().0.take() {
            s.wait_released();
        }
    }
}

impl Optimizer {
    /// Called before anything writes parameter `i`'s state or memory: while an async save
    /// still needs them, they are copied for it first (or this waits for its writer).
    pub(crate) fn before_write(&self, i: usize) -> Result<()> {
        match &self.save_slot().0 {
            Some(s) => s.before_write(self, i),
            None => Ok(()),
        }
    }

    /// While the returned mark lives, an async save's writer pauses before its next fetch
    /// (unless a mutator waits for it): the step runs without it on the cores.
    pub(crate) fn mark_step(&self) -> Option<StepMark> {
        self.save_in_flight().map(|s| {
            s.begin_step();
            StepMark(s.clone())
        })
    }

    /// Detaches the last async save's snapshot (to wait for it and recycle its pool).
    pub(crate) fn take_save(&mut self) -> Option<Arc<dyn SaveHook>> {
        self.save_slot_mut().0.take()
    }

    /// The last async save's snapshot, still attached (in flight or not).
    pub(crate) fn last_save(&self) -> Option<&Arc<dyn SaveHook>> {
        self.save_slot().0.as_ref()
    }

    /// Attaches a new async save's snapshot: from now on `before_write` serves it.
    pub(crate) fn attach_save(&mut self, snap: Arc<dyn SaveHook>) {
        self.save_slot_mut().0 = Some(snap);
    }

    /// Parameter `i`'s host state as stored (None for a device parameter or before its
    /// first step), for the save's shallow copies (`ckpt::live_reader::LiveReader`).
    pub(crate) fn host_state(&self, i: usize) -> Option<&ParamState> {
        self.entry(i).state.as_ref()
    }

    /// The async save still reading this optimizer, if any.
    pub(in crate::optim) fn save_in_flight(&self) -> Option<&Arc<dyn SaveHook>> {
        self.save_slot().0.as_ref().filter(|s| s.is_reading())
    }

    /// A copy of the optimizer's tables (groups, parameter names, views and specs) with
    /// no state, for an async save's writer: what it reads of the optimizer besides the
    /// live state, so that nothing the caller's thread changes meanwhile is shared.
    pub(crate) fn detached_view(&self) -> Optimizer {
        let params = self
            .entries()
            .iter()
            .map(|p| {
                let fqn = p.fqn().to_string();
                Param::new(fqn, p.tensor().clone(), p.spec().cloned(), p.group())
            })
            .collect();
        Optimizer::with_tables(self.groups().to_vec(), params, self.stream())
    }
}
