//! The optimizer's kernels built for the host (g++ `-ffp-contract=off`, through the shim
//! header) and loaded into the test process, plus the test inputs emulated-device tests use.
use std::ffi::CString;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use crate::kernels::norm_table::FoNormTensor;
use crate::kernels::step_table::{FoRule, FoStepTensor};

/// The host build of the step kernel's entry for `path` (`fo_step_kernel` for 0,
/// `fo_step_kernel_p<path>` else) over a table's rows, on a small grid: (rows, count,
/// groups, rule, first, path).
pub type RunTable = unsafe extern "C" fn(*const FoStepTensor, i32, u64, *const FoRule, i32, u32);
/// The host build of `fo_step_path_of` (the path a row takes under a rule).
pub type PathOf = unsafe extern "C" fn(*const FoStepTensor, *const FoRule) -> i32;
/// The host build of the two norm kernels: (table, rows, chunks, power, out).
pub type RunNorm = unsafe extern "C" fn(*const FoNormTensor, i32, u64, i32, *mut f64);
/// The host build of `fo_scale_kernel`: (table, rows, chunks, coef, coef64).
pub type RunScale = unsafe extern "C" fn(*const FoNormTensor, i32, u64, f32, f64);
/// The calling thread's 16-byte vector loads and stores so far in the host build
/// (fo_shim.cuh counts them; a misaligned one aborts, as it faults on a GPU).
pub type VecCounts = unsafe extern "C" fn(*mut u64, *mut u64);

/// The host build of fo_fast.cuh's scalar coding, over `n` inputs: (op, x, n, a, b, k, out).
/// op 0: `fo_fast_quant_code(a, x, k)`; op 1: `fo_fast_error_code(a, bits, b, x)` with the
/// bits `x` rounds to (out: bits << 16 | the code's low 16 bits); op 2:
/// `fo_fast_round_away(x)`.
pub type FastCodes = unsafe extern "C" fn(i32, *const f32, i32, i32, i32, f32, *mut i32);

/// The kernels' host build, loaded from one shared object.
#[derive(Clone, Copy)]
pub struct HostKernels {
    pub step: RunTable,
    pub norm: RunNorm,
    pub scale: RunScale,
    pub vec_counts: VecCounts,
    pub path_of: PathOf,
    pub fast_codes: FastCodes,
}

/// Builds the host kernels into a shared object and loads them (once per process).
pub fn host_kernels() -> std::result::Result<HostKernels, String> {
    static K: OnceLock<std::result::Result<[usize; 6], String>> = OnceLock::new();
    let f = K.get_or_init(build).clone()?;
    // SAFETY: the addresses of the functions `build` defines, with these signatures.
    Ok(unsafe {
        HostKernels {
            step: std::mem::transmute::<usize, RunTable>(f[0]),
            norm: std::mem::transmute::<usize, RunNorm>(f[1]),
            scale: std::mem::transmute::<usize, RunScale>(f[2]),
            vec_counts: std::mem::transmute::<usize, VecCounts>(f[3]),
            path_of: std::mem::transmute::<usize, PathOf>(f[4]),
            fast_codes: std::mem::transmute::<usize, FastCodes>(f[5]),
        }
    })
}

/// The host build of `fo_step_kernel` (see `host_kernels`).
pub fn host_kernel() -> std::result::Result<RunTable, String> {
    host_kernels().map(|k| k.step)
}

