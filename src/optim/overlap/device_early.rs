//! Early steps of device parameters in an overlapped step: a device parameter's gradient
//! handed over while backward goes on is stepped at once by its kernel, queued on its
//! device's step lane (`lanes::Dir::Step`), which waits for the work queued on the
//! optimizer's stream at hand-over (the gradient's producer) and for nothing queued after:
//! the step runs on the GPU beside the rest of backward, not behind it. No host thread
//! waits for anything.
//!
//! As on the host, every early step is speculative: before its kernel, the lane copies the
//! parameter's bytes and its state (when it had one) into an undo record in stream-ordered
//! device memory (`alloc_async`), so that `step_end` can put it back when the clip scales
//! or the step fails, and `step_abort` when the loop drops the step. A record that cannot
//! be allocated leaves its parameter for `step_end` (`deferred`): device memory full never
//! fails a step that `overlap=False` would take. Records are freed at `step_end` /
//! `step_abort`, in order on the optimizer's stream, which by then waits for the lanes.
//!
//! The records of one hand-over on one lane share one allocation (each record 256-byte
//! aligned in it), and a record is two copies (the parameter, its state's one block): on an
//! H200 each hand-over's driver calls cost about 40 µs of host time per parameter (48
//! gradients in one call: 1.8-2.2 ms), which a backward bound by the host's launches waits
//! for. Where that allocation fails, each record gets its own.
use std::sync::Arc;

use super::open::OpenStep;
use crate::device::backend::Backend;
use crate::device::lanes::Dir;
use crate::error::Result;
use crate::optim::optimizer::Optimizer;
use crate::tensor::TensorView;

/// A device parameter stepped early: where its bytes and state were saved.
pub(crate) struct DeviceUndo {
    pub i: usize,
    backend: Arc<dyn Backend>,
    /// The step lane the record was written and the step launched on.
    lane: usize,
    /// `param_bytes` of the parameter, then its state's block (`DeviceState::copy_with`).
    ptr: u64,
    /// Whether freeing this record frees `ptr`: a record alone, or the first of those
    /// sharing one allocation (its `ptr` is the allocation's start; the others lie after
    /// it, and are freed with it).
    owns: bool,
    param: u64,
    param_bytes: usize,
    /// The state's `(step, m_valid)` before, or None: the early step created the state.
    before: Option<(u64, bool)>,
}

impl DeviceUndo {
    /// What the record holds (parameter bytes + state bytes).
    pub fn bytes(&self, state_bytes: usize) -> usize {
        self.param_bytes + self.before.map_or(0, |_| state_bytes)
    }

    /// Frees the record's memory where it owns it, in order on `stream`, after the work
    /// queued there.
    ///
    /// # Safety
    /// No work on another stream uses the record, nor any record sharing its memory (so
    /// records of one allocation are freed together, after all their copies).
    unsafe fn free_on(self, stream: usize) {
        if self.owns {
            self.backend.free_async(self.ptr, stream);
        }
    }

    /// Frees the record in order on its lane, after the work queued there.
    ///
    /// # Safety
    /// As `free_on`.
    unsafe fn discard(self) {
        let lane = self.lane;
        self.free_on(lane);
    }

    /// Puts the parameters' bytes back in order on their lanes and waits for it, then
    /// frees the records: an open step dropped with its optimizer (the state goes with it).
    ///
    /// # Safety
    /// The parameters' memory is still valid.
    pub unsafe fn restore_params_and_free(records: Vec<DeviceUndo>) {
        for r in &records {
            let b = &r.backend;
            let _ = b.copy_on_device(r.param, r.ptr, r.param_bytes, r.lane);
            if let Ok(ev) = b.record_event(r.lane) {
                let _ = b.wait_event(ev);
            }
        }
        records.into_iter().for_each(|r| r.discard());
    }
}

/// A device parameter to step early, before memory is found for its record.
struct Plan<'g> {
    i: usize,
    grad: &'g TensorView,
    backend: Arc<dyn Backend>,
    lane: usize,
    param: u64,
    param_bytes: usize,
    before: Option<(u64, bool)>,
    /// The record's size: the parameter's bytes, then its state's block.
    bytes: usize,
}

