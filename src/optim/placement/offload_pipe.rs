//! The offload step as a pipeline at the bus's speed: host parameters (master weights
//! and state in host memory) whose gradients are on a GPU and whose updated values go
//! back to device mirrors.
//!
//! Each tensor is cut into pieces of at most one lane slot (`device::lanes`). Gradient
//! pieces come down on the device's down stream, up to `LANE_SLOTS` ahead of the one being
//! stepped; each piece is stepped straight from its pinned slot by every core of fo's
//! pool, each job copying its freshly written parameter bytes into an up slot while they
//! are still in cache; the up stream copies that slot into the mirror while the next
//! pieces step. So both copy directions and all cores are busy at once, the only host
//! copy is the one into the up slot, and nothing is allocated per step (the slots and
//! streams are the device's, made once).
//!
//! Ordering is by events: the down stream waits for the work queued on the optimizer's
//! stream before the step (the gradients' producer; the up copies, queued only after a
//! down copy completed, come after it too, so after whatever read the mirrors), and the
//! optimizer's stream waits for the up stream at the end (what runs after the step sees
//! the new mirrors). The host waits only for the pieces it steps.
use rayon::prelude::*;

use crate::device::lanes::{Dir, LANE_SLOTS, LANE_SLOT_BYTES};
use crate::device::open::backend;
use crate::error::Result;
use crate::kernels::host::{self as kernel, chunk_for, push_range_jobs, Job};
use crate::optim::math::rule::Rule;
use crate::optim::optimizer::Optimizer;
use crate::optim::step::begin_param_step;
use crate::optim::threads;
use crate::tensor::{Device, TensorView};

/// Elements `lo..hi` of parameter `i`: one slot's worth of its gradient and of its mirror.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Piece {
    pub i: usize,
    pub lo: usize,
    pub hi: usize,
}

/// Cuts `n` elements into pieces of at most `slot` bytes per element of `elem_bytes`,
/// each starting at a multiple of `unit` elements (the jobs' chunk, so a piece's jobs
/// are the whole-tensor step's jobs over it: the same bits).
fn cut(i: usize, n: usize, elem_bytes: usize, unit: usize, slot: usize) -> Vec<Piece> {
    let per = (slot / elem_bytes) / unit * unit;
    assert!(per > 0, "a lane slot holds at least one job's chunk");
    (0..n)
        .step_by(per)
        .map(|lo| Piece {
            i,
            lo,
            hi: (lo + per).min(n),
        })
        .collect()
}

/// A raw address the pool's jobs copy to or from (each job its own bytes).
#[derive(Clone, Copy)]
struct Addr(usize);

impl Optimizer {
    /// The pieces of the offloaded parameters in `which` (all with gradients and state).
    fn pieces(&self, grads: &[Option<TensorView>], which: &[usize]) -> Vec<Piece> {
        let mut out = Vec::new();
        for &i in which {
            let p = self.entry(i);
            let g = grads[i].as_ref().expect("offloaded grads are given");
            let st = p.state.as_ref().expect("offloaded params have state");
            let unit = chunk_for(p.tensor().dtype(), g.dtype(), st);
            let mut es = g.dtype().size();
            if p.mirror.is_some() {
                es = es.max(p.tensor().dtype().size());
            }
            out.extend(cut(i, p.tensor().numel(), es, unit, LANE_SLOT_BYTES));
        }
        out
    }

    /// Steps the host parameters in `which` (gradients on `device`, state present) through
    /// `device`'s lanes, writing their mirrors on the way (see the module doc).
    ///
    /// # Safety
    /// As `step`: the gradients are device memory of `device`, mirrors valid.
    pub(super) unsafe fn step_pipelined(
        &mut self,
        grads: &[Option<TensorView>],
        device: Device,
        which: &[usize],
    ) -> Result<()> {
        let pieces = self.pieces(grads, which);
        let pool = threads::pool()?;
        let b = backend(device)?;
        let mut lanes = b.lanes().hold(&*b)?;
        let (down, up) = (lanes.stream(Dir::Down), lanes.stream(Dir::Up));
        let mirrored = which.iter().any(|&i| self.entry(i).mirror.is_some());
        // The down stream waits for the gradients' producer. The up stream needs no wait
        // of its own: every up copy is queued after the host saw a down copy complete,
        // which came after everything queued on the optimizer's stream before the step
        // (whatever read the mirrors included).
        b.order_streams(self.stream(), down)?;
        let src = |k: usize| -> (u64, usize) {
            let Piece { i, lo, hi } = pieces[k];
            let g = grads[i].as_ref().expect("offloaded grads are given");
            let es = g.dtype().size();
            (g.as_ptr() as u64 + (lo * es) as u64, (hi - lo) * es)
        };
        for k in 0..pieces.len().min(LANE_SLOTS) {
            let (at, bytes) = src(k);
            lanes.start_down(k, at, bytes)?;
        }
        // Every parameter's step is counted up front (empty ones have no piece).
        let mut rules: Vec<Option<(Rule, bool)>> = vec![None; self.num_params()];
        let (params, groups) = self.params_mut_with_groups();
        for &i in which {
            let p = &mut params[i];
            rules[i] = begin_param_step(p, &groups[p.group()]);
        }
        for (k, &Piece { i, lo, hi }) in pieces.iter().enumerate() {
            let gt = grads[i].as_ref().expect("offloaded grads are given");
            let gd = lanes.finish_down(k)?;
            let (rule, first) = rules[i].expect("offloaded params have state");
            let p = self.entry_mut(i);
            let es = p.tensor().dtype().size();
            let chunk = chunk_for(
                p.tensor().dtype(),
                gt.dtype(),
                p.state.as_ref().expect("state"),
            );
            let mirror = match &p.mirror {
                Some(m) => Some((m.tensor.as_ptr() as u64, Addr(lanes.up_slot(k)? as usize))),
                None => None,
            };
            let param = Addr(p.tensor().as_ptr() as usize + lo * es);
            let g = std::slice::from_raw_parts(gd, (hi - lo) * gt.dtype().size());
            let mut jobs: Vec<Job<'_>> = Vec::new();
            let (tensor, state) = p.tensor_and_state();
            let st = state.as_mut().expect("offloaded params have state");
            push_range_jobs(&mut jobs, tensor, lo..hi, g, gt.dtype(), st, rule, first);
            let slot = mirror.map(|(_, s)| s);
            pool.install(|| {
                jobs.into_par_iter().enumerate().for_each(|(j, job)| {
                    let n = job.p.len();
                    kernel::run(job);
                    if let Some(Addr(slot)) = slot {
                        // SAFETY: this job's own bytes of the parameter (just written)
                        // and of the up slot (idle since `up_slot`, one piece in size).
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                (param.0 + j * chunk * es) as *const u8,
                                (slot + j * chunk * es) as *mut u8,
                                n * es,
                            )
                        }
                    }
                })
            });
            if let Some((dst, _)) = mirror {
                lanes.start_up(k, dst + (lo * es) as u64, (hi - lo) * es)?;
            }
            // The slot is free again (its piece is stepped): the next piece comes into it.
            if k + LANE_SLOTS < pieces.len() {
                let (at, bytes) = src(k + LANE_SLOTS);
                lanes.start_down(k + LANE_SLOTS, at, bytes)?;
            }
        }
        if mirrored {
            b.order_streams(up, self.stream())?;
        }
        Ok(())
    }
}

