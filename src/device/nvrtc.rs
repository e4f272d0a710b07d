//! NVRTC (feature `cuda`): compiles the optimizer's kernel text (`KERNEL_SOURCES`) to a
//! CUBIN for a device's `sm_XY` (PTX for its `compute_XY` as the fallback), once per arch.
//!
//! Compiling (NVRTC + ptxas, about 2.2 s) holds only that architecture's slot: a second
//! device of the same architecture waits for the first's CUBIN and reuses it, a device
//! of another architecture compiles at the same time. Compiling needs no GPU and no
//! libcuda, so CI runs these tests where the NVRTC wheel is installed.
use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{result as nvr, sys as nvsys};

use crate::error::{Error, Result};
use crate::kernels::gpu::KERNEL_SOURCES;

/// The step kernel's entry point (`extern "C"` in fo_step.cuh).
pub const ENTRY: &str = "fo_step_kernel";
/// The clip's kernels (fo_norm.cuh): lane partials, chunk folds, scaling.
pub const NORM_ENTRIES: [&str; 3] = [
    "fo_norm_lanes_kernel",
    "fo_norm_chunks_kernel",
    "fo_scale_kernel",
];
/// NVRTC options besides `--gpu-architecture`: the same as scripts/nvrtc_check.py, which
/// compiles the kernels in CI. `--fmad=false`: only the multiply-adds written as `fo_fma`
/// fuse, as on the CPU path.
pub const NVRTC_OPTIONS: [&str; 3] = ["--fmad=false", "-std=c++17", "--restrict"];

/// Why NVRTC cannot be used (compiling needs no GPU and no libcuda), or None.
pub fn missing_nvrtc() -> Option<&'static str> {
    // SAFETY: only tries to load the library; no NVRTC call is made.
    if !unsafe { nvsys::is_culib_present() } {
        return Some("the NVRTC library (libnvrtc.so) could not be loaded; add its directory to LD_LIBRARY_PATH");
    }
    None
}
/// The `--gpu-architecture` option for compute capability `major.minor` (PTX for the
/// device's own virtual architecture; the driver finishes it for the exact chip).
pub fn arch_option(major: i32, minor: i32) -> String {
    format!("--gpu-architecture=compute_{major}{minor}")
}

/// The `--gpu-architecture` option for a CUBIN (machine code) of compute capability
/// `major.minor`. Unlike PTX, a CUBIN from NVRTC 12.x loads on any 12.x driver (CUDA's
/// minor version compatibility): PTX `.version 8.7` from NVRTC 12.8 needs R570 or newer.
pub fn cubin_arch_option(major: i32, minor: i32) -> String {
    format!("--gpu-architecture=sm_{major}{minor}")
}

/// Compiles the kernels to a CUBIN for `arch` (a `cubin_arch_option`).
pub fn compile_cubin(arch: &str) -> Result<Vec<u8>> {
    compile(arch, |prog| {
        let mut size = 0usize;
        // SAFETY: a compiled program; the buffer holds `size` bytes.
        unsafe {
            nvsys::nvrtcGetCUBINSize(prog, &mut size).result()?;
            let mut out = vec![0u8; size];
            nvsys::nvrtcGetCUBIN(prog, out.as_mut_ptr() as *mut c_char).result()?;
            Ok(out)
        }
    })
}

/// NVRTC's version as "major.minor".
pub fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints (the library is present: checked by the callers).
    match unsafe { nvsys::nvrtcVersion(&mut major, &mut minor) }.result() {
        Ok(()) => format!("{major}.{minor}"),
        Err(e) => format!("unknown ({e:?})"),
    }
}

/// Compiles the kernels to PTX with `arch` (an `arch_option`). The headers are handed to
/// NVRTC in memory, so no file or include path is needed at run time. Errors carry
/// NVRTC's log.
pub fn compile_ptx(arch: &str) -> Result<Vec<c_char>> {
    compile(arch, |prog| {
        // SAFETY: a compiled program.
        unsafe { nvr::get_ptx(prog) }.map(|v| v.into_iter().map(|b| b as u8).collect::<Vec<u8>>())
    })
    .map(|v| v.into_iter().map(|b| b as c_char).collect())
}

