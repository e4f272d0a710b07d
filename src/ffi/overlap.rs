//! The overlapped step's C ABI: `fo_optimizer_step_begin`, `fo_optimizer_grads_ready`,
//! `fo_optimizer_step_end` (see `crate::optim::overlap`). Thin: check, call the core.
use super::args::{arg_flag, arg_mut, arg_slice, arg_slice_mut};
use super::comm::fo_comm;
use super::handle::enter;
use super::optim::{enter_opt, fo_optimizer, index};
use super::status::{fo_status, guard, guard_void};
use super::types::fo_tensor;
use crate::error::Result;
use crate::optim::overlap::{OverlapOptions, OverlapStats};
use crate::tensor::TensorView;

/// How an overlapped step clips, and how much it may keep to undo early steps
/// (`fo_overlap_options_default` fills the defaults; all-zero is valid too).
/// `max_norm` > 0 clips the gradients' total `norm_type`-norm (> 0, or INFINITY) to it as
/// `fo_clip_grad_norm` does; <= 0: no clipping. `error_if_nonfinite` (0/1): a non-finite
/// total fails the step, nothing changed or scaled. `undo_budget_bytes`: the most the
/// undo records of parameters stepped before `fo_optimizer_step_end` may hold (parameter
/// bytes + state bytes, host and device records together); parameters past it are
/// stepped at `fo_optimizer_step_end`; 0: no bound.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fo_overlap_options {
    pub max_norm: f64,
    pub norm_type: f64,
    pub error_if_nonfinite: i32,
    pub undo_budget_bytes: u64,
}

impl fo_overlap_options {
    fn to_options(self) -> Result<OverlapOptions> {
        Ok(OverlapOptions {
            max_norm: self.max_norm,
            norm_type: self.norm_type,
            error_if_nonfinite: super::args::arg_flag(
                self.error_if_nonfinite,
                "options.error_if_nonfinite",
            )?,
            undo_budget_bytes: match self.undo_budget_bytes {
                0 => usize::MAX,
                n => usize::try_from(n).unwrap_or(usize::MAX),
            },
        })
    }
}

/// What an overlapped step did, written by `fo_optimizer_step_end` (also when it fails).
/// `handed_over`: parameters whose gradients were handed over; of those `speculative`
/// were stepped before step_end (with an undo record) and `deferred` at step_end (past
/// the undo budget, handed over by `fo_optimizer_grads_at_end`, under `check_numerics` on
/// a device, or no device memory for a device parameter's record). `rolled_back`, `rolled_back_bytes`, `rollback_ns`:
/// early steps undone (the clip coefficient was < 1, or the step failed), the bytes
/// copied back and the time it took. `undo_high_water_bytes`: the most the undo records
/// held. `total_norm`: the gradients' total norm, `fo_clip_grad_norm`'s bits (-1 when not
/// clipping). `clipped`: 1 when the gradients were scaled and every parameter re-stepped.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct fo_overlap_stats {
    pub handed_over: u64,
    pub speculative: u64,
    pub deferred: u64,
    pub rolled_back: u64,
    pub rolled_back_bytes: u64,
    pub rollback_ns: u64,
    pub undo_high_water_bytes: u64,
    pub total_norm: f64,
    pub clipped: i32,
}

impl From<OverlapStats> for fo_overlap_stats {
    fn from(s: OverlapStats) -> Self {
        fo_overlap_stats {
            handed_over: s.handed_over,
            speculative: s.speculative,
            deferred: s.deferred,
            rolled_back: s.rolled_back,
            rolled_back_bytes: s.rolled_back_bytes,
            rollback_ns: s.rollback_ns,
            undo_high_water_bytes: s.undo_high_water_bytes,
            total_norm: s.total_norm,
            clipped: s.clipped as i32,
        }
    }
}

/// Fills `out` with the defaults: no clipping (`max_norm` 0), `norm_type` 2,
/// `error_if_nonfinite` 0, no undo bound.
#[no_mangle]
pub unsafe extern "C" fn fo_overlap_options_default(out: *mut fo_overlap_options) {
    guard_void(|| {
        if let Some(o) = out.as_mut() {
            *o = fo_overlap_options {
                max_norm: 0.0,
                norm_type: 2.0,
                error_if_nonfinite: 0,
                undo_budget_bytes: 0,
            };
        }
        Ok(())
    })
}

/// Opens an overlapped step: hand gradients over with `fo_optimizer_grads_ready` as
/// backward makes them final, then close it with `fo_optimizer_step_end`. The result
/// (parameters, state, step counters) has the bits of one `fo_optimizer_step` with the
/// same gradients (with clipping: of `fo_clip_grad_norm` over the handed-over gradients
/// in parameter order, then `fo_optimizer_step`). `options` NULL: the defaults. Until
/// step_end every other call on `opt` but `fo_optimizer_num_params`,
/// `fo_optimizer_get_group_config` and `fo_optimizer_param_groups_json` is refused with
/// FO_ERR_BUSY; `fo_optimizer_destroy` waits for the step's work, then puts the
/// parameters back as they were and frees. A step already open: FO_ERR_INVALID_ARGUMENT.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_step_begin(
    opt: *mut fo_optimizer,
    options: *const fo_overlap_options,
) -> fo_status {
    guard(|| {
        let mut opt = enter_opt(opt, "fo_optimizer_step_begin")?;
        let o = match options.as_ref() {
            Some(o) => o.to_options()?,
            None => OverlapOptions::default(),
        };
        opt.step_begin(o)
    })
}

