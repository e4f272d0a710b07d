//! The optimizer handle: param groups, registered parameters (borrowed memory, updated
//! in place: host memory, or CUDA device memory with feature `cuda`), lazily created
//! state, and the accessors every concern goes through. Registration's checks are in
//! `register`, the step's entry in `step`, its device half in `placement::device_step`,
//! the overlapped step in `overlap`, state by key and the async save's hooks in `state`.
//!
//! Who may touch what (modules under `optim`; r: reads, w: writes). Every field of the
//! handle is private; the concern modules reach it through the methods below, written
//! `pub(in crate::optim)`:
//! - `groups`: w by `register` only, through `push_group` and `replace_group`
//!   (`add_param_group`, `set_group_config`, `restore_group_config`); r by all through
//!   `config`, `param_config`, `groups`, `check_group` and, beside mutable parameters,
//!   `params_mut_with_groups`.
//! - `params`: pushed by `register` only (`push_param`, after its checks); r by all
//!   through `entry`, `entries` and `num_params`. A `Param`'s `fqn`, `tensor`, `spec` and
//!   `group` are fixed at registration (`Param::new`; copied by `state::save_hooks`'
//!   detached view and `overlap`'s task items) and private, read through `fqn()`,
//!   `tensor()`, `spec()`, `group()` (`device()` is the tensor's). Its `state`, `gpu` and
//!   `mirror` are `pub(in crate::optim)` fields, written through `entry_mut` or
//!   `params_mut_with_groups` (`tensor_and_state` where a job borrows both): `state` by
//!   `step` (and `step::numerics`' undo), `overlap` and `placement::staging`
//!   (`store_state`, which `state::set` calls; `restore`); `gpu` by
//!   `placement::device_step` and `placement::staging`; `mirror` by
//!   `placement::offload_step` (`set_mirror`). `placement::offload_pipe` steps offloaded
//!   parameters' `state` in place. The rest read them.
//! - `ranges`: here only (`push_param`, `overlapping_param`).
//! - `stream`: r by all through `stream()`; w only by `set_stream`
//!   (`placement::device_step`) through `store_stream`.
//! - `save`: a `SaveSlot` that only `state::save_hooks` opens (`save_slot*`); the others
//!   call `before_write`, `mark_step` and `save_in_flight`.
//! - `open`, `undo_spares`: the overlapped step's (`overlap`, `overlap::end`), through
//!   `open_step*`, `set_open_step`, `take_open_step` and `undo_spares_mut`; the others
//!   `refuse_if_step_open`.
//! - `resident`: `placement::device_step`'s, through `resident` / `resident_mut`.
use super::math::config::OptimConfig;
use super::overlap::open::OpenStep;
use super::overlap::record::Saved;
use super::placement::Mirror;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::step_table::StateLayout;
use crate::optim::math::state::ParamState;
use crate::optim::placement::DeviceState;
use crate::shard::ShardSpec;
use crate::tensor::{Device, TensorView};

use super::state::save_hooks::SaveSlot;

/// One registered parameter. What registration fixes (`fqn`, `tensor`, `spec`, `group`)
/// is private, read through the methods below; what steps change is a field the concern
/// modules write (the map at the head of this file says which).
pub(in crate::optim) struct Param {
    fqn: String,
    tensor: TensorView,
    spec: Option<ShardSpec>,
    group: usize,
    /// The host state (None before the first step, and for a device parameter).
    pub(in crate::optim) state: Option<ParamState>,
    /// The state of a device parameter (`state` stays None for it).
    pub(in crate::optim) gpu: Option<DeviceState>,
    /// A device copy of a host parameter, rewritten after each change (`set_mirror`).
    pub(in crate::optim) mirror: Option<Mirror>,
}

impl Param {
    /// A parameter as registered: no state, no device state, no mirror.
    pub(in crate::optim) fn new(
        fqn: String,
        tensor: TensorView,
        spec: Option<ShardSpec>,
        group: usize,
    ) -> Param {
        Param {
            fqn,
            tensor,
            spec,
            group,
            state: None,
            gpu: None,
            mirror: None,
        }
    }

    /// The parameter's fully qualified name.
    pub(in crate::optim) fn fqn(&self) -> &str {
        &self.fqn
    }

    /// The caller's memory, updated in place.
    pub(in crate::optim) fn tensor(&self) -> &TensorView {
        &self.tensor
    }

    /// The shard spec given at registration, if any.
    pub(in crate::optim) fn spec(&self) -> Option<&ShardSpec> {
        self.spec.as_ref()
    }

    /// The index of the parameter's group.
    pub(in crate::optim) fn group(&self) -> usize {
        self.group
    }

    /// `tensor` beside the host state, mutable (a step's jobs borrow both).
    pub(in crate::optim) fn tensor_and_state(&mut self) -> (&TensorView, &mut Option<ParamState>) {
        (&self.tensor, &mut self.state)
    }

    /// The device holding the parameter (and, on a CUDA device, its state).
    pub(in crate::optim) fn device(&self) -> Device {
        self.tensor.device()
    }
}

/// An optimizer over parameters in caller memory. Group 0 is the config given to `new`.
pub struct Optimizer {
    groups: Vec<OptimConfig>,
    params: Vec<Param>,
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
    /// Early host steps fingerprint every byte of their gradient (`overlap::fingerprint`).
    pub(in crate::optim) full_fingerprints: bool,
}

