//! The background half of an overlapped step (`overlap`): one bucket of host parameters
//! stepped on fo's pool while the caller goes on. Each parameter travels as an `Item`
//! that owns its state (moved out of the optimizer's table while the step is open) and a
//! view of its memory; it comes back as a `Done` carrying the undo record (the bytes and
//! state from before the step), the gradient's share of the clip norm, and what went
//! wrong, if anything. The arithmetic is `step`'s: the same `push_param_jobs` over the
//! same chunk jobs (reading the moments' values before the step from the undo record,
//! whose buffers they changed places with: `swap_moments`), the same `numerics` checks,
//! so a parameter gets the same bits here.
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};

use rayon::prelude::*;

use crate::clip::{grad_norms, ClipGrad};
use crate::error::{Error, Result};
use crate::kernels::host::{self as kernel, Job};
use crate::optim::math::config::OptimConfig;
use crate::optim::math::state::{Moment, MomentChunk, MomentView};
use crate::optim::optimizer::Param;
use crate::optim::step::numerics;
use crate::optim::step::push_param_jobs;
use crate::tensor::{try_with_capacity, Device, TensorView};

use super::fingerprint::Fingerprint;
use super::record::{fill_par, swap_moments, Saved};

/// One parameter handed to the pool. `param.state` is its state (fresh, zeroed, when
/// `fresh`), owned here until the item comes back.
pub(super) struct Item {
    pub i: usize,
    pub param: Param,
    pub cfg: OptimConfig,
    pub grad: TensorView,
    pub fresh: bool,
    /// The offload case: the gradient is on a device and comes down first.
    pub fetch: Option<Fetch>,
    /// The previous overlapped step's undo record of this parameter, to fill again.
    pub spare: Option<Saved>,
    /// Record a fingerprint of every byte of the gradient, not only a sampled one.
    pub full_fingerprint: bool,
}

/// A device gradient's way down to a host copy (through the device's pinned ring), on
/// `stream`: the device's down lane, ordered at hand-over after the gradient's producer.
pub(super) struct Fetch {
    pub src: u64,
    pub bytes: usize,
    pub device: Device,
    pub stream: usize,
}

/// One parameter back from the pool.
pub(super) struct Done {
    pub i: usize,
    pub param: Param,
    pub cfg: OptimConfig,
    grad: TensorView,
    /// A contiguous copy of a strided gradient.
    gathered: Option<Vec<u8>>,
    /// The moments (`m`, `v`) whose buffers changed places with the undo record's
    /// (`swap_moments`): the step reads their values from the record (`Job::old`).
    swapped: [bool; 2],
    pub fresh: bool,
    /// Taken before the step; None when the parameter was not stepped.
    pub undo: Option<Saved>,
    /// A rolled-back record's buffers, kept for the next step (`keep_spares`).
    pub spare: Option<Saved>,
    /// The gradient's `(largest |g|, sum |g|^p)` for the clip norm.
    pub partial: Option<(f64, f64)>,
    /// A failure before the step (the gradient check, the undo's allocation, a panic):
    /// the parameter was not stepped.
    pub error: Option<Error>,
    /// What the step made non-finite (groups with `check_numerics`).
    pub bad_result: Option<String>,
    /// The gradient the step read, for `grads_changed` (None: brought down from a device).
    pub fingerprint: Option<Fingerprint>,
}

impl Done {
    /// The undo record's size (what a rollback copies back).
    pub fn undo_bytes(&self) -> usize {
        self.undo.as_ref().map_or(0, Saved::nbytes)
    }

    /// Puts the parameter's memory back as it was before its step (the state is the
    /// caller's to put back: `undo.state`).
    ///
    /// # Safety
    /// The parameter's memory must be valid and not in use by anyone else.
    pub unsafe fn restore_memory(&self) {
        if let Some(u) = &self.undo {
            let dst = self.param.tensor().contiguous_bytes_mut();
            dst.expect("parameters are contiguous")
                .copy_from_slice(&u.bytes);
        }
    }
}

/// Where a moment chunk's values start and how many it has (for its offset in the
/// moment: the chunks are `Moment::range_chunks_mut`'s).
fn chunk_at(c: &MomentChunk<'_>) -> (usize, usize, usize) {
    match c {
        MomentChunk::F32(s) => (s.as_ptr() as usize, s.len(), 4),
        MomentChunk::Half(_, s) => (s.as_ptr() as usize, s.len(), 2),
        MomentChunk::Signed(q, _) => (q.as_ptr() as usize, q.len(), 1),
        MomentChunk::Unsigned(q, _, _) => (q.as_ptr() as usize, q.len(), 1),
    }
}

