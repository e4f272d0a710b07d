//! Loads NVRTC where a pip (PyPI) install has it (feature `cuda`). cudarc only tries
//! `libnvrtc.so` and `libnvrtc.so.{12,11,10,9,1}` on the library path, but torch's CUDA 13
//! wheels ship `site-packages/nvidia/cu13/lib/libnvrtc.so.13` (and the CUDA 12 ones
//! `site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12`), found by torch through its
//! RPATH, not by a plain `dlopen`. So fo resolves the few NVRTC functions it calls itself,
//! as it does NCCL's (`comm::nccl_lib`), from the first of:
//! 1. `FO_NVRTC_LIBRARY` (a path), when set: that file or an error naming it;
//! 2. a `libnvrtc.so*` already loaded in the process (torch's);
//! 3. `nvidia/cu13/lib/libnvrtc.so.13`, then `nvidia/cuda_nvrtc/lib/libnvrtc.so.12`, under
//!    every `site-packages` directory a library loaded in this process lives in (torch's,
//!    or fo's own when pip-installed), then under `$VIRTUAL_ENV`'s;
//! 4. `libnvrtc.so`, `.so.13`, `.so.12`, `.so.11.2` on the dynamic loader's search path.
//!
//! NVRTC 12 and 13 export every function fo calls with the same signatures (13 dropped
//! only `nvrtcGetNVVM*`, which fo does not use). Loading needs no GPU and no libcuda.
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::Path;
use std::sync::Mutex;

use super::dl;
use crate::error::{Error, Result};

pub type NvrtcResult = c_int;
pub type NvrtcProgram = *mut c_void;

/// Where the wheels put NVRTC, relative to `site-packages`, newest first: CUDA 13's
/// `nvidia-cuda-nvrtc` (torch's cu13 wheels), CUDA 12's `nvidia-cuda-nvrtc-cu12`.
pub const WHEEL_LIBRARIES: [&str; 2] = [
    "nvidia/cu13/lib/libnvrtc.so.13",
    "nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
];
/// The names tried on the loader's search path: the toolkit's unversioned link (whichever
/// toolkit is installed), then each major's soname, newest first.
pub const SONAMES: [&str; 4] = [
    "libnvrtc.so",
    "libnvrtc.so.13",
    "libnvrtc.so.12",
    "libnvrtc.so.11.2",
];

/// How the library was found (the search's step).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// `FO_NVRTC_LIBRARY`.
    Explicit,
    /// Already loaded in the process (by torch, say).
    Loaded,
    /// A wheel's file under a `site-packages` directory.
    Wheel,
    /// A name on the loader's search path.
    SearchPath,
}

/// The NVRTC functions fo calls, resolved from one library.
pub struct NvrtcLib {
    /// The file the functions come from.
    pub path: String,
    pub found: Found,
    /// NVRTC's (major, minor).
    pub version: (i32, i32),
    pub create_program: unsafe extern "C" fn(
        *mut NvrtcProgram,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> NvrtcResult,
    pub compile_program:
        unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> NvrtcResult,
    pub destroy_program: unsafe extern "C" fn(*mut NvrtcProgram) -> NvrtcResult,
    pub get_program_log_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> NvrtcResult,
    pub get_program_log: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> NvrtcResult,
    pub get_ptx_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> NvrtcResult,
    pub get_ptx: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> NvrtcResult,
    pub get_cubin_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> NvrtcResult,
    pub get_cubin: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> NvrtcResult,
    pub get_error_string: unsafe extern "C" fn(NvrtcResult) -> *const c_char,
    pub get_num_supported_archs: unsafe extern "C" fn(*mut c_int) -> NvrtcResult,
    pub get_supported_archs: unsafe extern "C" fn(*mut c_int) -> NvrtcResult,
}

// SAFETY: plain function pointers into a library that stays loaded for the process;
// NVRTC's functions are thread-safe for distinct programs.
unsafe impl Send for NvrtcLib {}
unsafe impl Sync for NvrtcLib {}

impl NvrtcLib {
    /// `Ok` for NVRTC_SUCCESS, else `Unsupported` naming `what` in NVRTC's words.
    pub fn check(&self, what: &str, r: NvrtcResult) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: NVRTC returns a static NUL-terminated string (or NULL).
        let text = unsafe {
            let p = (self.get_error_string)(r);
            (!p.is_null()).then(|| CStr::from_ptr(p).to_string_lossy().into_owned())
        };
        Err(Error::Unsupported(format!(
            "{what} ({}, NVRTC {}.{}): {} ({r})",
            self.path,
            self.version.0,
            self.version.1,
            text.unwrap_or_default()
        )))
    }

    /// The `sm_XY` architectures this NVRTC compiles for, as 10*major+minor (80, 90, ...).
    pub fn supported_archs(&self) -> Result<Vec<i32>> {
        let mut n: c_int = 0;
        // SAFETY: writes one int, then `n` ints into a buffer of `n`.
        unsafe {
            self.check(
                "nvrtcGetNumSupportedArchs",
                (self.get_num_supported_archs)(&mut n),
            )?;
            let mut v = vec![0 as c_int; n.max(0) as usize];
            self.check(
                "nvrtcGetSupportedArchs",
                (self.get_supported_archs)(v.as_mut_ptr()),
            )?;
            Ok(v)
        }
    }
}

/// The NVRTC library of this process, loaded on first success (a failure is not kept:
/// a later call, after torch has loaded its copy, tries again).
pub fn lib() -> Result<&'static NvrtcLib> {
    static LIB: Mutex<Option<&'static NvrtcLib>> = Mutex::new(None);
    dl::load_once(&LIB, || {
        let explicit = dl::env_path("FO_NVRTC_LIBRARY");
        let venv = dl::virtual_env();
        load(&Search {
            explicit: explicit.as_deref(),
            loaded: &dl::loaded_libraries(),
            venv: venv.as_deref(),
            names: &SONAMES,
        })
    })
}

