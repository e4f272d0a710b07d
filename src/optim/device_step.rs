//! The device half of `Optimizer::step_on`: parameters registered on a CUDA device step
//! on it, one launch per (param group, device) over a tensor table (`gpu::table`), on the
//! optimizer's stream. Prepared (validated, state allocated, tables built) before the
//! step changes anything, then launched before the CPU half runs, so both run at once.
use std::collections::BTreeMap;

use super::gpu::table::{build_table, FoRule, StateLayout, StepTable, TableEntry};
use super::gpu::{self, DeviceState};
use super::optimizer::Optimizer;
use super::rule::Rule;
use super::state::ParamState;
use crate::error::{Error, Result};
use crate::tensor::HostTensor;

/// A prepared device step: nothing in the optimizer has changed yet.
pub(crate) struct DeviceStep {
    /// State created by this step, kept only once the launches succeed.
    fresh: Vec<(usize, DeviceState)>,
    /// The device parameters this step advances.
    stepped: Vec<usize>,
    tables: Vec<(i32, StepTable)>,
}

impl Optimizer {
    /// Sets the `CUstream` device steps are launched on (0: the legacy default stream).
    pub fn set_stream(&mut self, stream: usize) -> Result<()> {
        gpu::stream_support()?;
        self.stream = stream;
        Ok(())
    }

    pub fn stream(&self) -> usize {
        self.stream
    }

    /// Parameter `i`'s state if it is in host memory and has one.
    pub fn param_state(&self, i: usize) -> Option<&ParamState> {
        self.params[i].state.as_ref()
    }

    /// A host copy of device parameter `i`'s state, read after the work queued on the
    /// optimizer's stream (this waits for it).
    pub fn device_state(&self, i: usize) -> Result<ParamState> {
        self.check_index(i)?;
        let p = &self.params[i];
        if p.device < 0 {
            return Err(Error::invalid(
                "index",
                format!("parameter {} is in host memory (see param_state)", p.fqn),
            ));
        }
        self.staged_state(i)?
            .map(std::borrow::Cow::into_owned)
            .ok_or_else(|| {
                Error::NotFound(format!("parameter {} has no optimizer state yet", p.fqn))
            })
    }

    /// Checks that gradient `g` (on `device`) may step parameter `i`.
    pub(crate) fn check_grad_device(&self, i: usize, g: &HostTensor, device: i32) -> Result<()> {
        let p = &self.params[i];
        if p.device == -1 && device >= 0 {
            // The offload case: the gradient comes down to the host (`offload_step`).
            if !g.is_contiguous() {
                return Err(Error::invalid(
                    "grads",
                    format!(
                        "gradient of {}: a device gradient must be contiguous (strides {:?} for shape {:?})",
                        p.fqn,
                        g.strides(),
                        g.shape()
                    ),
                ));
            }
            return gpu::open_device(device).map_err(|e| match e {
                Error::Unsupported(m) => Error::Unsupported(format!("gradient of {}: {m}", p.fqn)),
                e => e,
            });
        }
        if p.device != device {
            return Err(Error::invalid(
                "grads",
                format!(
                    "gradient of {}: the parameter is on CUDA device {}, its gradient must be \
                     too (got device {device})",
                    p.fqn, p.device
                ),
            ));
        }
        if device >= 0 && !g.is_contiguous() {
            return Err(Error::invalid(
                "grads",
                format!(
                    "gradient of {}: a device gradient must be contiguous (strides {:?} for \
                     shape {:?})",
                    p.fqn,
                    g.strides(),
                    g.shape()
                ),
            ));
        }
        Ok(())
    }

    /// Validates the device half and allocates the state it creates; changes nothing.
    ///
    /// # Safety
    /// As `step_on`.
    pub(crate) unsafe fn prepare_device_step(
        &self,
        grads: &[Option<HostTensor>],
    ) -> Result<DeviceStep> {
        let mut s = DeviceStep {
            fresh: Vec::new(),
            stepped: Vec::new(),
            tables: Vec::new(),
        };
        let mut entries: BTreeMap<(usize, i32), Vec<TableEntry>> = BTreeMap::new();
        for (i, p) in self.params.iter().enumerate() {
            let (Some(g), true) = (&grads[i], p.device >= 0) else {
                continue;
            };
            let cfg = &self.groups[p.group];
            if cfg.check_numerics {
                return Err(Error::Unsupported(format!(
                    "parameter {} is on CUDA device {}: check_numerics reads gradients on the \
                     host and is not available for device parameters (turn it off for group {})",
                    p.fqn, p.device, p.group
                )));
            }
            let n = p.tensor.numel();
            let next = p.gpu.as_ref().map_or(1, |st| st.step + 1);
            let rule = Rule::new(cfg, next);
            // Refused before any device memory is allocated.
            FoRule::new(&rule).map_err(|e| match e {
                Error::Unsupported(m) => Error::Unsupported(format!("parameter {}: {m}", p.fqn)),
                e => e,
            })?;
            let (m_valid, state) = match &p.gpu {
                Some(st) => (st.m_valid, st.ptrs()),
                None => {
                    let layout = StateLayout::of(cfg, p.tensor.dtype());
                    let st = DeviceState::zeroed(p.device, layout, n, self.stream)?;
                    let ptrs = st.ptrs();
                    s.fresh.push((i, st));
                    (false, ptrs)
                }
            };
            s.stepped.push(i);
            entries
                .entry((p.group, p.device))
                .or_default()
                .push(TableEntry {
                    param: p.tensor.as_ptr() as u64,
                    param_dtype: p.tensor.dtype(),
                    grad: g.as_ptr() as u64,
                    grad_dtype: g.dtype(),
                    numel: n,
                    state,
                    rule,
                    first: !m_valid,
                });
        }
        for ((_, device), e) in entries {
            s.tables.push((device, build_table(&e)?));
        }
        Ok(s)
    }

    /// Launches a prepared device step and records it (step counters, new state).
    ///
    /// # Safety
    /// As `step_on`.
    pub(crate) unsafe fn run_device_step(&mut self, s: DeviceStep) -> Result<()> {
        if s.stepped.is_empty() {
            return Ok(());
        }
        gpu::launch_tables(&s.tables, self.stream)?;
        for (i, st) in s.fresh {
            self.params[i].gpu = Some(st);
        }
        for i in s.stepped {
            let st = self.params[i].gpu.as_mut().expect("allocated in prepare");
            st.step += 1;
            st.m_valid = true;
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "device_step_tests.rs"]
mod tests;
