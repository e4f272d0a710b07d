//! The optimizer handle: param groups, registered parameters (borrowed memory, updated
//! in place: host memory, or CUDA device memory with feature `cuda`), lazily created
//! state, and the accessors. The step's entry is in `step`, its device half in
//! `device_step`; the hooks of an async save in flight in `save_hooks`.
//!
//! Who may touch what (files under `optim`; r: reads, w: writes). Only `params` is a
//! field the concern modules reach; the rest are private, behind methods:
//! - `groups`: w here only (`add_param_group`, `set_group_config`, `restore_group_config`);
//!   r by `step`, `numerics`, `overlap`, `state_io`, `state_set`, `groups_json`,
//!   `save_hooks` and `placement` through `config`, `param_config`, `groups` and, beside
//!   mutable parameters, `params_mut_with_groups`.
//! - `params`: pushed here only. A `Param`'s `fqn`, `tensor`, `spec`, `group` and
//!   `device` are fixed at registration (written here and in `save_hooks`' detached copy);
//!   `state` is w by `step`, `numerics` (undo), `overlap`, `overlap_end` and `staging`;
//!   `gpu` by `device_step` and `staging`; `mirror` by `offload_step` (`set_mirror`).
//! - `ranges`: here only (registration, `overlapping_param`).
//! - `stream`: r by all through `stream()`; w only by `set_stream` (`device_step`) through
//!   `store_stream`.
//! - `save`: a `SaveSlot` that only `save_hooks` opens; the others call `before_write`,
//!   `mark_step` and `save_in_flight`.
//! - `open`, `undo_spares`: the overlapped step's (`overlap`, `overlap_end`), through
//!   `open_step*`, `take_open_step` and `undo_spares_mut`; the others `refuse_if_step_open`.
//! - `resident`: `device_step`'s, through `resident` / `resident_mut`.
use super::math::config::OptimConfig;
use super::overlap::open::OpenStep;
use super::overlap::task::Saved;
use super::placement::Mirror;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::step_table::StateLayout;
use crate::optim::math::master_split::Half;
use crate::optim::math::state::ParamState;
use crate::optim::placement::DeviceState;
use crate::shard::ShardSpec;
use crate::tensor::{Device, TensorView};

use super::state::save_hooks::SaveSlot;

pub(super) struct Param {
    pub(super) fqn: String,
    pub(super) tensor: TensorView,
    pub(super) spec: Option<ShardSpec>,
    pub(super) group: usize,
    pub(super) state: Option<ParamState>,
    /// The state of a device parameter (`state` stays None for it).
    pub(super) gpu: Option<DeviceState>,
    /// A device copy of a host parameter, rewritten after each change (`set_mirror`).
    pub(super) mirror: Option<Mirror>,
}

impl Param {
    /// The device holding the parameter (and, on a CUDA device, its state).
    pub(super) fn device(&self) -> Device {
        self.tensor.device()
    }
}

/// An optimizer over parameters in caller memory. Group 0 is the config given to `new`.
pub struct Optimizer {
    groups: Vec<OptimConfig>,
    pub(super) params: Vec<Param>,
    /// Address ranges of the non-empty params, `(start, end, index)`, sorted and disjoint.
    ranges: Vec<(usize, usize, usize)>,
    /// The `CUstream` device steps run on (0: the legacy default stream).
    stream: usize,
    /// The snapshot of the last async save (`ckpt::async_save`): every mutation of a
    /// parameter's state or memory calls `before_write` first while it is read.
    save: SaveSlot,
    /// The overlapped step in progress (`overlap`), if any: while it is open every other
    /// call that reads or writes parameters or state refuses (`refuse_if_step_open`).
    open: Option<Box<OpenStep>>,
    /// The undo records of the last overlapped step, by parameter, kept for the next one
    /// to fill (`overlap::task::prepare`): an overlapped step then allocates nothing, and
    /// they never hold more than one step's undo high water.
    undo_spares: Vec<Option<Saved>>,
    /// What device steps keep from one step to the next: validated device memory and
    /// resident launch tables (`placement::device_table`).
    resident: DeviceResident,
}

/// What device steps reuse across steps, so a step's host cost does not grow with the
/// pointer checks and table uploads of unchanged tensors.
#[derive(Default)]
pub(super) struct DeviceResident {
    /// Device memory validated for gradients (a lock: gradients are checked under `&self`).
    pub(super) known: std::sync::Mutex<crate::device::check::KnownMemory>,
    pub(super) tables: super::placement::device_table::ResidentTables,
}

/// The bytes a view spans, first to last element (None when empty).
fn address_range(t: &TensorView) -> Option<(usize, usize)> {
    if t.numel() == 0 {
        return None;
    }
    let extent: usize = t
        .shape()
        .iter()
        .zip(t.strides())
        .map(|(&n, &s)| (n - 1) * s)
        .sum::<usize>()
        + 1;
    let lo = t.as_ptr() as usize;
    Some((lo, lo + extent * t.dtype().size()))
}