impl Plan<'_> {
    /// Its undo record at `ptr` (`owns`: as `DeviceUndo::owns`).
    fn record(&self, ptr: u64, owns: bool) -> DeviceUndo {
        DeviceUndo {
            i: self.i,
            backend: self.backend.clone(),
            lane: self.lane,
            ptr,
            owns,
            param: self.param,
            param_bytes: self.param_bytes,
            before: self.before,
        }
    }
}

/// Where each record of `bytes` starts in one allocation for all of them, and its size.
fn pack(bytes: &[usize]) -> (Vec<usize>, usize) {
    let mut end = 0usize;
    let at = bytes.iter().map(|&b| {
        let at = end.next_multiple_of(256);
        end = at + b;
        at
    });
    (at.collect(), end)
}

impl Optimizer {
    /// Steps device parameters `idx` (their gradients `grads`, checked) early on their
    /// devices' step lanes, each after an undo record, which goes to the open step.
    /// Returns the parameters left for `step_end` (no device memory for their record).
    /// An error before any launch leaves nothing behind (the records are freed); one
    /// from a launch leaves the records with the step, which fails.
    ///
    /// # Safety
    /// As `grads_ready`; the parameters are this step's and not handed over yet.
    pub(super) unsafe fn step_early_on_device(
        &mut self,
        idx: &[usize],
        grads: &[TensorView],
    ) -> Result<Vec<usize>> {
        let stream = self.stream();
        let mut plans = Vec::with_capacity(idx.len());
        for (&i, grad) in idx.iter().zip(grads) {
            let p = self.entry(i);
            let (backend, lane) = crate::device::open::backend(p.device())
                .and_then(|b| b.lanes().stream(&*b, Dir::Step).map(|lane| (b, lane)))?;
            let param_bytes = p.tensor().nbytes();
            plans.push(Plan {
                i,
                grad,
                backend,
                lane,
                param: p.tensor().as_ptr() as u64,
                param_bytes,
                before: p.gpu.as_ref().map(|s| (s.step, s.m_valid)),
                bytes: param_bytes + p.gpu.as_ref().map_or(0, |s| s.record_bytes()),
            });
        }
        let mut records: Vec<DeviceUndo> = Vec::with_capacity(idx.len());
        let mut deferred = Vec::new();
        let mut given: Vec<(usize, &TensorView)> = Vec::with_capacity(idx.len());
        let mut lanes_seen: Vec<usize> = Vec::new();
        for lane in plans.iter().map(|p| p.lane) {
            if lanes_seen.contains(&lane) {
                continue;
            }
            lanes_seen.push(lane);
            let on_lane: Vec<&Plan> = plans.iter().filter(|p| p.lane == lane).collect();
            let (offsets, total) = pack(&on_lane.iter().map(|p| p.bytes).collect::<Vec<_>>());
            let block = on_lane[0].backend.alloc_async(total, lane).ok();
            for (k, p) in on_lane.into_iter().enumerate() {
                let (ptr, owns) = match block {
                    Some(base) => (Ok(base + offsets[k] as u64), k == 0),
                    None => (p.backend.alloc_async(p.bytes, lane), true),
                };
                match ptr {
                    Ok(ptr) => {
                        given.push((p.i, p.grad));
                        records.push(p.record(ptr, owns));
                    }
                    Err(_) => deferred.push(p.i),
                }
            }
        }
        // By index, as `step` lays its tables out.
        given.sort_by_key(|&(i, _)| i);
        let prepared = match self.prepare_device_step_of(&given) {
            Ok(s) => s,
            Err(e) => {
                records.into_iter().for_each(|r| r.discard());
                return Err(e);
            }
        };
        // The lanes wait for the producer (and for fresh state's zeroing, queued on the
        // optimizer's stream by `prepare_device_step`), then save what the kernels write.
        let mut ordered: Vec<usize> = Vec::new();
        let mut saved: Result<()> = Ok(());
        for r in &records {
            if !ordered.contains(&r.lane) {
                saved = saved.and_then(|_| r.backend.order_streams(stream, r.lane));
                ordered.push(r.lane);
            }
            saved = saved
                .and_then(|_| {
                    r.backend
                        .copy_on_device(r.ptr, r.param, r.param_bytes, r.lane)
                })
                .and_then(|_| match (&self.entry(r.i).gpu, r.before) {
                    (Some(st), Some(_)) => {
                        st.copy_with(r.ptr + r.param_bytes as u64, false, r.lane)
                    }
                    _ => Ok(()),
                });
        }
        if let Err(e) = saved {
            // Nothing was launched: the records are dropped after what was queued.
            records.into_iter().for_each(|r| r.discard());
            return Err(e);
        }
        // Kept before any launch: from here on a failure is the step's, and `step_end`
        // puts back what the records saved.
        let lanes: Vec<(Arc<dyn Backend>, usize)> = records
            .iter()
            .map(|r| (r.backend.clone(), r.lane))
            .collect();
        self.open_step_mut()
            .expect("an open step")
            .device
            .extend(records);
        match lanes.split_first() {
            None => {}
            Some(((_, l), rest)) if rest.iter().all(|(_, o)| o == l) => {
                self.run_device_step(prepared, *l)?;
            }
            // Parameters on several devices (the optimizer's stream is then 0): each
            // device's legacy stream, ordered after its lane.
            Some(_) => {
                for (b, l) in &lanes {
                    b.order_streams(*l, 0)?;
                }
                self.run_device_step(prepared, 0)?;
            }
        }
        Ok(deferred)
    }

