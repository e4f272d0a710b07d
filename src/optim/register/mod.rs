//! Registration: parameters (`add_param`, checked, then entered in the handle's table)
//! and param groups (`add_param_group`, `set_group_lr`, `set_group_config`), and
//! `param_groups` as torch shows them (`groups_json`).
mod groups_json;

use crate::error::{Error, Result};
use crate::optim::math::config::OptimConfig;
use crate::optim::math::master_split::Half;
use crate::optim::optimizer::{is_param_dtype, Optimizer, Param};
use crate::shard::ShardSpec;
use crate::tensor::TensorView;

impl Optimizer {
    /// Adds a param group; returns its index.
    pub fn add_param_group(&mut self, cfg: OptimConfig) -> Result<usize> {
        cfg.validate()?;
        Ok(self.push_group(cfg))
    }

    /// Sets a group's learning rate (schedules call this between steps).
    pub fn set_group_lr(&mut self, group: usize, lr: f64) -> Result<()> {
        self.check_group(group)?;
        let mut c = self.config(group).clone();
        c.lr = lr;
        self.set_group_config(group, c)
    }

    /// Replaces a group's hyper-parameters. The algorithm, state format and master weight
    /// bits fix the layout of state already created, so they cannot change; nor can SGD's
    /// momentum be turned on once a parameter of the group was stepped without it.
    pub fn set_group_config(&mut self, group: usize, cfg: OptimConfig) -> Result<()> {
        self.check_group(group)?;
        self.refuse_if_step_open("set_group_config")?;
        cfg.validate()?;
        let old = self.config(group);
        for (name, same) in [
            ("algorithm", old.algorithm == cfg.algorithm),
            ("state_format", old.state_format == cfg.state_format),
            (
                "master_weight_bits",
                old.master_weight_bits == cfg.master_weight_bits,
            ),
        ] {
            if !same {
                return Err(Error::invalid(
                    name,
                    format!("cannot change group {group}'s {name} after creation"),
                ));
            }
        }
        // SGD without momentum creates no momentum buffer: state stepped that way has no
        // place for one (fo.torch registers such parameters again, as torch starts a buffer).
        if !old.has_momentum_state() && cfg.has_momentum_state() {
            let stepped = self
                .params()
                .iter()
                .find(|p| p.group() == group && (p.state.is_some() || p.gpu.is_some()));
            if let Some(p) = stepped {
                return Err(Error::invalid(
                    "momentum",
                    format!(
                        "cannot turn momentum on in group {group}: parameter {} was stepped \
                         without it and has no momentum buffer (register it again)",
                        p.fqn()
                    ),
                ));
            }
        }
        self.replace_group(group, cfg);
        Ok(())
    }

    /// Puts group `g`'s hyper-parameters back to `cfg`, as they were before a failed
    /// load (unchecked: `cfg` is the group's own earlier config).
    pub(crate) fn restore_group_config(&mut self, g: usize, cfg: OptimConfig) {
        self.replace_group(g, cfg);
    }

    /// Registers a parameter (caller memory, updated in place by every step; it must stay
    /// valid for the optimizer's lifetime). Returns its index. A parameter on a CUDA
    /// device keeps its state there; that device's kernels are compiled here on first
    /// use, so a device that cannot step is refused at registration.
    ///
    /// # Safety
    /// `param` must point to memory valid for reads and writes until the optimizer is
    /// dropped (memory of its device).
    pub unsafe fn add_param(
        &mut self,
        fqn: &str,
        param: TensorView,
        spec: Option<ShardSpec>,
        group: usize,
    ) -> Result<usize> {
        if param.device().is_cuda() {
            // Errors say "device = N: why"; as an argument, that is `param.device`.
            crate::device::open_device(param.device()).map_err(|e| match e {
                Error::Unsupported(m) => Error::Unsupported(format!("param.{m}")),
                e => e,
            })?;
            // Contiguity is `register`'s (the same rule as host parameters).
            let context = format!("parameter {fqn}");
            let a = crate::device::check::DeviceArg {
                arg: "param",
                context: &context,
                noun: "parameter",
                by_arg: false,
            };
            crate::device::check::check_memory(&param, &a)?;
        }
        self.register(fqn, param, spec, group)
    }

    /// `add_param` once the device is known to step (tests register device params
    /// here on machines without one: their memory is never touched on the host).
    pub(in crate::optim) unsafe fn register(
        &mut self,
        fqn: &str,
        param: TensorView,
        spec: Option<ShardSpec>,
        group: usize,
    ) -> Result<usize> {
        self.check_group(group)?;
        self.refuse_if_step_open("add_param")?;
        if self.save_in_flight().is_some() {
            // The writer reads parameters through the table; it must not move.
            return Err(Error::invalid(
                "param",
                format!(
                    "cannot register parameter {fqn:?} while an async checkpoint save reads the optimizer: \
                     wait for the save (fo_save_wait) first"
                ),
            ));
        }
        if fqn.is_empty() {
            return Err(Error::invalid("fqn", "empty parameter name"));
        }
        if param.device().is_cuda() {
            self.check_stream_for(param.device(), &format!("parameter {fqn}"))?;
        }
        if self.entries().iter().any(|p| p.fqn() == fqn) {
            return Err(Error::invalid(
                "fqn",
                format!("parameter {fqn:?} is already registered"),
            ));
        }
        if !is_param_dtype(param.dtype()) {
            return Err(Error::Dtype(format!(
                "parameter {fqn}: dtype {} is not one of F32, BF16, F16",
                param.dtype()
            )));
        }
        if !param.is_contiguous() {
            return Err(Error::invalid(
                "param.strides",
                format!(
                    "parameter {fqn}: strides {:?} for shape {:?} are not contiguous; fo updates parameters in place \
                     and needs contiguous memory (pass the contiguous storage)",
                    param.strides(),
                    param.shape()
                ),
            ));
        }
        let cfg = self.config(group);
        if cfg.master_weight_bits != 0 {
            Half::from_dtype(param.dtype())
                .map_err(|e| Error::Dtype(format!("parameter {fqn}: {e}")))?;
        }
        if let Some(other) = self.overlapping_param(&param) {
            return Err(Error::invalid(
                "param",
                format!(
                    "parameter {fqn}'s memory overlaps parameter {}'s; each parameter needs its own storage",
                    self.param_fqn(other)
                ),
            ));
        }
        if let Some(s) = &spec {
            if s.local_shape() != param.shape() {
                return Err(Error::Shape(format!(
                    "parameter {fqn}: shard spec gives local shape {:?} but the tensor has shape {:?}",
                    s.local_shape(),
                    param.shape()
                )));
            }
        }
        Ok(self.push_param(Param::new(fqn.to_string(), param, spec, group)))
    }
}
