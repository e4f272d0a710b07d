//! The optimizer's GPU half: the kernel source (`kernels/*.cuh`, one `__host__ __device__`
//! text that NVRTC builds for the GPU and the C++ compiler builds for the host), the
//! launch table (`table`, built and tested on the host), parameter state in device memory
//! (`DeviceState`) over a device `backend`, and with feature `cuda` that backend on CUDA
//! (`launch`: NVRTC once per device, one launch per param group and step on the
//! optimizer's stream).
//!
//! What is proven where: the arithmetic on the host (cpp_tests/test_gpu_kernels_host.cpp
//! and host_kernel_tests.rs, bit for bit against the CPU step; NVRTC compiles the same
//! text to PTX and CUBIN for sm_80/sm_90 in CI); device state, staging, the hybrid step,
//! streams and the clip on two adversarial `emulated` devices in the unit tests (host
//! memory, the host build of the kernel, a worker per stream with random delays, events
//! the only ordering, poisoned fresh and freed memory). The CUDA backend itself has not
//! been run on a GPU. Without the feature, or without
//! libcuda/NVRTC, device tensors are refused with `Unsupported`, naming what is missing.
pub mod backend;
pub mod check;
#[cfg(feature = "cuda")]
pub mod context;
mod device_state;
#[cfg(test)]
pub mod emulated;
pub mod norm_table;
pub mod ring;
pub mod table;

#[cfg(feature = "cuda")]
pub mod launch;

pub use device_state::DeviceState;

use crate::error::{Error, Result};
use table::StepTable;

/// The kernel headers, in include order, for a launcher that hands them to NVRTC.
pub const KERNEL_SOURCES: &[(&str, &str)] = &[
    ("fo_shim.cuh", include_str!("kernels/fo_shim.cuh")),
    ("fo_halfconv.cuh", include_str!("kernels/fo_halfconv.cuh")),
    ("fo_master.cuh", include_str!("kernels/fo_master.cuh")),
    ("fo_quant8.cuh", include_str!("kernels/fo_quant8.cuh")),
    ("fo_rules.cuh", include_str!("kernels/fo_rules.cuh")),
    ("fo_step.cuh", include_str!("kernels/fo_step.cuh")),
    ("fo_norm.cuh", include_str!("kernels/fo_norm.cuh")),
];

/// Why an entry point that takes host memory only cannot use a tensor on CUDA device
/// `device`: the sentence an `Unsupported` error carries.
pub fn device_refusal(device: i32) -> String {
    format!(
        "device = {device}: {}; only host tensors (device -1) can be used here",
        missing()
    )
}

#[cfg(not(feature = "cuda"))]
fn missing() -> String {
    "this libfo was built without GPU support (rebuild with `--features cuda`)".into()
}

#[cfg(feature = "cuda")]
fn missing() -> String {
    match launch::missing_library() {
        Some(m) => m.into(),
        None => "device tensors are taken by fo_optimizer_add_param, fo_optimizer_step, \
                 fo_optimizer_set_mirror, fo_clip_grad_norm and fo_broadcast_state_dict, not here"
            .into(),
    }
}

/// Checks that tensors on device `ordinal` can be stepped (the libraries load, the
/// device exists, the kernels compile for it), compiling the kernels on first use.
pub fn open_device(ordinal: i32) -> Result<()> {
    backend::backend(ordinal).map(|_| ()).map_err(|e| match e {
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
    #[cfg(feature = "cuda")]
    return match launch::missing_library() {
        Some(m) => Err(Error::Unsupported(format!("fo_optimizer_set_stream: {m}"))),
        None => Ok(()),
    };
    #[cfg(not(feature = "cuda"))]
    Err(Error::Unsupported(
        "fo_optimizer_set_stream: this libfo was built without GPU support (rebuild with `--features cuda`)"
            .into(),
    ))
}

/// Launches each `(device, table)` on `stream` (0 = the legacy default stream), in order,
/// without waiting for the device.
///
/// # Safety
/// Every address in the tables must be memory of its device that stays valid until the
/// kernels have run; `stream` must be 0 or a valid stream of those devices.
pub unsafe fn launch_tables(tables: &[(i32, StepTable)], stream: usize) -> Result<()> {
    for (device, t) in tables {
        backend::launch(&*backend::backend(*device)?, t, stream)?;
    }
    Ok(())
}

#[cfg(test)]
#[path = "host_kernel_tests.rs"]
mod host_kernel_tests;

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

    #[test]
    fn every_kernel_header_is_embedded() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/optim/gpu/kernels");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".cuh"))
            .collect();
        on_disk.sort();
        let mut embedded: Vec<String> = KERNEL_SOURCES.iter().map(|(n, _)| n.to_string()).collect();
        embedded.sort();
        assert_eq!(on_disk, embedded);
    }
}