    /// The optimizer's stream (and `also`, e.g. the clip's) wait for the work queued on
    /// the step lanes of `open`'s early device steps.
    ///
    /// # Safety
    /// The streams are valid for the records' devices.
    pub(super) unsafe fn join_lanes(&self, open: &OpenStep, also: Option<usize>) -> Result<()> {
        let mut done: Vec<usize> = Vec::new();
        for r in &open.device {
            if done.contains(&r.lane) {
                continue;
            }
            done.push(r.lane);
            r.backend.order_streams(r.lane, self.stream())?;
            if let Some(s) = also.filter(|&s| s != self.stream()) {
                r.backend.order_streams(r.lane, s)?;
            }
        }
        Ok(())
    }

    /// Puts every early-stepped device parameter back (memory and state; a state the
    /// step created is dropped) in order on the optimizer's stream, after `join_lanes`.
    /// Returns (parameters, bytes) put back.
    ///
    /// # Safety
    /// `join_lanes` ran; the parameters are still valid.
    pub(super) unsafe fn roll_back_device(&mut self, open: &mut OpenStep) -> Result<(u64, u64)> {
        let stream = self.stream();
        let (mut n, mut bytes) = (0, 0);
        let mut first_err = None;
        let records = std::mem::take(&mut open.device);
        for r in &records {
            let state_bytes = self.entry(r.i).gpu.as_ref().map_or(0, |s| s.nbytes());
            let mut put = r
                .backend
                .copy_on_device(r.param, r.ptr, r.param_bytes, stream);
            match r.before {
                Some((step, m_valid)) => {
                    let st = self.entry_mut(r.i).gpu.as_mut().expect("saved with state");
                    put =
                        put.and_then(|_| st.copy_with(r.ptr + r.param_bytes as u64, true, stream));
                    (st.step, st.m_valid) = (step, m_valid);
                }
                None => self.entry_mut(r.i).gpu = None,
            }
            bytes += r.bytes(state_bytes) as u64;
            n += 1;
            if let Err(e) = put {
                first_err.get_or_insert(e);
            }
        }
        // After every copy back: records share allocations.
        records.into_iter().for_each(|r| r.free_on(stream));
        first_err.map_or(Ok((n, bytes)), Err)
    }

    /// Frees the undo records of early device steps that stand, in order on the
    /// optimizer's stream (after `join_lanes`).
    ///
    /// # Safety
    /// `join_lanes` ran.
    pub(super) unsafe fn free_device_undo(&self, open: &mut OpenStep) {
        for r in std::mem::take(&mut open.device) {
            r.free_on(self.stream());
        }
    }
}

#[cfg(test)]
mod pack_tests {
    #[test]
    fn records_sharing_an_allocation_start_256_byte_aligned_and_do_not_overlap() {
        let (at, total) = super::pack(&[10, 0, 300, 256, 1]);
        assert_eq!(at, [0, 256, 256, 768, 1024]);
        assert_eq!(total, 1025);
        assert_eq!(super::pack(&[]), (vec![], 0));
    }
}
