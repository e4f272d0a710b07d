//! The device room: which memory a tensor lives in (`Device`: the host or a CUDA
//! ordinal; defined on the tensor's floor, which carries it, and re-exported here), the
//! `Backend` trait one device implements, and its implementations.
//!
//! `cuda` (feature `cuda`: CUDA through cudarc, the kernels compiled by `nvrtc` with the
//! NVRTC `nvrtc_lib` finds where pip puts it; `dl`: the library search it shares with NCCL),
//! `no_cuda` (built without the feature: every device refused, saying so), `emulated`
//! (unit tests: host memory posing as two devices, adversarial about ordering and
//! lifetimes). Shared by all: `open` (which backend serves an ordinal; tensor bytes wherever they live), `check` (the one "contiguous, on an open device, its memory"
//! check), `context` (the one rule for CUDA contexts: push the device's primary context,
//! restore the caller's), `ring` (pinned staging with a constant bound), `lanes` (the
//! offload pipeline's two copy streams and their pinned slots). optim, clip,
//! broadcast, comm and ffi use devices only through here.
pub mod backend;
pub mod check;
pub mod context;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dl;
#[cfg(test)]
pub mod emulated;
pub mod lanes;
#[cfg(not(feature = "cuda"))]
mod no_cuda;
#[cfg(feature = "cuda")]
pub mod nvrtc;
#[cfg(feature = "cuda")]
pub mod nvrtc_lib;
pub mod open;
pub mod ring;

pub use crate::tensor::Device;
pub use backend::{Backend, Memory};
pub use check::{check_tensor, DeviceArg};
pub use open::{backend, read_tensor, write_tensor};

#[cfg(feature = "cuda")]
use cuda as imp;
#[cfg(not(feature = "cuda"))]
use no_cuda as imp;

use crate::error::{Error, Result};

/// The host: `device` -1 in a C tensor (`FO_DEVICE_HOST`).
pub const HOST: i32 = Device::HOST_CODE;

/// Why an entry point that takes host memory only cannot use a tensor on `device`: the
/// sentence an `Unsupported` error carries. It names the device by its C code
/// (`device = 0`), the number the caller wrote.
pub fn device_refusal(device: Device) -> String {
    refusal(device.to_c())
}

fn refusal(code: i32) -> String {
    format!(
        "device = {code}: {}; only host tensors (device -1) can be used here",
        imp::missing()
    )
}

/// The check of a C tensor's `device` code where only host memory is taken: any code but
/// -1 is `Unsupported` as "`what`.device = N: why" (an invalid code such as -2 too: the
/// refusal names the number the caller wrote).
pub fn refuse_unless_host(code: i32, what: &str) -> Result<()> {
    if code == HOST {
        return Ok(());
    }
    Err(Error::Unsupported(format!("{what}.{}", refusal(code))))
}

/// Checks that tensors on `device` can be used (the libraries load, the device exists,
/// the kernels compile for it), compiling the kernels on first use.
pub fn open_device(device: Device) -> Result<()> {
    open::backend(device).map(|_| ()).map_err(|e| match e {
        Error::Unsupported(m) if !m.starts_with("device = ") => {
            Error::Unsupported(format!("device = {}: {m}", device.to_c()))
        }
        e => e,
    })
}

/// Whether this build and machine can take a CUDA stream (`fo_optimizer_set_stream`).
pub fn stream_support() -> Result<()> {
    // Unit tests give streams to the emulated device.
    #[cfg(test)]
    if emulated::unavailable().is_none() {
        return Ok(());
    }
    imp::stream_support()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_names_what_is_missing() {
        let m = device_refusal(Device::Cuda(0));
        assert!(m.starts_with("device = 0: "), "{m}");
        #[cfg(not(feature = "cuda"))]
        assert!(m.contains("--features cuda"), "{m}");
        #[cfg(feature = "cuda")]
        assert!(
            m.contains("libcuda") || m.contains("NVRTC") || m.contains("fo_optimizer_step"),
            "{m}"
        );
    }
}
