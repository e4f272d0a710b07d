//! Parameters and state wherever they live, seen from the host: the entry points that
//! read or write state and parameter bytes (state by key, checkpoints) go through these,
//! so a device parameter's state is staged through host memory (read after the work on
//! the optimizer's stream, written back in order on it) and everything above sees the
//! same `ParamState` and bytes a host parameter has. A checkpoint of device state is
//! therefore the bytes of one written from the same state on the host.
use std::borrow::Cow;

use crate::device::open::{read_tensor, write_tensor};
use crate::error::Result;
use crate::kernels::step_table::StateLayout;
use crate::optim::math::state::ParamState;
use crate::optim::optimizer::Optimizer;
use crate::optim::placement::DeviceState;
use crate::tensor::Tensor;

/// One parameter read once for several of its state entries (a checkpoint's keys): its
/// state staged once (borrowed for a host parameter, read back once for a device one),
/// its elements read on first use.
pub(crate) struct StagedParam<'a> {
    pub(crate) i: usize,
    pub(crate) state: Option<Cow<'a, ParamState>>,
    pub(crate) param: Option<Tensor>,
}

impl StagedParam<'_> {
    /// The parameter's elements as stored, read on the first call (kept in `param`).
    pub(crate) fn param(&mut self, opt: &Optimizer) -> Result<&Tensor> {
        if self.param.is_none() {
            self.param = Some(opt.param_tensor(self.i)?);
        }
        Ok(self.param.as_ref().expect("read above"))
    }
}

/// What `snapshot` saves of a parameter, for `restore` after a failed load.
pub(crate) struct Snapshot {
    state: Option<ParamState>,
    param: Tensor,
}

impl Optimizer {
    /// Parameter `i`'s state in host memory: borrowed for a host parameter, read back for
    /// a device one (this waits for the work queued on the optimizer's stream). None
    /// before its first step.
    pub(crate) fn staged_state(&self, i: usize) -> Result<Option<Cow<'_, ParamState>>> {
        let p = self.entry(i);
        if p.device().is_host() {
            return Ok(p.state.as_ref().map(Cow::Borrowed));
        }
        match &p.gpu {
            None => Ok(None),
            // SAFETY: the optimizer's stream is the one the caller gave for its devices.
            Some(st) => Ok(Some(Cow::Owned(unsafe { st.to_host(self.stream())? }))),
        }
    }

    /// Parameter `i` staged for reading several entries (see `StagedParam`).
    pub(crate) fn stage(&self, i: usize) -> Result<StagedParam<'_>> {
        self.check_index(i)?;
        Ok(StagedParam {
            i,
            state: self.staged_state(i)?,
            param: None,
        })
    }

    /// Parameter `i`'s elements as stored (read back from its device for a device one).
    pub(crate) fn param_tensor(&self, i: usize) -> Result<Tensor> {
        let p = self.entry(i);
        // SAFETY: registered params stay valid for the optimizer's lifetime, on their
        // device; the optimizer's stream is one of that device.
        let data = unsafe { read_tensor(p.tensor(), self.stream())? };
        Ok(Tensor {
            dtype: p.tensor().dtype(),
            shape: p.tensor().shape().to_vec(),
            data,
        })
    }

    /// Overwrites parameter `i`'s elements with `bytes` (its whole contiguous storage),
    /// and its mirror if it has one.
    pub(crate) fn write_param(&self, i: usize, bytes: &[u8]) -> Result<()> {
        self.before_write(i)?;
        let p = self.entry(i);
        // SAFETY: registered params stay valid and writable for the optimizer's lifetime.
        unsafe { write_tensor(p.tensor(), bytes, self.stream())? };
        self.refresh_mirror(i)
    }

    /// Makes `st` (laid out as `new_state(i)`) parameter `i`'s state: kept as is for a
    /// host parameter, written to the device for a device one (allocated there first if
    /// the parameter had no state).
    pub(in crate::optim) fn store_state(&mut self, i: usize, st: ParamState) -> Result<()> {
        self.before_write(i)?;
        let stream = self.stream();
        let layout = StateLayout::of(self.param_config(i), self.entry(i).tensor().dtype());
        let p = self.entry_mut(i);
        if p.device().is_host() {
            ParamState::replace_in(&mut p.state, Some(st));
            return Ok(());
        }
        let numel = p.tensor().numel();
        // SAFETY: the optimizer's stream is one of the parameter's device.
        unsafe {
            let mut g = match p.gpu.take() {
                Some(g) => g,
                None => DeviceState::zeroed(p.device(), layout, numel, stream)?,
            };
            let r = g.upload(st, stream);
            p.gpu = Some(g);
            r
        }
    }

    /// Parameter `i`'s state and bytes, for `restore`.
    pub(crate) fn snapshot(&self, i: usize) -> Result<Snapshot> {
        Ok(Snapshot {
            state: self.staged_state(i)?.map(Cow::into_owned),
            param: self.param_tensor(i)?,
        })
    }

    /// Puts parameter `i` back as `snapshot` found it.
    pub(crate) fn restore(&mut self, i: usize, s: Snapshot) -> Result<()> {
        self.write_param(i, &s.param.data)?;
        match s.state {
            Some(st) => self.store_state(i, st),
            None => {
                let p = self.entry_mut(i);
                (p.state, p.gpu) = (None, None);
                Ok(())
            }
        }
    }
}

#[cfg(test)]
#[path = "staging_tests.rs"]
mod tests;