/// What device steps reuse across steps, so a step's host cost does not grow with the
/// pointer checks and table uploads of unchanged tensors.
#[derive(Default)]
pub(in crate::optim) struct DeviceResident {
    /// Device memory validated for gradients (a lock: gradients are checked under `&self`).
    pub(in crate::optim) known: std::sync::Mutex<crate::device::check::KnownMemory>,
    pub(in crate::optim) tables: super::placement::device_table::ResidentTables,
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

pub(in crate::optim) fn is_param_dtype(d: DType) -> bool {
    matches!(d, DType::F32 | DType::BF16 | DType::F16)
}

impl Optimizer {
    pub fn new(cfg: OptimConfig) -> Result<Optimizer> {
        cfg.validate()?;
        Ok(Optimizer::with_tables(vec![cfg], Vec::new(), 0))
    }

    /// An optimizer over `groups` and `params` on `stream` and nothing else (no address
    /// ranges, save, open step or resident tables): `new`'s, and `detached_view`'s.
    pub(in crate::optim) fn with_tables(
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
            full_fingerprints: false,
        }
    }

    /// Every group's hyper-parameters, in order.
    pub(in crate::optim) fn groups(&self) -> &[OptimConfig] {
        &self.groups
    }

    /// Group `g`'s hyper-parameters, for internal loops over known groups (unchecked).
    pub(in crate::optim) fn config(&self, g: usize) -> &OptimConfig {
        &self.groups[g]
    }

    /// The parameters, in registration order.
    pub(in crate::optim) fn params(&self) -> &[Param] {
        &self.params
    }

    /// The parameters, mutable, beside the groups they read (a step borrows both).
    pub(in crate::optim) fn params_mut_with_groups(&mut self) -> (&mut [Param], &[OptimConfig]) {
        (&mut self.params, &self.groups)
    }

    /// The `CUstream` device work is queued on (0: the legacy default stream).
    pub fn stream(&self) -> usize {
        self.stream
    }

    /// Keeps `stream` as the optimizer's: `set_stream`'s, once it has checked the stream
    /// and ordered it after the old one.
    pub(in crate::optim) fn store_stream(&mut self, stream: usize) {
        self.stream = stream;
    }

    /// The last async save's slot, which only `save_hooks` opens.
    pub(in crate::optim) fn save_slot(&self) -> &SaveSlot {
        &self.save
    }

    /// `save_slot`, to attach or detach a save.
    pub(in crate::optim) fn save_slot_mut(&mut self) -> &mut SaveSlot {
        &mut self.save
    }

    /// The overlapped step in progress (`overlap` opens it, `overlap::end` closes it).
    pub(in crate::optim) fn open_step(&self) -> Option<&OpenStep> {
        self.open.as_deref()
    }

    /// `open_step`, to hand it gradients or fail it.
    pub(in crate::optim) fn open_step_mut(&mut self) -> Option<&mut OpenStep> {
        self.open.as_deref_mut()
    }

    /// Opens the overlapped step `open` (`step_begin`).
    pub(in crate::optim) fn set_open_step(&mut self, open: Box<OpenStep>) {
        self.open = Some(open);
    }

    /// Closes the overlapped step in progress, if any (`step_end`, `step_abort`).
    pub(in crate::optim) fn take_open_step(&mut self) -> Option<Box<OpenStep>> {
        self.open.take()
    }

    /// The undo records kept for the next overlapped step, by parameter (`overlap::end`
    /// keeps them, `overlap` hands them to its tasks).
    pub(in crate::optim) fn undo_spares_mut(&mut self) -> &mut Vec<Option<Saved>> {
        &mut self.undo_spares
    }

    /// `undo_spares_mut`, read by the tests.
    #[cfg(test)]
    pub(in crate::optim) fn undo_spares(&self) -> &[Option<Saved>] {
        &self.undo_spares
    }

    /// What device steps keep from one step to the next (`device_step`).
    pub(in crate::optim) fn resident(&self) -> &DeviceResident {
        &self.resident
    }

    /// `resident`, to launch (and upload) tables.
    pub(in crate::optim) fn resident_mut(&mut self) -> &mut DeviceResident {
        &mut self.resident
    }

    /// Adds group `cfg` (checked by `register`'s `add_param_group`); returns its index.
    pub(in crate::optim) fn push_group(&mut self, cfg: OptimConfig) -> usize {
        self.groups.push(cfg);
        self.groups.len() - 1
    }

    /// Replaces group `g`'s hyper-parameters with `cfg` (checked by `register`).
    pub(in crate::optim) fn replace_group(&mut self, g: usize, cfg: OptimConfig) {
        self.groups[g] = cfg;
    }

    /// An error unless `g` is a group's index.
    pub(in crate::optim) fn check_group(&self, g: usize) -> Result<()> {
        if g >= self.groups.len() {
            return Err(Error::invalid(
                "group",
                format!("{g} is out of range ({} groups)", self.groups.len()),
            ));
        }
        Ok(())
    }

    /// Appends parameter `p` (checked by `register`) and its address range; returns its
    /// index.
    pub(in crate::optim) fn push_param(&mut self, p: Param) -> usize {
        if let Some((lo, hi)) = address_range(&p.tensor) {
            let at = self.ranges.partition_point(|r| r.0 < lo);
            self.ranges.insert(at, (lo, hi, self.params.len()));
        }
        self.params.push(p);
        self.params.len() - 1
    }

    /// Parameter `i`'s entry in the table (unchecked: a known index).
    pub(in crate::optim) fn entry(&self, i: usize) -> &Param {
        &self.params[i]
    }

    /// `entry`, to write its state, device state or mirror.
    pub(in crate::optim) fn entry_mut(&mut self, i: usize) -> &mut Param {
        &mut self.params[i]
    }

    /// Every parameter's entry, in registration order.
    pub(in crate::optim) fn entries(&self) -> &[Param] {
        &self.params
    }

    /// A registered parameter whose memory intersects `t`'s (binary search over the
    /// sorted, disjoint parameter ranges).
    pub(in crate::optim) fn overlapping_param(&self, t: &TensorView) -> Option<usize> {
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
