//! The device half of `Optimizer::step`: parameters registered on a CUDA device step
//! on it, one launch per (param group, device) over a tensor table (`step_table`), on the
//! optimizer's stream. Prepared (validated, state allocated, tables built) before the
//! step changes anything, then launched before the CPU half runs, so both run at once.
//!
//! The host cost of a step whose pointers did not change is the table's build and
//! compare, and the launches: parameters were validated at registration, gradients are
//! looked up only outside memory already validated (`check::KnownMemory`), and the table
//! stays resident on the device, uploaded again only where it changed (`device_table`).
use std::collections::BTreeMap;

use super::DeviceState;
use crate::error::{Error, Result};
use crate::kernels::step_table::{build_table, FoRule, StateLayout, StepTable, TableEntry};
use crate::optim::math::rule::Rule;
use crate::optim::math::state::ParamState;
use crate::optim::optimizer::Optimizer;
use crate::tensor::{Device, TensorView};

/// A prepared device step: nothing in the optimizer has changed yet.
pub(crate) struct DeviceStep {
    /// State created by this step, kept only once the launches succeed.
    fresh: Vec<(usize, DeviceState)>,
    /// The device parameters this step advances.
    stepped: Vec<usize>,
    /// `(param group, device, table)`.
    tables: Vec<(usize, Device, StepTable)>,
}

impl Optimizer {
    /// Sets the `CUstream` device work is queued on (0: the legacy default stream). A
    /// stream belongs to one device: with a stream set, every device parameter, mirror
    /// and device gradient must be on that stream's device (refused here, at
    /// `add_param` / `set_mirror`, and at `step` before anything is queued;
    /// parameters on several devices take 0, each device's legacy stream). The new
    /// stream's work waits for what the old one had queued (an event per device), so
    /// step N on the old stream comes before step N+1 on the new one.
    pub fn set_stream(&mut self, stream: usize) -> Result<()> {
        crate::device::stream_support()?;
        if stream == self.stream() {
            return Ok(());
        }
        let devices = self.devices_in_use();
        for (d, what) in &devices {
            check_stream_on(*d, stream, what)?;
        }
        for (d, _) in &devices {
            // SAFETY: both streams were checked against the device (the old one when set).
            unsafe { crate::device::backend(*d)?.order_streams(self.stream(), stream)? };
        }
        self.store_stream(stream);
        Ok(())
    }

    /// Every device the optimizer queues work on (parameters', mirrors'), once each, with
    /// the first thing on it (for errors).
    fn devices_in_use(&self) -> Vec<(Device, String)> {
        let mut out: Vec<(Device, String)> = Vec::new();
        for p in self.entries() {
            let on = [
                (p.device(), format!("parameter {}", p.fqn())),
                (
                    p.mirror.as_ref().map_or(Device::Host, |m| m.device()),
                    format!("the mirror of parameter {}", p.fqn()),
                ),
            ];
            for (d, what) in on {
                if d.is_cuda() && !out.iter().any(|(o, _)| *o == d) {
                    out.push((d, what));
                }
            }
        }
        out
    }

    /// Checks that `what` (on `device`) can use the optimizer's stream.
    pub(in crate::optim) fn check_stream_for(&self, device: Device, what: &str) -> Result<()> {
        check_stream_on(device, self.stream(), what)
    }

    /// Parameter `i`'s state if it is in host memory and has one.
    pub fn param_state(&self, i: usize) -> Option<&ParamState> {
        self.entry(i).state.as_ref()
    }

    /// A host copy of device parameter `i`'s state, read after the work queued on the
    /// optimizer's stream (this waits for it).
    pub fn device_state(&self, i: usize) -> Result<ParamState> {
        self.check_index(i)?;
        let p = self.entry(i);
        if p.device().is_host() {
            return Err(Error::invalid(
                "index",
                format!("parameter {} is in host memory (see param_state)", p.fqn()),
            ));
        }
        self.staged_state(i)?
            .map(std::borrow::Cow::into_owned)
            .ok_or_else(|| {
                Error::NotFound(format!("parameter {} has no optimizer state yet", p.fqn()))
            })
    }

    /// Checks that gradient `g` (on its device) may step parameter `i`.
    pub(in crate::optim) fn check_grad_device(&self, i: usize, g: &TensorView) -> Result<()> {
        let p = self.entry(i);
        let device = g.device();
        // A device parameter's device was checked against the stream at registration and
        // at `set_stream`: its gradient, on the same device, needs no look-up per step.
        if device.is_cuda() && device != p.device() {
            self.check_stream_for(device, &format!("the gradient of {}", p.fqn()))?;
        }
        if p.device().is_cuda() && p.device() != device {
            return Err(Error::invalid(
                "grads",
                format!(
                    "gradient of {}: the parameter is on CUDA device {}, its gradient must be \
                     too (got device {})",
                    p.fqn(),
                    p.device().to_c(),
                    device.to_c()
                ),
            ));
        }
        // Named only for an error: this runs per gradient per step.
        let context = || format!("gradient of {}", p.fqn());
        if device.is_cuda() && p.device().is_host() {
            // The offload case: the gradient comes down to the host (`offload_step`);
            // looked up only outside memory already validated (`KnownMemory`).
            let mut known = self
                .resident()
                .known
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            // SAFETY: the address is only looked up.
            unsafe { known.check_tensor(g, &grad_arg(&context())) }?;
        } else if device.is_cuda() && !g.is_contiguous() {
            // A device parameter's device is open; its memory is checked with the
            // device half (`prepare_device_step`).
            crate::device::check::check_contiguous(g, &grad_arg(&context()))?;
        }
        Ok(())
    }