/// What the search looks at: the process's state in `lib()`, chosen ones in tests.
pub struct Search<'a> {
    /// `FO_NVRTC_LIBRARY`.
    pub explicit: Option<&'a str>,
    /// The paths of the libraries loaded in the process.
    pub loaded: &'a [String],
    /// `$VIRTUAL_ENV`.
    pub venv: Option<&'a Path>,
    /// Names for the loader's search path.
    pub names: &'a [&'a str],
}

/// Loads NVRTC by the search (the module doc's order).
pub fn load(s: &Search) -> Result<NvrtcLib> {
    if let Some(p) = s.explicit {
        // SAFETY: loading a library the user named for this purpose.
        let named = |e: String| Error::Unsupported(format!("FO_NVRTC_LIBRARY={p}: {e}"));
        let h = unsafe { dl::open(p, libc::RTLD_NOW) }.map_err(named)?;
        return unsafe { resolve(h, p.to_string(), Found::Explicit) }.map_err(|e| match e {
            Error::Unsupported(m) => named(m),
            e => e,
        });
    }
    let mut tried = Vec::new();
    for p in already_loaded(s.loaded) {
        // SAFETY: RTLD_NOLOAD only finds a library already in the process.
        if let Ok(h) = unsafe { dl::open(p, libc::RTLD_NOW | libc::RTLD_NOLOAD) } {
            return unsafe { resolve(h, p.to_string(), Found::Loaded) };
        }
    }
    tried.push("a libnvrtc.so* already loaded in this process (none)".to_string());
    let sites = dl::site_packages(s.loaded.iter().map(String::as_str), s.venv);
    if sites.is_empty() {
        tried.push("site-packages/nvidia/... (no site-packages directory among the loaded libraries or $VIRTUAL_ENV)".into());
    }
    for site in &sites {
        for rel in WHEEL_LIBRARIES {
            let c = site.join(rel).to_string_lossy().into_owned();
            if !Path::new(&c).is_file() {
                tried.push(format!("{c} (no such file)"));
                continue;
            }
            // SAFETY: the NVRTC wheel's library.
            match unsafe { dl::open(&c, libc::RTLD_NOW) } {
                Ok(h) => return unsafe { resolve(h, c, Found::Wheel) },
                Err(e) => tried.push(e),
            }
        }
    }
    for name in s.names {
        // SAFETY: the system's NVRTC, by its usual names.
        match unsafe { dl::open(name, libc::RTLD_NOW) } {
            Ok(h) => {
                let path = unsafe { dl::library_path(h, name) };
                return unsafe { resolve(h, path, Found::SearchPath) };
            }
            Err(e) => tried.push(e),
        }
    }
    Err(Error::Unsupported(format!(
        "the NVRTC library (libnvrtc.so.13 or libnvrtc.so.12) could not be loaded; tried: {}. \
         Set FO_NVRTC_LIBRARY to its path (pip's nvidia-cuda-nvrtc has it under \
         site-packages/nvidia/cu13/lib, nvidia-cuda-nvrtc-cu12 under \
         site-packages/nvidia/cuda_nvrtc/lib)",
        tried.join("; ")
    )))
}

/// The loaded libraries that are NVRTC itself (`libnvrtc.so*`, not its builtins), in order.
pub fn already_loaded(loaded: &[String]) -> impl Iterator<Item = &str> {
    loaded.iter().map(String::as_str).filter(|p| {
        let file = p.rsplit('/').next().unwrap_or(p);
        file == "libnvrtc.so" || file.starts_with("libnvrtc.so.")
    })
}

/// Every function of `NvrtcLib` from the library `h` (kept loaded for the process).
unsafe fn resolve(h: *mut c_void, path: String, found: Found) -> Result<NvrtcLib> {
    let sym = |name: &CStr| {
        dl::required_symbol(
            h,
            name,
            &path,
            "not an NVRTC library, or one older than 11.2",
        )
    };
    macro_rules! f {
        ($name:literal) => {
            std::mem::transmute_copy::<*mut c_void, _>(&sym($name)?)
        };
    }
    let version_fn: unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult =
        f!(c"nvrtcVersion");
    let mut lib = NvrtcLib {
        version: (0, 0),
        create_program: f!(c"nvrtcCreateProgram"),
        compile_program: f!(c"nvrtcCompileProgram"),
        destroy_program: f!(c"nvrtcDestroyProgram"),
        get_program_log_size: f!(c"nvrtcGetProgramLogSize"),
        get_program_log: f!(c"nvrtcGetProgramLog"),
        get_ptx_size: f!(c"nvrtcGetPTXSize"),
        get_ptx: f!(c"nvrtcGetPTX"),
        get_cubin_size: f!(c"nvrtcGetCUBINSize"),
        get_cubin: f!(c"nvrtcGetCUBIN"),
        get_error_string: f!(c"nvrtcGetErrorString"),
        get_num_supported_archs: f!(c"nvrtcGetNumSupportedArchs"),
        get_supported_archs: f!(c"nvrtcGetSupportedArchs"),
        path,
        found,
    };
    let (mut major, mut minor) = (0, 0);
    lib.check("nvrtcVersion", version_fn(&mut major, &mut minor))?;
    lib.version = (major, minor);
    Ok(lib)
}

#[cfg(test)]
#[path = "nvrtc_lib_tests.rs"]
pub(crate) mod tests;