impl Optimizer {
    /// Writes the mirrors of the parameters in `which` (those without one are skipped)
    /// through their devices' up lanes: each parameter in slot-sized pieces, copied into
    /// an up slot by the pool and up on the lane's stream while the next piece is
    /// copied, ordered after the work queued on the optimizer's stream (what read the
    /// mirrors) and before what is queued there next. The host never waits for the
    /// device, only for a slot's previous copy.
    ///
    /// # Safety
    /// Mirrors are valid (as `set_mirror` requires).
    pub(in crate::optim) unsafe fn write_mirrors(
        &self,
        which: impl IntoIterator<Item = usize>,
    ) -> Result<()> {
        let mut by_device: Vec<(Device, Vec<usize>)> = Vec::new();
        for i in which {
            let Some(m) = &self.entry(i).mirror else {
                continue;
            };
            match by_device.iter_mut().find(|(d, _)| *d == m.device()) {
                Some((_, v)) => v.push(i),
                None => by_device.push((m.device(), vec![i])),
            }
        }
        if by_device.is_empty() {
            return Ok(());
        }
        let pool = threads::pool()?;
        for (device, params) in by_device {
            let b = backend(device)?;
            let mut lanes = b.lanes().hold(&*b)?;
            let up = lanes.stream(Dir::Up);
            b.order_streams(self.stream(), up)?;
            let mut k = 0;
            for i in params {
                let p = self.entry(i);
                let m = p.mirror.as_ref().expect("picked above");
                let bytes = p
                    .tensor()
                    .contiguous_bytes()
                    .expect("params are contiguous");
                for (n, piece) in bytes.chunks(LANE_SLOT_BYTES).enumerate() {
                    let slot = Addr(lanes.up_slot(k)? as usize);
                    let src = Addr(piece.as_ptr() as usize);
                    // In parallel: one core's memcpy is well below the bus's speed.
                    pool.install(|| {
                        (0..piece.len().div_ceil(COPY_SPAN))
                            .into_par_iter()
                            .for_each(|c| {
                                let at = c * COPY_SPAN;
                                let len = COPY_SPAN.min(piece.len() - at);
                                // SAFETY: disjoint spans of the piece and of the idle slot.
                                unsafe {
                                    std::ptr::copy_nonoverlapping(
                                        (src.0 + at) as *const u8,
                                        (slot.0 + at) as *mut u8,
                                        len,
                                    )
                                }
                            })
                    });
                    let dst = m.tensor.as_ptr() as u64 + (n * LANE_SLOT_BYTES) as u64;
                    lanes.start_up(k, dst, piece.len())?;
                    k += 1;
                }
            }
            b.order_streams(up, self.stream())?;
        }
        Ok(())
    }
}

/// Bytes one pool job copies into an up slot.
const COPY_SPAN: usize = 256 << 10;

#[cfg(test)]
#[path = "offload_pipe_tests.rs"]
mod tests;

#[cfg(test)]
mod cut_tests {
    use super::*;

    #[test]
    fn pieces_cover_the_tensor_at_chunk_multiples_within_a_slot() {
        let ps = cut(3, 100_000, 4, 2048, 128 << 10);
        assert_eq!(ps.first().unwrap().lo, 0);
        assert_eq!(ps.last().unwrap().hi, 100_000);
        for w in ps.windows(2) {
            assert_eq!(w[0].hi, w[1].lo);
        }
        for p in &ps {
            assert_eq!(p.lo % 2048, 0);
            assert!((p.hi - p.lo) * 4 <= 128 << 10);
            assert_eq!(p.i, 3);
        }
        assert_eq!(ps.len(), 100_000usize.div_ceil(32768));
        assert!(cut(0, 0, 2, 2048, 128 << 10).is_empty());
    }
}
