//! The device room: which memory a tensor lives in (`device` -1: host, >= 0: a CUDA
//! ordinal), the `Backend` trait one device implements, and its implementations.
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

pub use backend::{Backend, Memory};
pub use check::{check_tensor, DeviceArg};
pub use open::{backend, read_tensor, write_tensor};

#[cfg(feature = "cuda")]
use cuda as imp;
#[cfg(not(feature = "cuda"))]
use no_cuda as imp;

use crate::error::{Error, Result};

/// The host: `device` -1 in a tensor.
pub const HOST: i32 = -1;

/// Why an entry point that takes host memory only cannot use a tensor on CUDA device
/// `device`: the sentence an `Unsupported` error carries.
pub fn device_refusal(device: i32) -> String {
    format!(
        "device = {device}: {}; only host tensors (device -1) can be used here",
        imp::missing()
    )
}

/// Checks that tensors on device `ordinal` can be used (the libraries load, the device
/// exists, the kernels compile for it), compiling the kernels on first use.
pub fn open_device(ordinal: i32) -> Result<()> {
    open::backend(ordinal).map(|_| ()).map_err(|e| match e {
        Error::Unsupported(m) if !m.starts_with("device = ") => {
            Error::Unsupported(format!("device = {ordinal}: {m}"))
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
        let m = device_refusal(0);
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
