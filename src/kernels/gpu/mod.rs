//! The GPU kernels: their source (`*.cuh`, one `__host__ __device__` text that NVRTC
//! builds for the GPU and the C++ compiler builds for the host) and the list NVRTC is
//! handed. A step table (`super::step_table`) is launched from its resident device copy
//! (`optim::placement::device_table`).
//!
//! What is proven where: the arithmetic on the host (cpp_tests/test_gpu_kernels_host.cpp
//! and host_kernel_tests.rs, bit for bit against the CPU step; NVRTC compiles the same
//! text to PTX and CUBIN for sm_80/sm_90 in CI); device state, staging, the hybrid step,
//! streams and the clip on two adversarial `emulated` devices in the unit tests (host
//! memory, the host build of the kernel, a worker per stream with random delays, events
//! the only ordering, poisoned fresh and freed memory). The CUDA backend itself has not
//! been run on a GPU. Without the feature, or without
//! libcuda/NVRTC, device tensors are refused with `Unsupported`, naming what is missing.
/// The kernel headers, in include order, for a launcher that hands them to NVRTC.
pub const KERNEL_SOURCES: &[(&str, &str)] = &[
    ("fo_shim.cuh", include_str!("fo_shim.cuh")),
    ("fo_halfconv.cuh", include_str!("fo_halfconv.cuh")),
    ("fo_master.cuh", include_str!("fo_master.cuh")),
    ("fo_quant8.cuh", include_str!("fo_quant8.cuh")),
    ("fo_fast.cuh", include_str!("fo_fast.cuh")),
    ("fo_rules.cuh", include_str!("fo_rules.cuh")),
    ("fo_vec.cuh", include_str!("fo_vec.cuh")),
    ("fo_step.cuh", include_str!("fo_step.cuh")),
    ("fo_norm.cuh", include_str!("fo_norm.cuh")),
];

/// Threads per block of every launch (whole warps): `FO_BLOCK_THREADS` in fo_step.cuh,
/// where an entry compiled with launch bounds refuses larger blocks.
pub const BLOCK_THREADS: u32 = 128;

/// Threads `fo_step_kernel` wants per 32-element group: `FO_GROUP_LANES` in fo_step.cuh,
/// each lane on 4 consecutive elements (one access per array: a warp's is contiguous).
pub const STEP_LANES_PER_GROUP: u64 = 8;

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

    #[test]
    fn the_launch_sizes_the_step_kernel_as_its_source_says() {
        let src = |n: &str| KERNEL_SOURCES.iter().find(|(f, _)| *f == n).unwrap().1;
        assert!(src("fo_vec.cuh").contains("#define FO_VEC 4\n"));
        assert!(src("fo_quant8.cuh").contains("#define FO_GROUP 32\n"));
        assert!(src("fo_step.cuh").contains("#define FO_GROUP_LANES (FO_GROUP / FO_VEC)\n"));
        assert_eq!(STEP_LANES_PER_GROUP, 32 / 4);
        assert!(src("fo_step.cuh").contains(&format!("#define FO_BLOCK_THREADS {BLOCK_THREADS}\n")));
        assert_eq!(BLOCK_THREADS % 32, 0, "blocks of whole warps");
    }
}
