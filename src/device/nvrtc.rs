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

use super::nvrtc_lib::{self, NvrtcLib, NvrtcProgram};
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

/// Why NVRTC cannot be used (compiling needs no GPU and no libcuda), or None. The
/// message names every place the library was looked for (`nvrtc_lib`).
pub fn missing_nvrtc() -> Option<String> {
    nvrtc_lib::lib().err().map(|e| match e {
        Error::Unsupported(m) => m,
        e => e.to_string(),
    })
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
    compile_cubin_with(nvrtc_lib::lib()?, arch)
}

/// `compile_cubin` with the NVRTC `nv`.
pub fn compile_cubin_with(nv: &NvrtcLib, arch: &str) -> Result<Vec<u8>> {
    compile(nv, arch, |prog| {
        let mut size = 0usize;
        // SAFETY: a compiled program; the buffer holds `size` bytes.
        unsafe {
            nv.check("nvrtcGetCUBINSize", (nv.get_cubin_size)(prog, &mut size))?;
            let mut out = vec![0u8; size];
            nv.check(
                "nvrtcGetCUBIN",
                (nv.get_cubin)(prog, out.as_mut_ptr() as *mut c_char),
            )?;
            Ok(out)
        }
    })
}

/// NVRTC's version as "major.minor" and the file it was loaded from.
pub fn nvrtc_version() -> String {
    match nvrtc_lib::lib() {
        Ok(l) => format!("{}.{} ({})", l.version.0, l.version.1, l.path),
        Err(_) => "unknown (not loaded)".into(),
    }
}

/// Compiles the kernels to PTX with `arch` (an `arch_option`). The headers are handed to
/// NVRTC in memory, so no file or include path is needed at run time. Errors carry
/// NVRTC's log. The PTX ends with its NUL, as `cuModuleLoadData` reads it.
pub fn compile_ptx(arch: &str) -> Result<Vec<c_char>> {
    compile_ptx_with(nvrtc_lib::lib()?, arch)
}

/// `compile_ptx` with the NVRTC `nv`.
pub fn compile_ptx_with(nv: &NvrtcLib, arch: &str) -> Result<Vec<c_char>> {
    let ptx = compile(nv, arch, |prog| {
        let mut size = 0usize;
        // SAFETY: a compiled program; the buffer holds `size` bytes (NUL included).
        unsafe {
            nv.check("nvrtcGetPTXSize", (nv.get_ptx_size)(prog, &mut size))?;
            let mut out = vec![0u8; size];
            nv.check(
                "nvrtcGetPTX",
                (nv.get_ptx)(prog, out.as_mut_ptr() as *mut c_char),
            )?;
            Ok(out)
        }
    })?;
    Ok(ptx.into_iter().map(|b| b as c_char).collect())
}

/// Compiles the kernels with `arch` and takes the output with `get`.
fn compile(
    nv: &NvrtcLib,
    arch: &str,
    get: impl FnOnce(NvrtcProgram) -> Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    let cstr = |s: &str| CString::new(s).expect("kernel sources hold no NUL");
    let names: Vec<CString> = KERNEL_SOURCES.iter().map(|(n, _)| cstr(n)).collect();
    let texts: Vec<CString> = KERNEL_SOURCES.iter().map(|(_, t)| cstr(t)).collect();
    let name_ptrs: Vec<*const c_char> = names.iter().map(|c| c.as_ptr()).collect();
    let text_ptrs: Vec<*const c_char> = texts.iter().map(|c| c.as_ptr()).collect();
    let main = cstr("#include \"fo_step.cuh\"\n#include \"fo_norm.cuh\"\n");
    let opts: Vec<CString> = std::iter::once(arch)
        .chain(NVRTC_OPTIONS)
        .map(cstr)
        .collect();
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
    // SAFETY: every pointer outlives the program, which is destroyed before returning.
    unsafe {
        let mut prog: NvrtcProgram = std::ptr::null_mut();
        nv.check(
            "nvrtcCreateProgram",
            (nv.create_program)(
                &mut prog,
                main.as_ptr(),
                c"fo_kernels.cu".as_ptr(),
                names.len() as i32,
                text_ptrs.as_ptr(),
                name_ptrs.as_ptr(),
            ),
        )?;
        let compiled = nv.check(
            "nvrtcCompileProgram",
            (nv.compile_program)(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr()),
        );
        let out = match compiled {
            Ok(()) => get(prog),
            Err(e) => Err(Error::Unsupported(format!(
                "NVRTC could not compile fo's kernels ({} {}): {e}\n{}",
                arch,
                NVRTC_OPTIONS.join(" "),
                program_log(nv, prog)
            ))),
        };
        let _ = (nv.destroy_program)(&mut prog);
        out
    }
}

