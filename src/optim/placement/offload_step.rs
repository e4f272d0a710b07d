//! The offload case of `Optimizer::step`: host parameters (optimizer state and master
//! weights in host memory) whose gradients live on a GPU, and whose updated values the
//! model wants back on the GPU (a device *mirror*, `set_mirror`), as Megatron's
//! `HybridDeviceOptimizer` and FSDP2's `CPUOffloadPolicy` place them. The step itself is
//! the pipeline in `offload_pipe`; here are the mirrors, and the gradients brought down
//! whole where they must be read before anything changes (`check_numerics`) or one at a
//! time (the overlapped step's tasks).
use super::Mirror;
use crate::device::open::{backend, write_tensor};
use crate::error::{Error, Result};
use crate::optim::optimizer::Optimizer;
use crate::tensor::{Device, TensorView};

/// One offloaded gradient: where it is on the device, and its size.
#[derive(Clone, Copy)]
struct Download {
    i: usize,
    src: u64,
    bytes: usize,
}

impl Optimizer {
    /// Makes `mirror` (memory of a CUDA device, the dtype and shape of host parameter
    /// `i`) a device copy of parameter `i`: written now and after every step or state
    /// write that changes the parameter. `None` removes it.
    ///
    /// # Safety
    /// `mirror` must be memory of its device, valid for writes until it is replaced or
    /// the optimizer is dropped.
    pub unsafe fn set_mirror(&mut self, i: usize, mirror: Option<TensorView>) -> Result<()> {
        self.check_index(i)?;
        let p = self.entry(i);
        let Some(t) = mirror else {
            self.entry_mut(i).mirror = None;
            return Ok(());
        };
        let device = t.device();
        if p.device().is_cuda() {
            return Err(Error::invalid(
                "mirror",
                format!(
                    "parameter {} is on CUDA device {} already; a mirror copies a host parameter",
                    p.fqn(),
                    p.device().to_c()
                ),
            ));
        }
        if device.is_host() {
            return Err(Error::invalid(
                "mirror.device",
                format!(
                    "parameter {}: a mirror is device memory (device >= 0), got {}",
                    p.fqn(),
                    device.to_c()
                ),
            ));
        }
        if t.dtype() != p.tensor().dtype() {
            return Err(Error::Dtype(format!(
                "mirror of parameter {}: dtype {} given, the parameter's {} expected",
                p.fqn(),
                t.dtype(),
                p.tensor().dtype()
            )));
        }
        if t.shape() != p.tensor().shape() || !t.is_contiguous() {
            return Err(Error::Shape(format!(
                "mirror of parameter {}: {} {:?} (strides {:?}) given, a contiguous {} {:?} expected",
                p.fqn(),
                t.dtype(),
                t.shape(),
                t.strides(),
                p.tensor().dtype(),
                p.tensor().shape()
            )));
        }
        self.check_stream_for(device, &format!("the mirror of parameter {}", p.fqn()))?;
        let context = format!("mirror of parameter {}", p.fqn());
        let a = crate::device::check::DeviceArg {
            arg: "mirror",
            context: &context,
            noun: "mirror",
            by_arg: false,
        };
        crate::device::check::check_tensor(&t, &a)?;
        // Kept only once written: a mirror that cannot be written leaves the old one.
        let old = self.entry_mut(i).mirror.replace(Mirror { tensor: t });
        self.refresh_mirror(i)
            .inspect_err(|_| self.entry_mut(i).mirror = old)
    }

    /// Writes parameter `i`'s bytes to its mirror, if it has one.
    pub(super) fn refresh_mirror(&self, i: usize) -> Result<()> {
        let p = self.entry(i);
        let Some(m) = &p.mirror else { return Ok(()) };
        // SAFETY: host params are contiguous and valid; the mirror was checked at
        // `set_mirror` and is the caller's to keep valid.
        unsafe {
            let bytes = p
                .tensor()
                .contiguous_bytes()
                .expect("params are contiguous");
            write_tensor(&m.tensor, bytes, self.stream())
        }
    }

    /// The host parameters whose gradients are given on a device (the offload case),
    /// with those devices, in parameter order.
    pub(in crate::optim) fn offloaded(&self, grads: &[Option<TensorView>]) -> Vec<(usize, Device)> {
        grads
            .iter()
            .enumerate()
            .filter_map(|(i, g)| Some((i, g.as_ref()?.device())))
            .filter(|&(i, d)| self.entry(i).device().is_host() && d.is_cuda())
            .collect()
    }

    fn downloads(
        &self,
        grads: &[Option<TensorView>],
        which: &[(usize, Device)],
    ) -> Vec<(Download, Device)> {
        which
            .iter()
            .filter_map(|&(i, dev)| {
                let g = grads[i].as_ref()?;
                let d = Download {
                    i,
                    src: g.as_ptr() as u64,
                    bytes: g.nbytes(),
                };
                Some((d, dev))
            })
            .collect()
    }

    /// Brings every offloaded gradient down now (before `check_numerics` reads them).
    ///
    /// # Safety
    /// As `step`.
    pub(in crate::optim) unsafe fn download_all(
        &self,
        grads: &[Option<TensorView>],
        which: &[(usize, Device)],
    ) -> Result<Vec<(usize, Vec<u8>)>> {
        let mut out = Vec::new();
        for (d, dev) in self.downloads(grads, which) {
            out.push((d.i, copy_down(d, dev, self.stream())?));
        }
        Ok(out)
    }

    /// The pipelined offload step (`offload_pipe`), one device at a time.
    ///
    /// # Safety
    /// As `step`; the parameters in `which` have state.
    pub(in crate::optim) unsafe fn step_offloaded(
        &mut self,
        grads: &[Option<TensorView>],
        which: &[(usize, Device)],
    ) -> Result<()> {
        let mut devices: Vec<Device> = which.iter().map(|&(_, d)| d).collect();
        devices.sort_unstable();
        devices.dedup();
        for d in devices {
            let on: Vec<usize> = which.iter().filter(|w| w.1 == d).map(|w| w.0).collect();
            self.step_pipelined(grads, d, &on)?;
        }
        Ok(())
    }
}

/// `bytes` of device memory at `src` (on `device`), brought down through the device's
/// pinned ring after the work queued on `stream` (the overlapped step's offload case).
///
/// # Safety
/// As `copy_down`: `src` is device memory of `device`, `bytes` long.
pub(crate) unsafe fn download(
    src: u64,
    bytes: usize,
    device: Device,
    stream: usize,
) -> Result<Vec<u8>> {
    copy_down(Download { i: 0, src, bytes }, device, stream)
}

/// One gradient's bytes, brought down through the device's pinned ring after the work
/// queued on `stream`.
unsafe fn copy_down(d: Download, device: Device, stream: usize) -> Result<Vec<u8>> {
    let mut out = crate::tensor::try_zeroed(d.bytes, "an offloaded gradient's host copy")?;
    if d.bytes > 0 {
        let b = backend(device)?;
        b.ring().download(&*b, d.src, &mut out, stream)?;
    }
    Ok(out)
}

#[cfg(test)]
#[path = "offload_step_tests.rs"]
mod tests;
