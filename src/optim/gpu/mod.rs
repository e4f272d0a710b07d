//! The optimizer's GPU half, as far as it goes today: the kernel source (`kernels/*.cuh`,
//! one `__host__ __device__` text that NVRTC builds for the GPU and the C++ compiler builds
//! for the host) and why a device tensor cannot be stepped by this build. The arithmetic
//! is proven on the host only (`cpp_tests/test_gpu_kernels_host.cpp`: bit for bit against
//! the CPU step; `scripts/nvrtc_check.py`: NVRTC compiles it for sm_80/sm_90). The launch
//! path (module cache per device, tensor table upload, stream) is not written yet, so
//! device tensors are refused with `Unsupported`, naming what is missing.
//!
//! `table`: the launch's tensor table (Rust mirror of `fo_step_tensor` / `fo_rule`),
//! built and tested on the host.
pub mod table;

/// The kernel headers, in include order, for a launcher that hands them to NVRTC.
pub const KERNEL_SOURCES: &[(&str, &str)] = &[
    ("fo_shim.cuh", include_str!("kernels/fo_shim.cuh")),
    ("fo_halfconv.cuh", include_str!("kernels/fo_halfconv.cuh")),
    ("fo_master.cuh", include_str!("kernels/fo_master.cuh")),
    ("fo_quant8.cuh", include_str!("kernels/fo_quant8.cuh")),
    ("fo_rules.cuh", include_str!("kernels/fo_rules.cuh")),
    ("fo_step.cuh", include_str!("kernels/fo_step.cuh")),
];

/// Why this build cannot use a tensor on CUDA device `device`: the sentence an
/// `Unsupported` error carries.
pub fn device_refusal(device: i32) -> String {
    format!(
        "device = {device}: {}; only host tensors (device -1) can be used",
        missing()
    )
}

#[cfg(not(feature = "cuda"))]
fn missing() -> String {
    "this libfo was built without GPU support (rebuild with `--features cuda`)".into()
}

#[cfg(feature = "cuda")]
fn missing() -> String {
    // cudarc panics when a library is absent: check presence before anything else.
    // SAFETY: only tries to load libcuda; no CUDA call is made.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return "the CUDA driver library (libcuda.so) could not be loaded".into();
    }
    "GPU optimizer steps are not available in this build yet (the kernels are proven on the host \
     only; the launch path is not written)"
        .into()
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
        assert!(m.contains("libcuda") || m.contains("launch path"), "{m}");
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