    /// Validates the device half and allocates the state it creates; changes nothing.
    ///
    /// # Safety
    /// As `step`.
    pub(in crate::optim) unsafe fn prepare_device_step(
        &self,
        grads: &[Option<TensorView>],
    ) -> Result<DeviceStep> {
        let given: Vec<(usize, &TensorView)> = (grads.iter().enumerate())
            .filter_map(|(i, g)| g.as_ref().map(|g| (i, g)))
            .filter(|&(i, _)| self.entry(i).device().is_cuda())
            .collect();
        self.prepare_device_step_of(&given)
    }

    /// `prepare_device_step` for the device parameters `given` alone (index, gradient;
    /// by index), without a slot per parameter: what an overlapped step's hand-over of
    /// one bucket costs does not grow with the model.
    ///
    /// # Safety
    /// As `step`.
    pub(in crate::optim) unsafe fn prepare_device_step_of(
        &self,
        given: &[(usize, &TensorView)],
    ) -> Result<DeviceStep> {
        let mut s = DeviceStep {
            fresh: Vec::new(),
            stepped: Vec::new(),
            tables: Vec::new(),
        };
        // Refusals first, before any device memory is allocated or anything queued.
        for &(i, g) in given {
            let p = self.entry(i);
            let cfg = self.config(p.group());
            if cfg.check_numerics {
                return Err(Error::Unsupported(format!(
                    "parameter {} is on CUDA device {}: check_numerics reads gradients on the \
                     host and is not available for device parameters (turn it off for group {})",
                    p.fqn(),
                    p.device().to_c(),
                    p.group()
                )));
            }
            let next = p.gpu.as_ref().map_or(1, |st| st.step + 1);
            FoRule::new(&Rule::new(cfg, next)).map_err(|e| match e {
                Error::Unsupported(m) => Error::Unsupported(format!("parameter {}: {m}", p.fqn())),
                e => e,
            })?;
            // The gradient is memory of its parameter's device (looked up only outside
            // memory already validated: see `KnownMemory` for why that is sound).
            let mut known = self
                .resident()
                .known
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if !known.knows(g) {
                let context = format!("gradient of {}", p.fqn());
                known.check(g, &grad_arg(&context))?;
            }
        }
        let mut entries: BTreeMap<(usize, Device), Vec<TableEntry>> = BTreeMap::new();
        for &(i, g) in given {
            let p = self.entry(i);
            let cfg = self.config(p.group());
            let n = p.tensor().numel();
            let next = p.gpu.as_ref().map_or(1, |st| st.step + 1);
            let rule = Rule::new(cfg, next);
            let (m_valid, state) = match &p.gpu {
                Some(st) => (st.m_valid, st.ptrs()),
                None => {
                    let layout = StateLayout::of(cfg, p.tensor().dtype());
                    let st = DeviceState::zeroed(p.device(), layout, n, self.stream())?;
                    let ptrs = st.ptrs();
                    s.fresh.push((i, st));
                    (false, ptrs)
                }
            };
            s.stepped.push(i);
            entries
                .entry((p.group(), p.device()))
                .or_default()
                .push(TableEntry {
                    param: p.tensor().as_ptr() as u64,
                    param_dtype: p.tensor().dtype(),
                    grad: g.as_ptr() as u64,
                    grad_dtype: g.dtype(),
                    numel: n,
                    state,
                    rule,
                    first: !m_valid,
                });
        }
        for ((group, device), e) in entries {
            s.tables.push((group, device, build_table(&e)?));
        }
        Ok(s)
    }

    /// Launches a prepared device step on `stream` (the optimizer's, or an overlapped
    /// step's step lane) and records it (step counters, new state).
    ///
    /// # Safety
    /// As `step`; `stream` is the optimizer's or one of the parameters' device ordered
    /// after it.
    pub(in crate::optim) unsafe fn run_device_step(
        &mut self,
        s: DeviceStep,
        stream: usize,
    ) -> Result<()> {
        if s.stepped.is_empty() {
            return Ok(());
        }
        for (group, device, t) in &s.tables {
            self.resident_mut()
                .tables
                .launch(*group, *device, t, stream)?;
        }
        for (i, st) in s.fresh {
            self.entry_mut(i).gpu = Some(st);
        }
        for i in s.stepped {
            let st = self
                .entry_mut(i)
                .gpu
                .as_mut()
                .expect("allocated in prepare");
            st.step += 1;
            st.m_valid = true;
        }
        Ok(())
    }
}

/// A gradient as errors name it.
fn grad_arg(context: &str) -> crate::device::check::DeviceArg<'_> {
    crate::device::check::DeviceArg {
        arg: "grads",
        context,
        noun: "gradient",
        by_arg: false,
    }
}

/// Checks that `stream` is one of `device`'s, naming `what` lives there when it is not.
fn check_stream_on(device: Device, stream: usize, what: &str) -> Result<()> {
    if stream == 0 {
        return Ok(());
    }
    // SAFETY: the caller's stream handle (`set_stream`'s contract: live while set).
    let r = unsafe { crate::device::backend(device)?.check_stream(stream) };
    r.map_err(|e| match e {
        Error::InvalidArgument { reason, .. } => Error::invalid(
            "stream",
            format!(
                "{what} is on CUDA device {}, and the optimizer's stream is not a stream \
                 of that device: {reason}. fo queues all of an optimizer's device work on its \
                 one stream: use one optimizer per device, or the legacy default stream (NULL)",
                device.to_c()
            ),
        ),
        e => e,
    })
}

#[cfg(test)]
#[path = "device_step_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "stream_tests.rs"]
mod stream_tests;

#[cfg(test)]
#[path = "device_table_tests.rs"]
mod device_table_tests;