pub(super) fn is_param_dtype(d: DType) -> bool {
    matches!(d, DType::F32 | DType::BF16 | DType::F16)
}

impl Optimizer {
    pub fn new(cfg: OptimConfig) -> Result<Optimizer> {
        cfg.validate()?;
        Ok(Optimizer::with_tables(vec![cfg], Vec::new(), 0))
    }

    /// An optimizer over `groups` and `params` on `stream` and nothing else (no address
    /// ranges, save, open step or resident tables): `new`'s, and `detached_view`'s.
    pub(super) fn with_tables(
        groups: Vec<OptimConfig>,
        params: Vec<Param>,
        stream: usize,
    ) -> Optimizer {
        Optimizer {
            groups,
            params,
            ranges: Vec::new(),
            stream,
            save: SaveSlot::default(),
            open: None,
            undo_spares: Vec::new(),
            resident: DeviceResident::default(),
        }
    }

    /// Every group's hyper-parameters, in order.
    pub(super) fn groups(&self) -> &[OptimConfig] {
        &self.groups
    }

    /// Group `g`'s hyper-parameters, for internal loops over known groups (unchecked).
    pub(super) fn config(&self, g: usize) -> &OptimConfig {
        &self.groups[g]
    }

    /// The parameters, mutable, beside the groups they read (a step borrows both).
    pub(super) fn params_mut_with_groups(&mut self) -> (&mut [Param], &[OptimConfig]) {
        (&mut self.params, &self.groups)
    }

    /// The `CUstream` device work is queued on (0: the legacy default stream).
    pub fn stream(&self) -> usize {
        self.stream
    }

    /// Keeps `stream` as the optimizer's: `set_stream`'s, once it has checked the stream
    /// and ordered it after the old one.
    pub(super) fn store_stream(&mut self, stream: usize) {
        self.stream = stream;
    }

    /// The last async save's slot, which only `save_hooks` opens.
    pub(super) fn save_slot(&self) -> &SaveSlot {
        &self.save
    }

    /// `save_slot`, to attach or detach a save.
    pub(super) fn save_slot_mut(&mut self) -> &mut SaveSlot {
        &mut self.save
    }

    /// The overlapped step in progress (`overlap` opens it, `overlap::end` closes it).
    pub(super) fn open_step(&self) -> Option<&OpenStep> {
        self.open.as_deref()
    }

    /// `open_step`, to hand it gradients or fail it.
    pub(super) fn open_step_mut(&mut self) -> Option<&mut OpenStep> {
        self.open.as_deref_mut()
    }

    /// Opens the overlapped step `open` (`step_begin`).
    pub(super) fn set_open_step(&mut self, open: Box<OpenStep>) {
        self.open = Some(open);
    }

    /// Closes the overlapped step in progress, if any (`step_end`, `step_abort`).
    pub(super) fn take_open_step(&mut self) -> Option<Box<OpenStep>> {
        self.open.take()
    }

    /// The undo records kept for the next overlapped step, by parameter (`overlap::end`
    /// keeps them, `overlap` hands them to its tasks).
    pub(super) fn undo_spares_mut(&mut self) -> &mut Vec<Option<Saved>> {
        &mut self.undo_spares
    }

    /// `undo_spares_mut`, read by the tests.
    #[cfg(test)]
    pub(super) fn undo_spares(&self) -> &[Option<Saved>] {
        &self.undo_spares
    }

    /// What device steps keep from one step to the next (`device_step`).
    pub(super) fn resident(&self) -> &DeviceResident {
        &self.resident
    }

    /// `resident`, to launch (and upload) tables.
    pub(super) fn resident_mut(&mut self) -> &mut DeviceResident {
        &mut self.resident
    }

    /// Adds a param group; returns its index.
    pub fn add_param_group(&mut self, cfg: OptimConfig) -> Result<usize> {
        cfg.validate()?;
        self.groups.push(cfg);
        Ok(self.groups.len() - 1)
    }

    fn check_group(&self, g: usize) -> Result<()> {
        if g >= self.groups.len() {
            return Err(Error::invalid(
                "group",
                format!("{g} is out of range ({} groups)", self.groups.len()),
            ));
        }
        Ok(())
    }

    /// Sets a group's learning rate (schedules call this between steps).
    pub fn set_group_lr(&mut self, group: usize, lr: f64) -> Result<()> {
        self.check_group(group)?;
        let mut c = self.groups[group].clone();
        c.lr = lr;
        self.set_group_config(group, c)
    }

    /// Replaces a group's hyper-parameters. The algorithm, state format and master weight
    /// bits fix the layout of state already created, so they cannot change.
    pub fn set_group_config(&mut self, group: usize, cfg: OptimConfig) -> Result<()> {
        self.check_group(group)?;
        self.refuse_if_step_open("set_group_config")?;
        cfg.validate()?;
        let old = &self.groups[group];
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
        self.groups[group] = cfg;
        Ok(())
    }

