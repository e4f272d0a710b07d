//! The overlapped step: `step_begin` opens a step, `grads_ready` hands over the final
//! gradients of some parameters (a bucket, any order, as backward produces them) and fo
//! steps them on its pool while the caller goes on, `step_end` waits for the rest and
//! returns the step's status. The result (parameters, state, step counters) has the bits
//! of one `step` with the same gradients, clipping included:
//!
//! - Every early step is speculative: it keeps an undo record (the parameter's bytes and
//!   state from before), so a bad gradient handed over later, a non-finite result under
//!   `check_numerics` or a non-finite norm under `error_if_nonfinite` fails the whole
//!   step at `step_end` with nothing changed. Undo records are bounded by
//!   `undo_budget_bytes`; past it, parameters wait for `step_end` (`deferred`), as do
//!   gradients handed over as the step ends (`grads_at_end`: an early step would gain
//!   nothing there). A host parameter whose gradient is on a device (the offload case)
//!   steps early too: its task brings the gradient down to a host copy first (through
//!   the device's pinned ring), and `step_end` writes its mirror. A device parameter
//!   steps early on its GPU, on a stream of fo's own, its undo record in device memory
//!   (`device_early`).
//! - Clipping (`max_norm` > 0): each gradient's share of the norm is taken as it arrives
//!   and combined at `step_end` in parameter order through `clip`'s own reduction, so the
//!   total has the bits `fo_clip_grad_norm` gives over the handed-over gradients in
//!   parameter order (`is_shard`: the parameter has a shard spec with a `Shard` or
//!   `_StridedShard` placement). If the clip coefficient is below 1, the early steps are
//!   rolled back, the gradients scaled in place exactly as `clip_grad_norm` scales them
//!   (the caller sees them scaled afterwards, as after `fo_clip_grad_norm`), and every
//!   handed-over parameter is stepped again by `step`: clip-then-step, bit for bit.
//!
//! The background work lives in `task` (host; its undo records in `record`) and
//! `device_early` (device), the end of the step in `end`, the open step's record and the
//! caller's options in `open`.
mod device_early;
mod end;
pub(in crate::optim) mod fingerprint;
pub(in crate::optim) mod open;
pub(in crate::optim) mod record;
pub(in crate::optim) mod task;

use crate::clip;
use crate::error::{Error, Result};
use crate::optim::optimizer::{Optimizer, Param};
use crate::optim::threads;
use crate::tensor::{Device, TensorView};
use open::{no_step, Given, OpenStep};
pub use open::{OverlapOptions, OverlapStats};
use task::{Fetch, Inbox, Item};

impl Optimizer {
    /// Whether an overlapped step is open.
    pub fn step_open(&self) -> bool {
        self.open_step().is_some()
    }

    /// `Error::Busy` naming `call` while an overlapped step is open.
    pub(crate) fn refuse_if_step_open(&self, call: &str) -> Result<()> {
        if self.open_step().is_none() {
            return Ok(());
        }
        Err(Error::Busy(format!(
            "{call}: the optimizer has an overlapped step open (fo_optimizer_step_begin); \
             finish it with fo_optimizer_step_end first"
        )))
    }

    /// Opens an overlapped step (see the module doc).
    ///
    /// # Safety
    /// Until `step_end` (or the optimizer is dropped), the caller calls no method of this
    /// optimizer other than `grads_ready`, `grads_at_end`, `step_end` and the table
    /// readers (`num_params`, `param_fqn`, `group_config`, ...): parameters and state
    /// belong to the step's tasks.
    /// The mutators (`step`, `add_param`, `set_states`, `set_group_config`) refuse; the C
    /// ABI refuses every other call on the handle.
    pub unsafe fn step_begin(&mut self, opts: OverlapOptions) -> Result<()> {
        if self.open_step().is_some() {
            return Err(Error::invalid(
                "opt",
                "step_begin: an overlapped step is already open (finish it with step_end)",
            ));
        }
        if opts.max_norm.is_nan() {
            return Err(Error::invalid("max_norm", "is NaN"));
        }
        if opts.clipping() {
            clip::check_norm_args(opts.max_norm, opts.norm_type)?;
        }
        self.set_open_step(Box::new(OpenStep {
            opts,
            given: (0..self.num_params()).map(|_| None).collect(),
            inbox: Inbox::new(),
            pool: threads::pool()?,
            undo_bytes: 0,
            clip_certain: false,
            failed: None,
            stats: OverlapStats {
                total_norm: -1.0,
                ..OverlapStats::default()
            },
            device: Vec::new(),
        }));
        Ok(())
    }