/// A small grid, so the grid-stride loops and the table searches all get exercised (the
/// step kernel's blocks are whole warps: 2 per block, 6 in all).
const HOST_RUNNERS: &str = r#"#include "fo_step.cuh"
#include "fo_norm.cuh"
#include <vector>
extern "C" void fo_test_run(const fo_step_tensor* t, int n, unsigned long long g, const fo_rule* r,
                            int first, unsigned path) {
  decltype(&fo_step_kernel) entries[] = {fo_step_kernel,    fo_step_kernel_p1, fo_step_kernel_p2,
                                         fo_step_kernel_p3, fo_step_kernel_p4, fo_step_kernel_p5,
                                         fo_step_kernel_p6, fo_step_kernel_p7, fo_step_kernel_p8};
  if (path >= sizeof entries / sizeof entries[0]) abort();
  fo_host_launch(3, 64, [&] { entries[path](t, n, g, *r, first); });
}
extern "C" void fo_test_fast_codes(int op, const float* x, int n, int a, int b, float k, int32_t* out) {
  for (int i = 0; i < n; ++i) {
    if (op == 0) out[i] = (int32_t)fo_fast_quant_code(a, x[i], k);
    if (op == 1) {
      uint16_t bits = fo_f32_to_half(a, x[i]);
      out[i] = (int32_t)((uint32_t)bits << 16 | ((uint32_t)fo_fast_error_code(a, bits, b, x[i]) & 0xffffu));
    }
    if (op == 2) out[i] = fo_fast_round_away(x[i]);
  }
}
extern "C" int fo_test_path_of(const fo_step_tensor* t, const fo_rule* r) { return fo_step_path_of(*t, *r); }
extern "C" void fo_test_norm(const fo_norm_tensor* t, int n, unsigned long long chunks, int power,
                             double* out) {
  std::vector<double> s(chunks * FO_NORM_LANES), m(chunks * FO_NORM_LANES);
  fo_host_launch(3, 4, [&] { fo_norm_lanes_kernel(t, n, chunks, power, s.data(), m.data()); });
  fo_host_launch(2, 3, [&] { fo_norm_chunks_kernel(s.data(), m.data(), chunks, out); });
}
extern "C" void fo_test_scale(const fo_norm_tensor* t, int n, unsigned long long chunks, float c,
                              double c64) {
  fo_host_launch(3, 4, [&] { fo_scale_kernel(t, n, chunks, c, c64); });
}
extern "C" void fo_test_vec_counts(unsigned long long* loads, unsigned long long* stores) {
  *loads = fo_vec_loads;
  *stores = fo_vec_stores;
}
"#;

fn build() -> std::result::Result<[usize; 6], String> {
    let dir = std::env::temp_dir().join(format!("fo-host-kernel-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let src = dir.join("run.cpp");
    std::fs::write(&src, HOST_RUNNERS).map_err(|e| e.to_string())?;
    let so = dir.join("run.so");
    let kernels = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/kernels/gpu");
    let out = Command::new("g++")
        .args([
            "-std=c++17",
            "-O1",
            "-ffp-contract=off",
            "-shared",
            "-fPIC",
            "-I",
        ])
        .arg(&kernels)
        .arg(&src)
        .arg("-o")
        .arg(&so)
        .output()
        .map_err(|e| format!("g++ not runnable: {e}"))?;
    if !out.status.success() {
        panic!("g++ failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let path = CString::new(so.to_str().unwrap()).unwrap();
    // SAFETY: a library built just above, defining the six C functions looked up.
    unsafe {
        let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOW);
        assert!(!h.is_null(), "dlopen {so:?}");
        let sym = |name: &std::ffi::CStr| {
            let f = libc::dlsym(h, name.as_ptr());
            assert!(!f.is_null(), "dlsym {name:?}");
            f as usize
        };
        Ok([
            sym(c"fo_test_run"),
            sym(c"fo_test_norm"),
            sym(c"fo_test_scale"),
            sym(c"fo_test_vec_counts"),
            sym(c"fo_test_path_of"),
            sym(c"fo_test_fast_codes"),
        ])
    }
}

/// Test inputs: values over many magnitudes with exact zeros, deterministic in `seed`.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            match i % 7 {
                0 => 0.0,
                1 => u * 1e-5,
                2 => u * 300.0,
                _ => u,
            }
        })
        .collect()
}

/// `v` as little-endian `dt` elements (rounded to nearest even), as tests store them.
pub fn encode(dt: crate::dtype::DType, v: &[f32]) -> Vec<u8> {
    let f32s = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    crate::cast::cast(f32s, crate::dtype::DType::F32, dt, "test values").unwrap()
}