    /// Puts group `g`'s hyper-parameters back to `cfg`, as they were before a failed
    /// load (unchecked: `cfg` is the group's own earlier config).
    pub(crate) fn restore_group_config(&mut self, g: usize, cfg: OptimConfig) {
        self.groups[g] = cfg;
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
    pub(super) unsafe fn register(
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
        if self.params.iter().any(|p| p.fqn == fqn) {
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
        let cfg = &self.groups[group];
        if cfg.master_weight_bits != 0 {
            Half::from_dtype(param.dtype())
                .map_err(|e| Error::Dtype(format!("parameter {fqn}: {e}")))?;
        }
        if let Some(other) = self.overlapping_param(&param) {
            return Err(Error::invalid(
                "param",
                format!(
                    "parameter {fqn}'s memory overlaps parameter {}'s; each parameter needs its own storage",
                    self.params[other].fqn
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
        if let Some((lo, hi)) = address_range(&param) {
            let at = self.ranges.partition_point(|r| r.0 < lo);
            self.ranges.insert(at, (lo, hi, self.params.len()));
        }
        self.params.push(Param {
            fqn: fqn.to_string(),
            tensor: param,
            spec,
            group,
            state: None,
            gpu: None,
            mirror: None,
        });
        Ok(self.params.len() - 1)
    }

    /// A registered parameter whose memory intersects `t`'s (binary search over the
    /// sorted, disjoint parameter ranges).
    pub(super) fn overlapping_param(&self, t: &TensorView) -> Option<usize> {
        let (lo, hi) = address_range(t)?;
        let at = self.ranges.partition_point(|r| r.0 < hi);
        let r = self.ranges[..at].last()?;
        (r.1 > lo).then_some(r.2)
    }

    pub fn num_params(&self) -> usize {
        self.params.len()
    }
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }
    pub fn param_fqn(&self, i: usize) -> &str {
        &self.params[i].fqn
    }
    pub fn param_spec(&self, i: usize) -> Option<&ShardSpec> {
        self.params[i].spec.as_ref()
    }
    pub fn param(&self, i: usize) -> &TensorView {
        &self.params[i].tensor
    }
    pub fn param_group(&self, i: usize) -> usize {
        self.params[i].group
    }
    /// Group `g`'s hyper-parameters; an out-of-range `g` is an error naming `group`.
    pub fn group_config(&self, g: usize) -> Result<&OptimConfig> {
        self.check_group(g)?;
        Ok(&self.groups[g])
    }
    /// The config of parameter `i`'s group, for internal loops over known indices
    /// (unchecked: a registered parameter's group always exists).
    pub(crate) fn param_config(&self, i: usize) -> &OptimConfig {
        &self.groups[self.params[i].group]
    }
    pub fn has_state(&self, i: usize) -> bool {
        self.params[i].state.is_some() || self.params[i].gpu.is_some()
    }
    /// The device whose memory parameter `i` is.
    pub fn param_device(&self, i: usize) -> Device {
        self.params[i].device()
    }
    /// Bytes of optimizer state held for parameter `i` (moments, scales, error bits;
    /// the step counter is not counted); an out-of-range `i` is an error naming `index`.
    pub fn state_bytes(&self, i: usize) -> Result<usize> {
        self.check_index(i)?;
        Ok(self.state_nbytes(i))
    }
    /// `state_bytes` for internal loops over known indices (unchecked).
    pub(crate) fn state_nbytes(&self, i: usize) -> usize {
        let p = &self.params[i];
        p.state.as_ref().map_or(0, ParamState::nbytes)
            + p.gpu.as_ref().map_or(0, DeviceState::nbytes)
    }
    pub fn total_state_bytes(&self) -> usize {
        (0..self.params.len()).map(|i| self.state_nbytes(i)).sum()
    }

    /// An error unless `i` is a registered parameter's index.
    pub fn check_index(&self, i: usize) -> Result<()> {
        if i >= self.params.len() {
            return Err(Error::invalid(
                "index",
                format!("{i} is out of range ({} parameters)", self.params.len()),
            ));
        }
        Ok(())
    }

    /// Fresh (zero) state for parameter `i` in its group's format.
    pub(crate) fn new_state(&self, i: usize) -> ParamState {
        let p = &self.params[i];
        StateLayout::of(&self.groups[p.group], p.tensor.dtype()).zeroed(p.tensor.numel())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::Algorithm;

    /// The accessors the C ABI reaches with a caller's index check it themselves: an
    /// error naming the argument, never a panic.
    #[test]
    fn index_accessors_refuse_out_of_range_indices() {
        let opt = Optimizer::new(OptimConfig::default_for(Algorithm::AdamW)).unwrap();
        assert_eq!(opt.group_config(0).unwrap().algorithm, Algorithm::AdamW);
        let e = opt.group_config(99).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid argument `group`: 99 is out of range (1 groups)"
        );
        let index = "invalid argument `index`: 0 is out of range (0 parameters)";
        assert_eq!(opt.state_bytes(0).unwrap_err().to_string(), index);
        assert_eq!(opt.state_keys(0).unwrap_err().to_string(), index);
    }
}