/// NVRTC's log for `prog` (empty when it cannot be read).
unsafe fn program_log(nv: &NvrtcLib, prog: NvrtcProgram) -> String {
    let mut size = 0usize;
    if (nv.get_program_log_size)(prog, &mut size) != 0 || size == 0 {
        return String::new();
    }
    let mut log = vec![0u8; size];
    if (nv.get_program_log)(prog, log.as_mut_ptr() as *mut c_char) != 0 {
        return String::new();
    }
    CStr::from_bytes_until_nul(&log)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default()
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
        assert_eq!(crate::kernels::step_path::entry_name(0), ENTRY);
        let paths = crate::kernels::step_path::STEP_PATHS;
        assert!(
            script.contains(&format!("STEP_PATHS = {paths}")),
            "STEP_PATHS in nvrtc_check.py"
        );
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

    /// The NVRTCs this test process has: the one fo's search finds (scripts/test.sh puts
    /// the NVRTC 12 wheel on LD_LIBRARY_PATH for it) and each wheel that
    /// `FO_TEST_NVRTC{12,13}_LIBRARY` names. Prints why one is absent.
    fn nvrtcs() -> Vec<&'static NvrtcLib> {
        let mut out: Vec<&'static NvrtcLib> = Vec::new();
        match nvrtc_lib::lib() {
            Ok(l) => out.push(l),
            Err(e) => eprintln!("fo's search found no NVRTC: {e}"),
        }
        for major in [12, 13] {
            let Some(wheel) = nvrtc_lib::tests::test_wheel(major) else {
                continue;
            };
            let search = nvrtc_lib::Search {
                explicit: Some(&wheel),
                loaded: &[],
                venv: None,
                names: &[],
            };
            let l = nvrtc_lib::load(&search).unwrap();
            // The same file as the search's (LD_LIBRARY_PATH on the wheel) is checked once.
            let same = |a: &str, b: &str| {
                std::fs::canonicalize(a)
                    .ok()
                    .is_some_and(|a| std::fs::canonicalize(b).ok() == Some(a))
            };
            if !out.iter().any(|o| same(&o.path, &l.path)) {
                out.push(Box::leak(Box::new(l)));
            }
        }
        out
    }

    /// Runs where NVRTC loads (no GPU needed): each NVRTC 12 and 13 compiles the kernels to
    /// PTX, and to CUBIN for the architectures it lists.
    #[test]
    fn nvrtc_compiles_the_embedded_kernels_to_ptx_and_cubin_for_sm80_and_sm90() {
        let all = nvrtcs();
        if all.is_empty() {
            eprintln!("skipped: no NVRTC loads here");
            return;
        }
        for nv in all {
            compiles_the_kernels(nv);
        }
    }

    /// Every kernel entry the device loads: the step kernel's, one per path, and the norm's.
    fn all_entries() -> Vec<String> {
        let steps =
            (0..crate::kernels::step_path::STEP_PATHS).map(crate::kernels::step_path::entry_name);
        steps.chain(NORM_ENTRIES.map(String::from)).collect()
    }

    /// The fma.rn.f32 of `ptx` inside inline-asm blocks (written as fo_fma) and outside.
    fn fma_counts(ptx: &str) -> (usize, usize) {
        let (mut inside, mut written, mut stray) = (false, 0, 0);
        for line in ptx.lines().map(str::trim) {
            match line {
                "// begin inline asm" => inside = true,
                "// end inline asm" => inside = false,
                l if l.starts_with("fma.rn.f32") => {
                    *(if inside { &mut written } else { &mut stray }) += 1
                }
                _ => {}
            }
        }
        (written, stray)
    }

    #[test]
    fn an_fma_is_told_written_by_its_inline_asm_block() {
        let ptx =
            "\tmul.f32 %f1, %f2, %f3;\n\t// begin inline asm\n\tfma.rn.f32 %f4, %f1, %f2, %f3;\n\t\
                   // end inline asm\n\tfma.rn.f32 %f5, %f1, %f2, %f3;\n";
        assert_eq!(fma_counts(ptx), (1, 1));
    }

    fn compiles_the_kernels(nv: &NvrtcLib) {
        let who = format!("NVRTC {}.{} ({})", nv.version.0, nv.version.1, nv.path);
        // fo's calls are checked against NVRTC 12 and 13 (13 removed only nvrtcGetNVVM*);
        // a new major needs the same check before it is accepted.
        assert!((12..=13).contains(&nv.version.0), "{who}");
        let written = include_str!("../kernels/gpu/fo_rules.cuh")
            .matches("fo_fma(")
            .count();
        for (major, minor) in [(8, 0), (9, 0)] {
            let ptx = compile_ptx_with(nv, &arch_option(major, minor)).unwrap();
            let bytes: Vec<u8> = ptx.iter().map(|&c| c as u8).collect();
            let text = CStr::from_bytes_until_nul(&bytes)
                .unwrap()
                .to_str()
                .unwrap();
            for entry in all_entries() {
                assert!(
                    text.contains(&format!(".entry {entry}")),
                    "{who} sm_{major}{minor}: {entry}"
                );
            }
            // --fmad=false holds for f64 too: the norm's sums are not contracted.
            assert!(!text.contains("fma.rn.f64"), "{who} sm_{major}{minor}");
            assert!(
                text.contains(&format!(".target sm_{major}{minor}")),
                "{who} sm_{major}{minor}"
            );
            // --fmad=false took effect: the only fused multiply-adds are the written ones
            // (inline PTX, fo_shim.cuh), the generic path holding a copy of each.
            let (fmas, stray) = fma_counts(text);
            assert_eq!(stray, 0, "{who} sm_{major}{minor}: contracted fma.rn.f32");
            assert!(
                fmas >= written,
                "{who} sm_{major}{minor}: {fmas} < {written}"
            );
        }
        // The CUBIN the device loads first (PTX is the fallback): an ELF for each
        // architecture this NVRTC lists.
        let archs = nv.supported_archs().unwrap();
        let mut cubins = Vec::new();
        for (major, minor) in [(8, 0), (9, 0)] {
            if !archs.contains(&(major * 10 + minor)) {
                eprintln!("{who}: no sm_{major}{minor} among {archs:?}, no CUBIN to check");
                continue;
            }
            cubins.push(format!("sm_{major}{minor}"));
            let cubin = compile_cubin_with(nv, &cubin_arch_option(major, minor)).unwrap();
            assert!(cubin.starts_with(b"\x7fELF"), "{who} sm_{major}{minor}");
            for entry in all_entries() {
                assert!(
                    cubin.windows(entry.len()).any(|w| w == entry.as_bytes()),
                    "{who} sm_{major}{minor} CUBIN: {entry}"
                );
            }
        }
        eprintln!("{who}: PTX for compute_80 and compute_90, CUBIN for {cubins:?}");
        let e = compile_ptx_with(nv, "--gpu-architecture=compute_10")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("NVRTC could not compile fo's kernels (--gpu-architecture=compute_10")
                && e.contains("NVRTC_ERROR_INVALID_OPTION"),
            "{who}: {e}"
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