    /// Hands over the final gradients of parameters `indices` (`grads[k]`, on its
    /// device) and returns while fo steps them. Each gradient is checked as `step`
    /// checks it; a bad one, an index out of range or one handed over
    /// twice in this step is returned at once (nothing of this bucket is taken) and fails
    /// the step at `step_end`, which then changes nothing.
    ///
    /// # Safety
    /// Every gradient must stay valid, and unchanged by the caller, until `step_end`
    /// returns (with clipping, writable: `step_end` may scale it in place).
    pub unsafe fn grads_ready(&mut self, indices: &[usize], grads: &[TensorView]) -> Result<()> {
        self.hand_over(indices, grads, true)
    }

    /// `grads_ready` for gradients that arrive as the step ends (the caller calls
    /// `step_end` next): stepping them early would gain nothing and cost their undo
    /// records, so they wait for `step_end` (`deferred`), which steps them with the rest.
    ///
    /// # Safety
    /// As `grads_ready`.
    pub unsafe fn grads_at_end(&mut self, indices: &[usize], grads: &[TensorView]) -> Result<()> {
        self.hand_over(indices, grads, false)
    }

    unsafe fn hand_over(
        &mut self,
        indices: &[usize],
        grads: &[TensorView],
        early_ok: bool,
    ) -> Result<()> {
        let r = self.take_bucket(indices, grads, early_ok);
        if let (Err(e), Some(open)) = (&r, self.open_step_mut()) {
            open.failed.get_or_insert_with(|| e.clone());
        }
        r
    }

    unsafe fn take_bucket(
        &mut self,
        indices: &[usize],
        grads: &[TensorView],
        early_ok: bool,
    ) -> Result<()> {
        let open = self.open_step().ok_or_else(|| no_step("grads_ready"))?;
        if let Some(e) = &open.failed {
            return Err(Error::invalid(
                "opt",
                format!(
                    "grads_ready: this step already failed ({e}); call step_end, which \
                     reports it and changes nothing"
                ),
            ));
        }
        if grads.len() != indices.len() {
            return Err(Error::invalid(
                "grads",
                format!(
                    "{} indices and {} gradients given; one each per parameter",
                    indices.len(),
                    grads.len()
                ),
            ));
        }
        for (k, (&i, g)) in indices.iter().zip(grads).enumerate() {
            self.check_index(i).map_err(|_| {
                Error::invalid(
                    format!("indices[{k}]"),
                    format!("{i} is out of range ({} parameters)", self.num_params()),
                )
            })?;
            if open.given[i].is_some() || indices[..k].contains(&i) {
                return Err(Error::invalid(
                    format!("indices[{k}]"),
                    format!(
                        "the gradient of {} was already handed over in this step",
                        self.entry(i).fqn()
                    ),
                ));
            }
            self.check_grad(i, g)?;
        }
        // Early (speculative) steps need an undo record within the budget, and are not
        // for `grads_at_end`; the rest waits for step_end's `step`. Host parameters step
        // on the pool (one with a device gradient, the offload case, brings it down
        // first), device parameters on their device's step lane (`device_early`; not
        // under check_numerics, which `step` refuses for them). Once the clip is certain
        // to scale, an early step would only be rolled back and taken again: from then on
        // gradients wait for step_end, with no undo record.
        let certain = open.clip_certain
            || (open.opts.clipping() && clip_is_certain(&open.opts, open.inbox.arrived_partials()));
        let (mut used, budget) = (open.undo_bytes, open.opts.undo_budget_bytes);
        let mut early: Vec<bool> = Vec::with_capacity(indices.len());
        let mut needs: Vec<usize> = Vec::with_capacity(indices.len());
        for (&i, g) in indices.iter().zip(grads) {
            let p = self.entry(i);
            let state = match p.device().is_cuda() {
                true => p.gpu.as_ref().map_or(0, |s| s.nbytes()),
                false => p.state.as_ref().map_or(0, |s| s.nbytes()),
            };
            let need = p.tensor().nbytes() + state;
            let can = match p.device().is_cuda() {
                true => !self.config(p.group()).check_numerics,
                false => g.device().is_host() || g.nbytes() > 0,
            };
            let fits = early_ok && can && !certain && used.saturating_add(need) <= budget;
            if fits {
                used += need;
            }
            early.push(fits);
            needs.push(need);
        }
        // An async save in flight takes what it still needs first (a failure here has
        // taken nothing).
        let mut fetches = Vec::with_capacity(indices.len());
        // Offloaded gradients come down on their device's down lane, which waits here,
        // at hand-over, for the work queued on the optimizer's stream so far (their
        // producer): the copy then runs while the GPU goes on with backward, not behind
        // the kernels queued on the optimizer's stream after this call.
        let mut lanes: Vec<(Device, usize)> = Vec::new();
        for ((&i, g), &e) in indices.iter().zip(grads).zip(&early) {
            if e {
                self.before_write(i)?;
            }
            fetches.push(
                match e && g.device().is_cuda() && self.entry(i).device().is_host() {
                    true => Some(Fetch {
                        src: g.as_ptr() as u64,
                        bytes: g.nbytes(),
                        device: g.device(),
                        stream: self.down_lane(g.device(), &mut lanes)?,
                    }),
                    false => None,
                },
            );
        }
        // Device parameters step now, on their lanes; one without device memory for
        // its record waits for step_end instead.
        let (on_device, device_grads): (Vec<usize>, Vec<TensorView>) = (indices.iter())
            .zip(grads)
            .zip(&early)
            .filter(|((&i, _), &e)| e && self.entry(i).device().is_cuda())
            .map(|((&i, g), _)| (i, g.clone()))
            .unzip();
        if !on_device.is_empty() {
            for i in self.step_early_on_device(&on_device, &device_grads)? {
                let k = indices
                    .iter()
                    .position(|&j| j == i)
                    .expect("handed over here");
                early[k] = false;
                used -= needs[k];
            }
        }
        let mut items = Vec::new();
        let bucket = indices.iter().zip(grads).zip(&early).zip(fetches);
        for (((&i, g), &early), fetch) in bucket {
            if early && self.entry(i).device().is_host() {
                items.push(self.item(i, g.clone(), fetch));
            }
            let open = self.open_step_mut().expect("checked above");
            let n = if early {
                &mut open.stats.speculative
            } else {
                &mut open.stats.deferred
            };
            *n += 1;
            open.stats.handed_over += 1;
            open.given[i] = Some(Given {
                grad: g.clone(),
                early,
            });
        }
        let open = self.open_step_mut().expect("checked above");
        open.undo_bytes = used;
        open.clip_certain = certain;
        open.stats.undo_high_water_bytes = open.undo_bytes as u64;
        if items.is_empty() {
            return Ok(());
        }
        let clip_p = open.opts.clipping().then_some(open.opts.norm_type);
        let mut delivery = open.inbox.expect();
        // SAFETY: see `OpenStep`: each item's parameter is this task's alone until
        // step_end or drop waits for it; the gradients are the caller's to keep valid.
        open.pool.spawn(move || {
            let dones = unsafe { task::run(items, clip_p) };
            delivery.dones.extend(dones);
        });
        Ok(())
    }

