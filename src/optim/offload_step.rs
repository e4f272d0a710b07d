//! The offload case of `Optimizer::step_on`: host parameters (optimizer state and master
//! weights in host memory) whose gradients live on a GPU, and whose updated values the
//! model wants back on the GPU (a device *mirror*, `set_mirror`). Megatron's
//! `HybridDeviceOptimizer` overlaps those copies with the CPU work; so does fo: a copy
//! thread brings gradients down one tensor at a time into pinned buffers (kept across
//! steps) while the CPU pool steps the tensors already down, and each stepped tensor's
//! mirror is written back before the next one is stepped. With `check_numerics` on for an
//! offloaded parameter every gradient comes down first, so the check still runs before
//! anything changes.
use std::sync::{mpsc, Arc};

use rayon::prelude::*;

use super::gpu::backend::{backend, write_tensor, Backend};
use super::kernel::{self, Job};
use super::optimizer::{push_param_jobs, Optimizer};
use super::threads;
use crate::error::{Error, Result};
use crate::tensor::HostTensor;

/// Page-locked host memory for one parameter's gradient, reused by every step.
pub(crate) struct Pinned {
    backend: Arc<dyn Backend>,
    ptr: u64,
    bytes: usize,
}

// SAFETY: plain host memory; the address is only used while the optimizer is borrowed.
unsafe impl Send for Pinned {}
unsafe impl Sync for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by this backend; no copy into it is in flight once a step returned.
        unsafe { self.backend.free_pinned(self.ptr) }
    }
}

/// A device copy of a host parameter, rewritten after every step of the parameter.
pub(crate) struct Mirror {
    pub tensor: HostTensor,
    pub device: i32,
}

/// One offloaded gradient: where it is on the device, where it comes down to.
#[derive(Clone, Copy)]
struct Download {
    i: usize,
    src: u64,
    dst: u64,
    bytes: usize,
}

impl Optimizer {
    /// Makes `mirror` (device memory of `device`, the dtype and shape of host parameter
    /// `i`) a device copy of parameter `i`: written now and after every step or state
    /// write that changes the parameter. `None` removes it.
    ///
    /// # Safety
    /// `mirror` must be device memory of `device`, valid for writes until it is replaced
    /// or the optimizer is dropped.
    pub unsafe fn set_mirror(&mut self, i: usize, mirror: Option<(HostTensor, i32)>) -> Result<()> {
        self.check_index(i)?;
        let p = &self.params[i];
        let Some((t, device)) = mirror else {
            self.params[i].mirror = None;
            return Ok(());
        };
        if p.device >= 0 {
            return Err(Error::invalid(
                "mirror",
                format!(
                    "parameter {} is on CUDA device {} already; a mirror copies a host parameter",
                    p.fqn, p.device
                ),
            ));
        }
        if device < 0 {
            return Err(Error::invalid(
                "mirror.device",
                format!(
                    "parameter {}: a mirror is device memory (device >= 0), got {device}",
                    p.fqn
                ),
            ));
        }
        if t.dtype() != p.tensor.dtype() {
            return Err(Error::Dtype(format!(
                "mirror of parameter {}: dtype {} given, the parameter's {} expected",
                p.fqn,
                t.dtype(),
                p.tensor.dtype()
            )));
        }
        if t.shape() != p.tensor.shape() || !t.is_contiguous() {
            return Err(Error::Shape(format!(
                "mirror of parameter {}: {} {:?} (strides {:?}) given, a contiguous {} {:?} expected",
                p.fqn,
                t.dtype(),
                t.shape(),
                t.strides(),
                p.tensor.dtype(),
                p.tensor.shape()
            )));
        }
        self.check_stream_for(device, &format!("the mirror of parameter {}", p.fqn))?;
        // Kept only once written: a mirror that cannot be written leaves the old one.
        let old = self.params[i].mirror.replace(Mirror { tensor: t, device });
        self.refresh_mirror(i)
            .inspect_err(|_| self.params[i].mirror = old)
    }

    /// Writes parameter `i`'s bytes to its mirror, if it has one.
    pub(crate) fn refresh_mirror(&self, i: usize) -> Result<()> {
        let p = &self.params[i];
        let Some(m) = &p.mirror else { return Ok(()) };
        // SAFETY: host params are contiguous and valid; the mirror was checked at
        // `set_mirror` and is the caller's to keep valid.
        unsafe {
            let bytes = p.tensor.contiguous_bytes().expect("params are contiguous");
            write_tensor(&m.tensor, m.device, bytes, self.stream)
        }
    }

    /// Pinned buffers for the gradients of host parameters given on a device (the offload
    /// case), allocated once per parameter and kept; their downloads, in parameter order.
    pub(crate) fn prepare_offload(
        &mut self,
        grads: &[Option<HostTensor>],
        devices: &[i32],
    ) -> Result<Vec<(usize, i32)>> {
        let mut out = Vec::new();
        for (i, g) in grads.iter().enumerate() {
            let (Some(g), true) = (g, self.params[i].device < 0 && devices[i] >= 0) else {
                continue;
            };
            let bytes = g.nbytes();
            let fits = self.pinned[i].as_ref().is_some_and(|b| b.bytes == bytes);
            if !fits && bytes > 0 {
                let b = backend(devices[i])?;
                // SAFETY: a fresh allocation, owned by the `Pinned` made of it.
                let ptr = unsafe { b.alloc_pinned(bytes)? };
                self.pinned[i] = Some(Pinned {
                    backend: b,
                    ptr,
                    bytes,
                });
            }
            out.push((i, devices[i]));
        }
        Ok(out)
    }

