//! The end of an overlapped step (`overlap`): wait for the pool, put the state back,
//! combine the clip norm, and either keep the early steps (stepping what was deferred),
//! or roll them back and step everything again with the clipped gradients, or roll them
//! back and fail.
use std::time::Instant;

use super::open::OverlapOptions;
use super::open::{no_step, Given, OpenStep, OverlapStats};
use super::record::Saved;
use super::task::Done;
use crate::clip::{self, ClipGrad};
use crate::comm::{agree, Comm};
use crate::error::{Error, Result};
use crate::optim::math::state::ParamState;
use crate::optim::optimizer::Optimizer;
use crate::tensor::TensorView;

impl Optimizer {
    /// Closes the overlapped step: waits for the pool, combines the clip norm (through
    /// `comm`, every rank's `step_end` taking part; None: this rank alone), re-steps
    /// after a clip or steps what was deferred, and returns the step's status. On error,
    /// no parameter and no state has changed (gradients may have been scaled, as
    /// `fo_clip_grad_norm` leaves them before a failing step). `stats` is filled either way.
    ///
    /// # Safety
    /// As `step` for the handed-over gradients; registered parameters still valid.
    pub unsafe fn step_end(&mut self, comm: Option<&Comm>, stats: &mut OverlapStats) -> Result<()> {
        let open = self.take_open_step();
        let local = open
            .as_ref()
            .map(|o| o.opts)
            .ok_or_else(|| no_step("step_end"));
        // With a communicator every rank learns first, before anything is kept or
        // re-stepped, whether a rank has no step open or clips otherwise: a rank that
        // clips alone would wait in the norm's all-reduce while the others step.
        let agreed = match comm {
            Some(c) => agree_clip(c, local),
            None => local.map(|_| ()),
        };
        let Some(mut open) = open else {
            return agreed.and(Err(no_step("step_end")));
        };
        let mut dones = open.inbox.wait_all();
        dones.sort_by_key(|d| d.i);
        for d in dones.iter_mut() {
            self.entry_mut(d.i).state = d.param.state.take();
        }
        // Early device steps: what comes next on the optimizer's stream (and the clip's,
        // which may scale their gradients) waits for them.
        let clip_stream = open.opts.clipping().then(|| comm.map_or(0, Comm::stream));
        let joined = self.join_lanes(&open, clip_stream);
        let r = joined
            .and(agreed)
            .and_then(|_| self.finish(&mut open, &mut dones, comm));
        if r.is_err() {
            // The step's own error is the one reported.
            let _ = self.roll_back(&mut dones, &mut open);
        }
        self.free_device_undo(&mut open);
        self.keep_spares(&mut dones);
        *stats = open.stats;
        r
    }

    /// Frees the undo records kept for the next overlapped step to fill (`keep_spares`) and
    /// returns their size: as large as the parameters last stepped early and their state,
    /// held for nothing by a loop that no longer overlaps (fo.torch's `overlap=True` when
    /// it measured overlapping slower: 269.6 MiB for 50.4M parameters on the H200 run).
    /// The next overlapped step allocates them again.
    pub fn release_undo(&mut self) -> usize {
        let spares = std::mem::take(self.undo_spares_mut());
        spares.into_iter().flatten().map(|u| u.nbytes()).sum()
    }

    /// Keeps the step's undo records for the next overlapped step to fill.
    fn keep_spares(&mut self, dones: &mut [Done]) {
        let n = self.num_params();
        let spares = self.undo_spares_mut();
        spares.resize_with(n, || None);
        for d in dones.iter_mut() {
            if let Some(u) = d.undo.take().or_else(|| d.spare.take()) {
                spares[d.i] = Some(u);
            }
        }
    }

    /// Closes the open overlapped step changing nothing: waits for the pool and puts every
    /// parameter stepped early back as it was (memory and state; a state the step created
    /// is dropped). Local to this rank: no collective, so one rank may abort while others
    /// do too (torch's `zero_grad` between backward and `step`). `stats` says what was
    /// rolled back.
    pub fn step_abort(&mut self, stats: &mut OverlapStats) -> Result<()> {
        let mut open = self.take_open_step().ok_or_else(|| no_step("step_abort"))?;
        let mut dones = open.inbox.wait_all();
        dones.sort_by_key(|d| d.i);
        for d in dones.iter_mut() {
            self.entry_mut(d.i).state = d.param.state.take();
        }
        // SAFETY: the records' streams are the optimizer's devices'.
        let joined = unsafe { self.join_lanes(&open, None) };
        let r = joined.and(self.roll_back(&mut dones, &mut open));
        self.keep_spares(&mut dones);
        *stats = open.stats;
        r
    }

