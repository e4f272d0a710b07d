//! The GPU kernels: their source (`*.cuh`, one `__host__ __device__` text that NVRTC
//! builds for the GPU and the C++ compiler builds for the host), the list NVRTC is handed,
//! and the launch of a step table (`super::step_table`) on a device's stream.
//!
//! What is proven where: the arithmetic on the host (cpp_tests/test_gpu_kernels_host.cpp
//! and host_kernel_tests.rs, bit for bit against the CPU step; NVRTC compiles the same
//! text to PTX and CUBIN for sm_80/sm_90 in CI); device state, staging, the hybrid step,
//! streams and the clip on two adversarial `emulated` devices in the unit tests (host
//! memory, the host build of the kernel, a worker per stream with random delays, events
//! the only ordering, poisoned fresh and freed memory). The CUDA backend itself has not
//! been run on a GPU. Without the feature, or without
//! libcuda/NVRTC, device tensors are refused with `Unsupported`, naming what is missing.
use super::step_table::StepTable;
use crate::device::{backend, Backend};
use crate::error::Result;

/// The kernel headers, in include order, for a launcher that hands them to NVRTC.
pub const KERNEL_SOURCES: &[(&str, &str)] = &[
    ("fo_shim.cuh", include_str!("fo_shim.cuh")),
    ("fo_halfconv.cuh", include_str!("fo_halfconv.cuh")),
    ("fo_master.cuh", include_str!("fo_master.cuh")),
    ("fo_quant8.cuh", include_str!("fo_quant8.cuh")),
    ("fo_rules.cuh", include_str!("fo_rules.cuh")),
    ("fo_step.cuh", include_str!("fo_step.cuh")),
    ("fo_norm.cuh", include_str!("fo_norm.cuh")),
];

/// Launches each `(device, table)` on `stream` (0 = the legacy default stream), in order,
/// without waiting for the device.
///
/// # Safety
/// Every address in the tables must be memory of its device that stays valid until the
/// kernels have run; `stream` must be 0 or a valid stream of those devices.
pub unsafe fn launch_tables(tables: &[(i32, StepTable)], stream: usize) -> Result<()> {
    for (device, t) in tables {
        launch(&*backend(*device)?, t, stream)?;
    }
    Ok(())
}

/// Launches one param group's table on `b`'s `stream` without waiting for it: the table
/// goes to stream-ordered device memory through the device's pinned ring (a pageable
/// source could be gone before an asynchronous copy reads it), the kernel runs, and the
/// table's memory is freed after it, all in stream order.
///
/// # Safety
/// Every address in the table must be memory of `b`'s device that stays valid until the
/// kernel has run; `stream` valid or 0.
pub unsafe fn launch(b: &dyn Backend, table: &StepTable, stream: usize) -> Result<()> {
    if table.tensors.is_empty() {
        return Ok(());
    }
    let count = i32::try_from(table.tensors.len()).map_err(|_| {
        crate::error::Error::invalid("params", "more than 2^31 device tensors in one param group")
    })?;
    let bytes = table.as_bytes();
    let d = b.alloc_async(bytes.len(), stream)?;
    let out = b
        .ring()
        .upload(b, d, bytes, stream)
        .and_then(|()| b.launch_step(d, count, table.total_groups, stream));
    b.free_async(d, stream);
    out
}

#[cfg(test)]
#[path = "host_kernel_tests.rs"]
mod host_kernel_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_header_is_embedded() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/kernels/gpu");
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