    fn downloads(
        &self,
        grads: &[Option<HostTensor>],
        which: &[(usize, i32)],
    ) -> Vec<(Download, i32)> {
        which
            .iter()
            .filter_map(|&(i, dev)| {
                let g = grads[i].as_ref()?;
                let dst = self.pinned[i].as_ref().map_or(0, |b| b.ptr);
                let d = Download {
                    i,
                    src: g.as_ptr() as u64,
                    dst,
                    bytes: g.nbytes(),
                };
                Some((d, dev))
            })
            .collect()
    }

    /// The pinned copy of gradient `i` (after its download).
    ///
    /// # Safety
    /// The download into it must have completed; the slice must not outlive the step.
    unsafe fn staged_grad<'a>(&self, i: usize) -> &'a [u8] {
        match &self.pinned[i] {
            Some(b) => std::slice::from_raw_parts(b.ptr as *const u8, b.bytes),
            None => &[],
        }
    }

    /// Brings every offloaded gradient down now (before `check_numerics` reads them).
    ///
    /// # Safety
    /// As `step_on`.
    pub(crate) unsafe fn download_all<'a>(
        &self,
        grads: &[Option<HostTensor>],
        which: &[(usize, i32)],
    ) -> Result<Vec<(usize, &'a [u8])>> {
        let mut out = Vec::new();
        for (d, dev) in self.downloads(grads, which) {
            copy_down(d, dev, self.stream)?;
            out.push((d.i, self.staged_grad(d.i)));
        }
        Ok(out)
    }

    /// Steps host parameter `i` with gradient bytes `g` on the pool (its state exists).
    ///
    /// # Safety
    /// As `step_on`; `g` holds the gradient's contiguous bytes.
    unsafe fn step_host_param(&mut self, i: usize, g: &[u8], gt: &HostTensor) -> Result<()> {
        let pool = threads::pool()?;
        let mut jobs: Vec<Job<'_>> = Vec::new();
        let p = &mut self.params[i];
        push_param_jobs(&mut jobs, p, &self.groups[p.group], g, gt.dtype());
        pool.install(|| jobs.into_par_iter().for_each(kernel::run));
        Ok(())
    }

    /// The pipelined offload step: a copy thread brings the gradients down in order while
    /// this thread steps each one as it arrives and writes its mirror back.
    ///
    /// # Safety
    /// As `step_on`; the parameters in `which` have state.
    pub(crate) unsafe fn step_offloaded(
        &mut self,
        grads: &[Option<HostTensor>],
        which: &[(usize, i32)],
    ) -> Result<()> {
        if which.is_empty() {
            return Ok(());
        }
        let downloads = self.downloads(grads, which);
        let stream = self.stream;
        std::thread::scope(|s| {
            let (tx, rx) = mpsc::channel();
            s.spawn(move || {
                for (d, dev) in downloads {
                    // SAFETY: as `step_on`: the gradient is device memory of `dev`,
                    // the pinned buffer holds `bytes`.
                    let r = unsafe { copy_down(d, dev, stream) };
                    let failed = r.is_err();
                    if tx.send((d.i, r)).is_err() || failed {
                        return;
                    }
                }
            });
            for (i, r) in rx {
                r?;
                let g = self.staged_grad(i);
                self.step_host_param(i, g, grads[i].as_ref().expect("offloaded grads are given"))?;
                self.refresh_mirror(i)?;
            }
            Ok(())
        })
    }
}

impl Optimizer {
    /// The pinned buffer gradient `g` (on `device`) of host parameter `i` comes down to,
    /// allocated if needed (the overlapped step's offload case): its address.
    pub(crate) fn pinned_for(&mut self, i: usize, g: &HostTensor, device: i32) -> Result<u64> {
        let mut grads = vec![None; self.params.len()];
        let mut devices = vec![-1; self.params.len()];
        (grads[i], devices[i]) = (Some(g.clone()), device);
        self.prepare_offload(&grads, &devices)?;
        Ok(self.pinned[i].as_ref().map_or(0, |b| b.ptr))
    }
}

/// `bytes` of device memory at `src` (on `device`) into pinned host memory at `dst`,
/// after the work queued on `stream` (the overlapped step's offload case).
///
/// # Safety
/// As `copy_down`: `src` is device memory of `device`, `dst` holds `bytes`.
pub(crate) unsafe fn download(
    src: u64,
    dst: u64,
    bytes: usize,
    device: i32,
    stream: usize,
) -> Result<()> {
    copy_down(
        Download {
            i: 0,
            src,
            dst,
            bytes,
        },
        device,
        stream,
    )
}

/// One gradient, device to its pinned buffer, after the work queued on `stream`.
unsafe fn copy_down(d: Download, device: i32, stream: usize) -> Result<()> {
    if d.bytes == 0 {
        return Ok(());
    }
    let dst = std::slice::from_raw_parts_mut(d.dst as *mut u8, d.bytes);
    backend(device)?.download(d.src, dst, stream)
}

#[cfg(test)]
#[path = "offload_step_tests.rs"]
mod tests;