    /// Device `d`'s down lane, ordered after the work queued on the optimizer's stream
    /// now (once per device per hand-over: `done` remembers).
    ///
    /// # Safety
    /// The optimizer's stream is valid.
    unsafe fn down_lane(&self, d: Device, done: &mut Vec<(Device, usize)>) -> Result<usize> {
        if let Some(&(_, s)) = done.iter().find(|l| l.0 == d) {
            return Ok(s);
        }
        let b = crate::device::open::backend(d)?;
        let s = b.lanes().stream(&*b, crate::device::lanes::Dir::Down)?;
        b.order_streams(self.stream(), s)?;
        done.push((d, s));
        Ok(s)
    }

    /// Fails the open step (if any) with `e` as a bad gradient would; returns `e`. For
    /// callers whose bucket could not even be read (the C ABI).
    pub fn fail_step(&mut self, e: Error) -> Error {
        if let Some(open) = self.open_step_mut() {
            open.failed.get_or_insert_with(|| e.clone());
        }
        e
    }

    /// Parameter `i` as a task's item: its state moved out of the table (fresh if none).
    fn item(&mut self, i: usize, grad: TensorView, fetch: Option<Fetch>) -> Item {
        let fresh = self.entry(i).state.is_none();
        let state = match self.entry_mut(i).state.take() {
            Some(s) => s,
            None => self.new_state(i),
        };
        let spare = self.undo_spares_mut().get_mut(i).and_then(Option::take);
        let p = self.entry(i);
        let mut param = Param::new(p.fqn().to_string(), p.tensor().clone(), None, p.group());
        param.state = Some(state);
        Item {
            i,
            param,
            cfg: self.config(p.group()).clone(),
            grad,
            fresh,
            fetch,
            spare,
            full_fingerprint: self.full_fingerprints,
        }
    }
}

/// Whether the gradients already measured make a clipping step's clip scale for sure: this rank's share
/// of the total norm already exceeds `max_norm` (with a margin for the order of the final
/// sum). The total over every rank only adds to it (each rank's shards are summed,
/// replicated gradients counted once), so the clip coefficient will be below 1 whatever
/// arrives later. Only an optimization: the results are the same either way.
fn clip_is_certain(o: &OverlapOptions, (largest, sum): (f64, f64)) -> bool {
    let local = if o.norm_type.is_infinite() {
        largest
    } else {
        sum.powf(1.0 / o.norm_type)
    };
    local.is_finite() && local > o.max_norm * (1.0 + 1e-3) + 1e-6
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod clip_tests;

#[cfg(test)]
mod defer_tests;

#[cfg(test)]
mod offload_tests;

#[cfg(test)]
mod undo_tests;

#[cfg(test)]
mod device_early_tests;