/// Hands over the final gradients of `n` parameters (`indices[k]`'s gradient is
/// `grads[k]`, as for `fo_optimizer_step`: F32/BF16/F16, any strides on the host, on the
/// parameter's device or, for a host parameter, on a device; `data == NULL`: no gradient,
/// the entry is ignored) and returns while fo steps
/// them: host parameters on its thread pool, device parameters on their GPU. Any order,
/// any number of calls; parameters never handed over
/// are skipped. The gradients' memory must stay valid, and unchanged by the caller, until
/// `fo_optimizer_step_end` returns (with clipping it may scale them in place). Device work
/// is ordered here, at this call, after the work queued on the optimizer's stream so far
/// (the gradients' producer), on streams of fo's own, not behind the work queued on that
/// stream later: a device gradient of a host parameter (the offload case) comes down, and
/// a device parameter's step is launched after its undo record (parameter and state bytes,
/// in stream-ordered device memory until step_end, counted in `undo_budget_bytes`; without
/// device memory for it, the parameter waits for step_end). A bad
/// gradient, an index out of range or handed over twice is returned at once (nothing of
/// this call is taken) and fails the step at step_end, which then changes nothing. No
/// step open: FO_ERR_INVALID_ARGUMENT.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_grads_ready(
    opt: *mut fo_optimizer,
    indices: *const i32,
    grads: *const fo_tensor,
    n: usize,
) -> fo_status {
    guard(|| hand_over(opt, indices, grads, n, "fo_optimizer_grads_ready", true))
}

/// Hands over gradients as `fo_optimizer_grads_ready` does, for a caller about to call
/// `fo_optimizer_step_end` (e.g. the gradients no backward hook handed over): they are
/// stepped at step_end with the rest, keeping no undo record, where an early step would
/// gain nothing and copy its parameter and state first. Same arguments, checks and
/// errors as `fo_optimizer_grads_ready`; counted in `fo_overlap_stats.deferred`.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_grads_at_end(
    opt: *mut fo_optimizer,
    indices: *const i32,
    grads: *const fo_tensor,
    n: usize,
) -> fo_status {
    guard(|| hand_over(opt, indices, grads, n, "fo_optimizer_grads_at_end", false))
}

unsafe fn hand_over(
    opt: *mut fo_optimizer,
    indices: *const i32,
    grads: *const fo_tensor,
    n: usize,
    call: &'static str,
    early: bool,
) -> Result<()> {
    let mut opt = enter_opt(opt, call)?;
    let bucket = (|| -> Result<(Vec<usize>, Vec<TensorView>)> {
        let (idx, gs) = (
            arg_slice(indices, n, "indices")?,
            arg_slice(grads, n, "grads")?,
        );
        let mut out = (Vec::new(), Vec::new());
        for (k, (&i, g)) in idx.iter().zip(gs).enumerate() {
            let i = index(i, &format!("indices[{k}]"))?;
            if g.data.is_null() {
                continue; // no gradient, as for fo_optimizer_step
            }
            out.0.push(i);
            out.1.push(g.to_view(&format!("grads[{k}]"))?);
        }
        Ok(out)
    })();
    match (bucket, early) {
        (Ok((i, g)), true) => opt.grads_ready(&i, &g),
        (Ok((i, g)), false) => opt.grads_at_end(&i, &g),
        // A bucket that cannot be read fails the step like a bad gradient.
        (Err(e), _) => Err(opt.fail_step(e)),
    }
}

/// Closes the overlapped step: waits for fo's pool, and returns the step's status. With
/// clipping, combines the total norm through `comm` (collective: every rank calls
/// step_end; NULL: this rank alone), and if `max_norm / (total + 1e-6)` < 1 puts the early
/// steps back, scales the handed-over gradients in place exactly as `fo_clip_grad_norm`
/// does (they stay scaled, as after it) and steps every handed-over parameter again. On
/// error no parameter and no state has changed. `stats` (NULL: not wanted) is written
/// either way. No step open: FO_ERR_INVALID_ARGUMENT; `comm` busy: FO_ERR_BUSY with the
/// step still open (call again). With `comm` the ranks first agree (a broadcast and an
/// all-reduce) that every rank has a step open with the same clip options of
/// `fo_optimizer_step_begin` (max_norm, norm_type, error_if_nonfinite): otherwise every
/// rank returns FO_ERR_INVALID_ARGUMENT naming the first differing rank's choice and rank
/// 0's, and nothing is stepped on any rank.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_step_end(
    opt: *mut fo_optimizer,
    comm: *mut fo_comm,
    stats: *mut fo_overlap_stats,
) -> fo_status {
    guard(|| {
        let mut opt = enter_opt(opt, "fo_optimizer_step_end")?;
        let comm = match comm.is_null() {
            true => None,
            false => Some(enter(comm, "fo_optimizer_step_end")?),
        };
        let mut st = OverlapStats::default();
        let r = opt.step_end(comm.as_deref(), &mut st);
        if let Some(out) = stats.as_mut() {
            *out = st.into();
        }
        r
    })
}