    unsafe fn finish(
        &mut self,
        open: &mut OpenStep,
        dones: &mut [Done],
        comm: Option<&Comm>,
    ) -> Result<()> {
        let failed = open.failed.take();
        let handed: Vec<usize> = (0..open.given.len())
            .filter(|&i| open.given[i].is_some())
            .collect();
        if open.opts.clipping() {
            let single;
            let comm = match comm {
                Some(c) => c,
                None => {
                    single = Comm::local_group(1).pop().expect("one rank");
                    &single
                }
            };
            let local = match failed {
                Some(e) => Err(e),
                None => self.partials(open, dones, &handed, comm.stream()),
            };
            let o = open.opts;
            let total = clip::total_from_partials(
                comm,
                local,
                o.max_norm,
                o.norm_type,
                o.error_if_nonfinite,
            )?;
            open.stats.total_norm = total;
            let coef = clip::clip_coef(o.max_norm, total);
            if clip::needs_scaling(coef) {
                open.stats.clipped = true;
                self.roll_back(dones, open)?;
                let grads: Vec<ClipGrad> = handed
                    .iter()
                    .map(|&i| {
                        let g = open.given[i].as_ref().expect("handed over");
                        ClipGrad {
                            tensor: g.grad.clone(),
                            is_shard: false,
                        }
                    })
                    .collect();
                clip::scale_grads(&grads, coef, comm.stream())?;
                return self.step_given(open, |_| true);
            }
        } else if let Some(e) = failed {
            return Err(e);
        }
        // No scaling: the early steps stand unless one of them failed.
        if let Some(e) = dones.iter_mut().find_map(|d| d.error.take()) {
            return Err(e);
        }
        if let Some(what) = dones.iter().find_map(|d| d.bad_result.clone()) {
            return Err(crate::optim::step::numerics::non_finite_result(&what));
        }
        if open.stats.deferred > 0 {
            self.step_given(open, |g| !g.early)?;
        }
        self.write_mirrors(dones.iter().map(|d| d.i).collect::<Vec<_>>())?;
        Ok(())
    }

    /// `step` over the handed-over gradients that `which` picks.
    unsafe fn step_given(&mut self, open: &OpenStep, which: impl Fn(&Given) -> bool) -> Result<()> {
        let grads: Vec<Option<TensorView>> = open
            .given
            .iter()
            .map(|g| g.as_ref().filter(|g| which(g)).map(|g| g.grad.clone()))
            .collect();
        self.step(&grads)
    }

    /// Every handed-over gradient's `(is_shard, (largest |g|, sum |g|^p))`, in parameter
    /// order: taken on the pool for early steps, here for the rest.
    unsafe fn partials(
        &self,
        open: &OpenStep,
        dones: &mut [Done],
        handed: &[usize],
        stream: usize,
    ) -> Result<Vec<(bool, (f64, f64))>> {
        let mut out = Vec::with_capacity(handed.len());
        for &i in handed {
            let g = open.given[i].as_ref().expect("handed over");
            let done = dones.binary_search_by_key(&i, |d| d.i).ok();
            let partial = match done.and_then(|k| dones[k].partial) {
                Some(p) => p,
                None => {
                    if let Some(e) = done.and_then(|k| dones[k].error.take()) {
                        return Err(e);
                    }
                    let c = ClipGrad {
                        tensor: g.grad.clone(),
                        is_shard: false,
                    };
                    clip::grad_norms(&[c], open.opts.norm_type, stream)?[0]
                }
            };
            out.push((self.is_shard(i), partial));
        }
        Ok(out)
    }

    /// Whether parameter `i`'s gradient counts as a shard in the clip norm: it was
    /// registered with a shard spec placing it by `Shard` or `_StridedShard`.
    fn is_shard(&self, i: usize) -> bool {
        self.entry(i)
            .spec()
            .is_some_and(|s| s.placements().iter().any(|p| p.shard_dim().is_some()))
    }

