//! The optimizer's side of an async save (`ckpt::async_save`): the hook every mutation
//! of a parameter's state or memory calls first, the detached view the save's writer
//! reads the tables through, and the drop that waits for the writer.
use std::sync::Arc;

use super::optimizer::{Optimizer, Param};
use crate::ckpt::snapshot::{Snapshot, StepMark};
use crate::error::Result;
use crate::optim::math::state::ParamState;

impl Drop for Optimizer {
    /// Never frees state a save in flight still reads: waits for its writer to let go.
    fn drop(&mut self) {
        if let Some(s) = self.save.take() {
            s.wait_released();
        }
    }
}

impl Optimizer {
    /// Called before anything writes parameter `i`'s state or memory: while an async save
    /// still needs them, they are copied for it first (or this waits for its writer).
    pub(crate) fn before_write(&self, i: usize) -> Result<()> {
        match &self.save {
            Some(s) => s.before_write(self, i),
            None => Ok(()),
        }
    }

    /// While the returned mark lives, an async save's writer pauses before its next fetch
    /// (unless a mutator waits for it): the step runs without it on the cores.
    pub(crate) fn mark_step(&self) -> Option<StepMark> {
        self.save_in_flight().map(|s| s.mark_step())
    }

    /// Detaches the last async save's snapshot (to wait for it and recycle its pool).
    pub(crate) fn take_save(&mut self) -> Option<Arc<Snapshot>> {
        self.save.take()
    }

    /// The last async save's snapshot, still attached (in flight or not).
    pub(crate) fn last_save(&self) -> Option<&Arc<Snapshot>> {
        self.save.as_ref()
    }

    /// Attaches a new async save's snapshot: from now on `before_write` serves it.
    pub(crate) fn attach_save(&mut self, snap: Arc<Snapshot>) {
        self.save = Some(snap);
    }

    /// Parameter `i`'s host state as stored (None for a device parameter or before its
    /// first step), for the save's shallow copies (`ckpt::live_reader::LiveReader`).
    pub(crate) fn host_state(&self, i: usize) -> Option<&ParamState> {
        self.params[i].state.as_ref()
    }

    /// The async save still reading this optimizer, if any.
    pub(crate) fn save_in_flight(&self) -> Option<&Arc<Snapshot>> {
        self.save.as_ref().filter(|s| s.is_reading())
    }

    /// A copy of the optimizer's tables (groups, parameter names, views and specs) with
    /// no state, for an async save's writer: what it reads of the optimizer besides the
    /// live state, so that nothing the caller's thread changes meanwhile is shared.
    pub(crate) fn detached_view(&self) -> Optimizer {
        Optimizer {
            groups: self.groups.clone(),
            params: self
                .params
                .iter()
                .map(|p| Param {
                    fqn: p.fqn.clone(),
                    tensor: p.tensor.clone(),
                    spec: p.spec.clone(),
                    group: p.group,
                    state: None,
                    device: p.device,
                    gpu: None,
                    mirror: None,
                })
                .collect(),
            ranges: Vec::new(),
            stream: self.stream,
            save: None,
            open: None,
            undo_spares: Vec::new(),
            resident: Default::default(),
        }
    }
}