/// Closes the open overlapped step changing nothing: waits for fo's pool and puts every
/// parameter stepped early back as it was (memory and state). Local to this rank (no
/// collective, unlike `fo_optimizer_step_end`); the handed-over gradients are released
/// untouched. For a training loop that drops a step after backward started handing
/// gradients over (torch's `zero_grad` before `step`). `stats` (NULL: not wanted): what
/// was rolled back. No step open: FO_ERR_INVALID_ARGUMENT.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_step_abort(
    opt: *mut fo_optimizer,
    stats: *mut fo_overlap_stats,
) -> fo_status {
    guard(|| {
        let mut opt = enter_opt(opt, "fo_optimizer_step_abort")?;
        let mut st = OverlapStats::default();
        let r = opt.step_abort(&mut st);
        if let Some(out) = stats.as_mut() {
            *out = st.into();
        }
        r
    })
}

/// Frees the undo records fo keeps between overlapped steps for the next one to reuse (as
/// large as the parameters last stepped early plus their state) and writes their size in
/// bytes to `*released` (NULL: not wanted). For a loop that stops overlapping (fo.torch's
/// `overlap=True` once it measured overlapping slower); the next overlapped step allocates
/// them again. A step open: FO_ERR_BUSY.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_release_undo(
    opt: *mut fo_optimizer,
    released: *mut usize,
) -> fo_status {
    guard(|| {
        let n = enter_opt(opt, "fo_optimizer_release_undo")?.release_undo();
        if let Some(out) = released.as_mut() {
            *out = n;
        }
        Ok(())
    })
}

/// Whether early steps of host parameters also fingerprint every byte of their gradient,
/// from the next `fo_optimizer_step_begin` on (`full` 1; 0, the default: a sampled
/// fingerprint only, 8 bytes in every 1024 and the last 8). A full fingerprint reads each
/// gradient once more on fo's pool; `fo_optimizer_grads_changed` then tells a gradient
/// edited to the same bits (multiplied by 1.0: a clip that does not trigger) from one
/// that changed. A step open: FO_ERR_BUSY.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_set_full_fingerprints(
    opt: *mut fo_optimizer,
    full: i32,
) -> fo_status {
    guard(|| {
        let full = arg_flag(full, "full")?;
        enter_opt(opt, "fo_optimizer_set_full_fingerprints")?.set_full_fingerprints(full)
    })
}

/// Which early-stepped host parameters' gradients differ from the ones their early step
/// read, for a loop that may have edited gradients after handing them over (between
/// backward and `fo_optimizer_step_end`: those early steps used the gradients as they were):
/// waits for the open step's work on fo's pool, reads those gradients again and writes
/// the indices of the changed ones, ascending, to `out` (`capacity` entries; `*out_n`:
/// how many there are, also when more than `capacity`, of which the first `capacity` are
/// written). The `n_full` parameters `full` are compared by every byte (those whose step
/// kept no full fingerprint, see `fo_optimizer_set_full_fingerprints`, or whose gradient
/// came down from a device, count as changed), the others by the sampled fingerprint:
/// an edit that scales or averages a gradient changes it; one of a few elements between
/// the sampled bytes does not. Parameters stepped at step_end or on a device are never
/// named. The caller redoes the step where something changed (`fo_optimizer_step_abort`,
/// then `fo_optimizer_step`). No step open, or an index out of range:
/// FO_ERR_INVALID_ARGUMENT.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_grads_changed(
    opt: *mut fo_optimizer,
    full: *const i32,
    n_full: usize,
    out: *mut i32,
    capacity: usize,
    out_n: *mut usize,
) -> fo_status {
    guard(|| {
        let opt = enter_opt(opt, "fo_optimizer_grads_changed")?;
        let out_n = arg_mut(out_n, "out_n")?;
        let out = arg_slice_mut(out, capacity, "out")?;
        let full = arg_slice(full, n_full, "full")?
            .iter()
            .enumerate()
            .map(|(k, &i)| index(i, &format!("full[{k}]")))
            .collect::<Result<Vec<usize>>>()?;
        let changed = opt.grads_changed(&full)?;
        *out_n = changed.len();
        for (o, &i) in out.iter_mut().zip(&changed) {
            *o = i as i32;
        }
        Ok(())
    })
}
