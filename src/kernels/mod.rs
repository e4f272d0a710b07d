//! The element-wise kernels, side by side by target: the host's (`host`: chunked, parallel,
//! SIMD), the GPU's (`gpu`: `.cuh` source and its launch) and the tables both read.
//!
//! One arithmetic, three builds: the optimizer's rules live in `optim::math`; the host
//! kernels call them in Rust, the `.cuh` text restates them for NVRTC and for the host C++
//! compiler (cpp_tests prove it bit for bit), and the tables (`step_table` for the step,
//! `norm_table` for the clip's norm) are the `#[repr(C)]` records a launch uploads.
pub mod gpu;
pub mod host;
pub mod norm_table;
pub mod step_path;
pub mod step_table;