/// The address of a moment's values (f32 values, 16-bit patterns or 8-bit codes).
fn moment_base(m: &Moment) -> usize {
    match m {
        Moment::F32(b) => b.as_ptr() as usize,
        Moment::Half(_, v) => v.as_ptr() as usize,
        Moment::Signed { codes, .. } => codes.as_ptr() as usize,
        Moment::Unsigned { codes, .. } => codes.as_ptr() as usize,
    }
}

fn panic_error(what: &str, p: Box<dyn std::any::Any + Send>) -> Error {
    let msg = crate::error::panic_message(p.as_ref()).unwrap_or("unknown panic");
    Error::Internal(format!("{what} panicked: {msg}"))
}

/// Checks and records one parameter before its step: gathers a strided gradient,
/// takes its share of the clip norm (`clip_p`: the norm type when clipping), runs
/// `check_numerics`' checks and captures the undo record.
///
/// # Safety
/// As `run`.
unsafe fn prepare(it: Item, clip_p: Option<f64>) -> Done {
    let spare = it.spare;
    let mut d = Done {
        i: it.i,
        param: it.param,
        cfg: it.cfg,
        grad: it.grad,
        gathered: None,
        swapped: [false, false],
        fresh: it.fresh,
        undo: None,
        spare: None,
        partial: None,
        error: None,
        bad_result: None,
        fingerprint: None,
    };
    let (full_fingerprint, came_down) = (it.full_fingerprint, it.fetch.is_some());
    let r = catch_unwind(AssertUnwindSafe(|| -> Result<()> {
        if let Some(f) = it.fetch {
            // From here on the gradient is its host copy, as in `step_offloaded`; the
            // copy is contiguous, so it is kept where a gathered gradient would be.
            let mut host = crate::optim::placement::offload_step::download(
                f.src, f.bytes, f.device, f.stream,
            )?;
            let shape: Vec<i64> = d.grad.shape().iter().map(|&n| n as i64).collect();
            d.grad = TensorView::host(host.as_mut_ptr(), d.grad.dtype(), &shape, None, "grads")?;
            d.gathered = Some(host);
        }
        if !d.grad.is_contiguous() {
            d.gathered = Some(d.grad.try_to_tensor("grads")?.data);
        }
        if let Some(p) = clip_p {
            let g = ClipGrad {
                tensor: d.grad.clone(),
                is_shard: false,
            };
            d.partial = Some(grad_norms(&[g], p, 0)?[0]);
        }
        let g = match &d.gathered {
            Some(v) => &v[..],
            None => d.grad.contiguous_bytes().expect("contiguous"),
        };
        numerics::check_param(&d.param, &d.cfg, g, d.grad.dtype())?;
        if !came_down {
            d.fingerprint = Some(Fingerprint::of(g, full_fingerprint));
        }
        let now = d.param.tensor().contiguous_bytes();
        let now = now.expect("parameters are contiguous");
        // The last step's record is refilled in place: fresh memory would be faulted in
        // page by page at every step (as costly as the copy itself).
        let (bytes, mut state) = match spare {
            Some(s) => (Some(s.bytes), s.state),
            None => (None, None),
        };
        let mut bytes = match bytes {
            Some(b) if b.capacity() >= now.len() => b,
            _ => try_with_capacity(now.len(), "the overlapped step's undo record")?,
        };
        fill_par(&mut bytes, now);
        let state = match (&mut d.param.state, d.fresh) {
            (Some(live), false) => {
                d.swapped = swap_moments(&mut state, live);
                state
            }
            _ => None,
        };
        d.undo = Some(Saved { bytes, state });
        Ok(())
    }));
    match r {
        Ok(Ok(())) => {}
        Ok(Err(e)) => d.error = Some(e),
        Err(p) => d.error = Some(panic_error("checking a gradient", p)),
    }
    d
}