    /// Puts every early-stepped parameter back as it was before the step (memory and
    /// state; a state the step created is dropped): host ones here, device ones in
    /// order on the optimizer's stream (after `join_lanes`). A CUDA error putting a
    /// device parameter back is returned once every record has been tried.
    fn roll_back(&mut self, dones: &mut [Done], open: &mut OpenStep) -> Result<()> {
        let t = Instant::now();
        // SAFETY: the lanes were joined; the parameters are valid (`step_end`'s contract).
        let device = unsafe { self.roll_back_device(open) };
        let (mut n, bytes) = device.as_ref().map_or((0, 0), |&nb| nb);
        open.stats.rolled_back += n;
        open.stats.rolled_back_bytes += bytes;
        let stats = &mut open.stats;
        for d in dones.iter_mut() {
            let bytes = d.undo_bytes();
            match d.undo.take() {
                Some(u) => {
                    // SAFETY: the task is over and the step is closed: the memory is ours.
                    unsafe {
                        let dst = self.entry(d.i).tensor().contiguous_bytes_mut();
                        let dst = dst.expect("parameters are contiguous");
                        open.pool.install(|| super::record::copy_par(dst, &u.bytes))
                    };
                    // The record's buffers, with the state it replaced, serve the next
                    // step (`keep_spares`); not `d.undo`: a second rollback finds nothing.
                    // `replace_in` keeps a lent f32 buffer live (values copied back into it).
                    let stepped = ParamState::replace_in(&mut self.entry_mut(d.i).state, u.state);
                    d.spare = Some(Saved {
                        bytes: u.bytes,
                        state: stepped,
                    });
                    stats.rolled_back += 1;
                    stats.rolled_back_bytes += bytes as u64;
                    n += 1;
                }
                None if d.fresh => self.entry_mut(d.i).state = None,
                None => {}
            }
        }
        if n > 0 {
            stats.rollback_ns += t.elapsed().as_nanos() as u64;
        }
        device.map(|_| ())
    }
}

/// What a rank's step does with the norm: (max_norm, norm_type, error_if_nonfinite), all
/// zero without clipping.
fn clip_key(o: &OverlapOptions) -> [f64; 3] {
    match o.clipping() {
        true => [o.max_norm, o.norm_type, o.error_if_nonfinite as u8 as f64],
        false => [0.0; 3],
    }
}

fn describe(k: &[f64; 3]) -> String {
    match k[0] > 0.0 {
        true => format!(
            "clips (max_norm {}, norm_type {}, error_if_nonfinite {})",
            k[0],
            k[1],
            k[2] != 0.0
        ),
        false => "does not clip".into(),
    }
}

/// Every rank's step options (`local`: its open step's, or why it has none) against rank
/// 0's: rank 0 broadcasts its clip key, and the first failing rank's error becomes every
/// rank's. One broadcast and one all-reduce (plus a broadcast on failure).
fn agree_clip(comm: &Comm, local: Result<OverlapOptions>) -> Result<()> {
    let mine = local.as_ref().map(clip_key).unwrap_or_default();
    let mut buf = [0u8; 24];
    if comm.rank() == 0 {
        for (b, v) in buf.chunks_exact_mut(8).zip(mine) {
            b.copy_from_slice(&v.to_le_bytes());
        }
    }
    comm.broadcast(&mut buf, 0)?;
    let mut theirs = [0.0; 3];
    for (v, b) in theirs.iter_mut().zip(buf.chunks_exact(8)) {
        *v = f64::from_le_bytes(b.try_into().expect("8 bytes"));
    }
    let checked = local.and_then(|_| {
        if theirs
            .iter()
            .zip(&mine)
            .all(|(a, b)| a.to_bits() == b.to_bits())
        {
            return Ok(());
        }
        Err(Error::invalid(
            "opts",
            format!(
                "rank {} {} while rank 0 {}: every rank of an overlapped step through one \
                 communicator must pass the same clip options to step_begin (nothing stepped)",
                comm.rank(),
                describe(&mine),
                describe(&theirs)
            ),
        ))
    });
    agree(comm, checked)
}