/// Compiles the kernels with `arch` and takes the output with `get`.
fn compile<T: Into<Vec<u8>>>(
    arch: &str,
    get: impl FnOnce(nvsys::nvrtcProgram) -> std::result::Result<T, nvr::NvrtcError>,
) -> Result<Vec<u8>> {
    if let Some(m) = missing_nvrtc() {
        return Err(Error::Unsupported(m.into()));
    }
    let cstr = |s: &str| CString::new(s).expect("kernel sources hold no NUL");
    let names: Vec<CString> = KERNEL_SOURCES.iter().map(|(n, _)| cstr(n)).collect();
    let texts: Vec<CString> = KERNEL_SOURCES.iter().map(|(_, t)| cstr(t)).collect();
    let name_ptrs: Vec<*const c_char> = names.iter().map(|c| c.as_ptr()).collect();
    let text_ptrs: Vec<*const c_char> = texts.iter().map(|c| c.as_ptr()).collect();
    let main = cstr("#include \"fo_step.cuh\"\n#include \"fo_norm.cuh\"\n");
    let mut opts: Vec<String> = vec![arch.to_string()];
    opts.extend(NVRTC_OPTIONS.iter().map(|s| s.to_string()));
    let nv = |what: &str, e: nvr::NvrtcError| Error::Unsupported(format!("NVRTC {what}: {e:?}"));
    // SAFETY: every pointer outlives the program, which is destroyed before returning.
    unsafe {
        let mut prog: nvsys::nvrtcProgram = std::ptr::null_mut();
        nvsys::nvrtcCreateProgram(
            &mut prog,
            main.as_ptr(),
            c"fo_kernels.cu".as_ptr(),
            names.len() as i32,
            text_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
        .result()
        .map_err(|e| nv("nvrtcCreateProgram", e))?;
        let compiled = nvr::compile_program(prog, &opts);
        let out = match compiled {
            Ok(()) => get(prog)
                .map(Into::into)
                .map_err(|e| nv("nvrtcGetPTX/nvrtcGetCUBIN", e)),
            Err(e) => {
                let log = nvr::get_program_log(prog)
                    .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
                    .unwrap_or_default();
                Err(Error::Unsupported(format!(
                    "NVRTC could not compile fo's kernels ({} {}): {e:?}\n{log}",
                    arch,
                    NVRTC_OPTIONS.join(" ")
                )))
            }
        };
        let _ = nvr::destroy_program(prog);
        out
    }
}

/// The CUBIN for compute capability `major.minor`, compiled once per architecture (see
/// the module doc). Failures are not cached: a later call compiles again.
pub fn cubin_for(major: i32, minor: i32) -> Result<Arc<Vec<u8>>> {
    type Slot = Arc<Mutex<Option<Arc<Vec<u8>>>>>;
    static SLOTS: OnceLock<Mutex<HashMap<(i32, i32), Slot>>> = OnceLock::new();
    let slot = SLOTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry((major, minor))
        .or_default()
        .clone();
    // The map's lock is released: only callers for this architecture wait here.
    let mut s = slot.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = &*s {
        return Ok(c.clone());
    }
    let c = Arc::new(compile_cubin(&cubin_arch_option(major, minor))?);
    *s = Some(c.clone());
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvrtc_options_are_the_ones_ci_compiles_with() {
        let script = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/nvrtc_check.py"
        ))
        .unwrap();
        for o in NVRTC_OPTIONS {
            assert!(
                script.contains(&format!("\"{o}\"")),
                "{o} not in nvrtc_check.py"
            );
        }
        assert!(script.contains(&format!("ENTRY = \"{ENTRY}\"")));
        for e in NORM_ENTRIES {
            assert!(
                script.contains(&format!("\"{e}\"")),
                "{e} not in nvrtc_check.py"
            );
        }
        assert_eq!(arch_option(9, 0), "--gpu-architecture=compute_90");
        assert_eq!(arch_option(8, 6), "--gpu-architecture=compute_86");
        assert_eq!(cubin_arch_option(9, 0), "--gpu-architecture=sm_90");
    }

    /// Runs where NVRTC loads (no GPU needed): scripts/test.sh puts the pinned NVRTC wheel
    /// on LD_LIBRARY_PATH for it.
    #[test]
    fn nvrtc_compiles_the_embedded_kernels_to_ptx_and_cubin_for_sm80_and_sm90() {
        if let Some(why) = missing_nvrtc() {
            eprintln!("skipped: {why}");
            return;
        }
        let written = include_str!("../kernels/gpu/fo_rules.cuh")
            .matches("fo_fma(")
            .count();
        for (major, minor) in [(8, 0), (9, 0)] {
            let ptx = compile_ptx(&arch_option(major, minor)).unwrap();
            let bytes: Vec<u8> = ptx.iter().map(|&c| c as u8).collect();
            let text = CStr::from_bytes_until_nul(&bytes)
                .unwrap()
                .to_str()
                .unwrap();
            for entry in std::iter::once(ENTRY).chain(NORM_ENTRIES) {
                assert!(
                    text.contains(&format!(".entry {entry}")),
                    "sm_{major}{minor}: {entry}"
                );
            }
            // --fmad=false holds for f64 too: the norm's sums are not contracted.
            assert!(!text.contains("fma.rn.f64"), "sm_{major}{minor}");
            assert!(
                text.contains(&format!(".target sm_{major}{minor}")),
                "sm_{major}{minor}"
            );
            // --fmad=false took effect: the only fused multiply-adds are the written ones.
            assert_eq!(
                text.matches("fma.rn.f32").count(),
                written,
                "sm_{major}{minor}"
            );
        }
        // The CUBIN the device loads first (PTX is the fallback): an ELF for each.
        for (major, minor) in [(8, 0), (9, 0)] {
            let cubin = compile_cubin(&cubin_arch_option(major, minor)).unwrap();
            assert!(cubin.starts_with(b"\x7fELF"), "sm_{major}{minor}");
            for entry in std::iter::once(ENTRY).chain(NORM_ENTRIES) {
                assert!(
                    cubin.windows(entry.len()).any(|w| w == entry.as_bytes()),
                    "sm_{major}{minor} CUBIN: {entry}"
                );
            }
        }
        assert!(nvrtc_version().starts_with("12."), "{}", nvrtc_version());
        let e = compile_ptx("--gpu-architecture=compute_10")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("NVRTC could not compile fo's kernels (--gpu-architecture=compute_10"),
            "{e}"
        );
    }
    #[test]
    fn the_cubin_is_compiled_once_per_architecture() {
        if let Some(why) = missing_nvrtc() {
            eprintln!("skipped: {why}");
            return;
        }
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(|| cubin_for(8, 0).unwrap());
            let b = s.spawn(|| cubin_for(8, 0).unwrap());
            (a.join().unwrap(), b.join().unwrap())
        });
        assert!(
            Arc::ptr_eq(&a, &b),
            "one compile for two callers of one arch"
        );
        assert!(!Arc::ptr_eq(&a, &cubin_for(9, 0).unwrap()));
    }
}