/// Steps one bucket: checks and undo records for every parameter (in parallel), then the
/// chunk jobs of every parameter that passed (in parallel, as `step` runs them), then
/// `check_numerics`' look at the results. Runs on fo's pool.
///
/// # Safety
/// Each item's parameter memory must be valid and touched by nothing else until the
/// items come back; each gradient valid for reads and unchanged meanwhile.
pub(super) unsafe fn run(items: Vec<Item>, clip_p: Option<f64>) -> Vec<Done> {
    let mut dones: Vec<Done> = items
        .into_par_iter()
        .map(|it| prepare(it, clip_p))
        .collect();
    let stepped = catch_unwind(AssertUnwindSafe(|| {
        let mut jobs: Vec<Job<'_>> = Vec::new();
        for d in dones.iter_mut().filter(|d| d.undo.is_some()) {
            let Done {
                param,
                cfg,
                grad,
                gathered,
                swapped,
                undo,
                ..
            } = d;
            let g = match gathered {
                Some(v) => &v[..],
                None => grad.contiguous_bytes().expect("contiguous"),
            };
            // The moments' values before the step, where they changed places with the
            // record: each chunk reads them at its own offset there.
            let rec = undo.as_ref().and_then(|u| u.state.as_ref());
            let live = param.state.as_ref();
            let from: [Option<(&Moment, usize)>; 2] = [0, 1].map(|k| {
                match (
                    swapped[k],
                    rec.and_then(|s| s.moment(k)),
                    live.and_then(|s| s.moment(k)),
                ) {
                    (true, Some(r), Some(l)) => Some((r, moment_base(l))),
                    _ => None,
                }
            });
            let mut own = Vec::new();
            push_param_jobs(&mut own, param, cfg, g, grad.dtype());
            for mut job in own {
                for (k, c) in [&job.m, &job.v].into_iter().enumerate() {
                    let (Some((r, base)), Some(c)) = (from[k], c) else {
                        continue;
                    };
                    let (ptr, len, size) = chunk_at(c);
                    let at = (ptr - base) / size;
                    job.old[k] = Some(r.view(at, at + len));
                }
                jobs.push(job);
            }
        }
        jobs.into_par_iter().for_each(|mut job| {
            // An f32 moment updated in place gets its values before the step in one copy
            // of the chunk, just before its kernel (read through `Job::old` block by
            // block, the overlapped fp32 step was 1.4x slower; decoded block by block
            // and streamed into the chunk with non-temporal stores, 1.04-1.09x slower).
            for (c, o) in [&mut job.m, &mut job.v].into_iter().zip(&mut job.old) {
                if let (Some(MomentChunk::F32(s)), Some(MomentView::F32(from))) = (c.as_mut(), &*o)
                {
                    s.copy_from_slice(from);
                    *o = None;
                }
            }
            kernel::run(job)
        });
    }));
    if let Err(p) = stepped {
        let e = panic_error("the step's kernels", p);
        for d in dones.iter_mut().filter(|d| d.undo.is_some()) {
            d.error.get_or_insert(Error::Internal(e.to_string()));
        }
        return dones;
    }
    for d in dones.iter_mut() {
        if d.undo.is_some() && d.cfg.check_numerics {
            d.bad_result = numerics::result_non_finite(&d.param);
        }
    }
    dones
}

/// Where buckets come back: how many are still on the pool, and the parameters of those
/// that are done.
pub(super) struct Inbox {
    state: Mutex<(usize, Vec<Done>)>,
    landed: Condvar,
}

impl Inbox {
    pub fn new() -> Arc<Inbox> {
        Arc::new(Inbox {
            state: Mutex::new((0, Vec::new())),
            landed: Condvar::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, Vec<Done>)> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a bucket going to the pool; the returned delivery hands its parameters back
    /// when dropped (also if the task unwinds), so a wait never hangs.
    pub fn expect(self: &Arc<Inbox>) -> Delivery {
        self.lock().0 += 1;
        Delivery {
            inbox: self.clone(),
            dones: Vec::new(),
        }
    }

    /// The clip-norm shares of the gradients whose task is back: the largest `|g|` and
    /// the sum of `|g|^p` over them (as `clip::grad_norms` gives each).
    pub fn arrived_partials(&self) -> (f64, f64) {
        let g = self.lock();
        g.1.iter()
            .filter_map(|d| d.partial)
            .fold((0.0, 0.0), |(m, s), (pm, ps)| (f64::max(m, pm), s + ps))
    }

    /// Buckets still on the pool (tests wait for them).
    #[cfg(test)]
    pub fn pending(&self) -> usize {
        self.lock().0
    }

    /// Waits until every bucket sent to the pool is back; the fingerprints of the
    /// gradients their steps read, by parameter (`fingerprint::grads_changed`).
    pub fn fingerprints(&self) -> Vec<(usize, Option<Fingerprint>)> {
        self.landed_all()
            .1
            .iter()
            .filter(|d| d.undo.is_some() && d.error.is_none())
            .map(|d| (d.i, d.fingerprint))
            .collect()
    }

    /// Waits until every bucket sent to the pool is back; takes their parameters.
    /// The work always ends (kernels over finite memory), so no timeout.
    pub fn wait_all(&self) -> Vec<Done> {
        std::mem::take(&mut self.landed_all().1)
    }

    /// The inbox once every bucket sent to the pool is back.
    fn landed_all(&self) -> std::sync::MutexGuard<'_, (usize, Vec<Done>)> {
        let mut g = self.lock();
        while g.0 > 0 {
            g = self.landed.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        g
    }
}

/// A bucket's way back to its `Inbox`.
pub(super) struct Delivery {
    inbox: Arc<Inbox>,
    pub dones: Vec<Done>,
}

impl Drop for Delivery {
    fn drop(&mut self) {
        let mut g = self.inbox.lock();
        g.1.append(&mut self.dones);
        g.0 -= 1;
        self.inbox.landed.notify_all();
    }
}
