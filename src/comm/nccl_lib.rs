//! Loads NCCL where a PyTorch install has it (feature `cuda`). cudarc only tries
//! `libnccl.so` and `libnccl.so.{12,11,10,9,1}`, but the `nvidia-nccl-cu*` wheels that
//! torch depends on ship `site-packages/nvidia/nccl/lib/libnccl.so.2` only, found by
//! torch through its RPATH, not by a plain `dlopen`. So fo resolves the few NCCL
//! functions it calls itself, from the first of:
//! 1. `FO_NCCL_LIBRARY` (a path), when set: that file or an error naming it;
//! 2. the copy already in the process (torch's): `dlopen(.., RTLD_NOLOAD)`;
//! 3. `nvidia/nccl/lib/libnccl.so.2` under every `site-packages` directory a library
//!    loaded in this process lives in (torch's, or fo's own when pip-installed), and
//!    under `$VIRTUAL_ENV`;
//! 4. `libnccl.so.2`, then `libnccl.so`, on the dynamic loader's search path.
//!
//! Loading and `ncclGetVersion` need no GPU, so CI checks this path against the wheel.
//! Plain `dlopen`, no CUDA: built (and its search tested) with or without the `cuda` feature.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::device::dl;
use crate::error::{Error, Result};

pub type NcclResult = c_int;
pub type NcclComm = *mut c_void;
pub type CudaStream = *mut c_void;

pub const NCCL_SUCCESS: NcclResult = 0;
/// A non-blocking communicator's "not finished yet" (not an error).
pub const NCCL_IN_PROGRESS: NcclResult = 7;
pub const NCCL_UINT8: c_int = 1;
pub const NCCL_FLOAT64: c_int = 8;
pub const NCCL_SUM: c_int = 0;
pub const NCCL_MAX: c_int = 2;

/// The NCCL functions fo calls, resolved from one library.
pub struct NcclLib {
    /// The file the functions come from (as the loader reports it).
    pub path: String,
    pub get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    pub get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    pub get_last_error: unsafe extern "C" fn(NcclComm) -> *const c_char,
    pub comm_count: unsafe extern "C" fn(NcclComm, *mut c_int) -> NcclResult,
    pub comm_cu_device: unsafe extern "C" fn(NcclComm, *mut c_int) -> NcclResult,
    pub comm_user_rank: unsafe extern "C" fn(NcclComm, *mut c_int) -> NcclResult,
    pub comm_get_async_error: unsafe extern "C" fn(NcclComm, *mut NcclResult) -> NcclResult,
    pub comm_abort: unsafe extern "C" fn(NcclComm) -> NcclResult,
    #[allow(clippy::type_complexity)]
    pub broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        NcclComm,
        CudaStream,
    ) -> NcclResult,
    #[allow(clippy::type_complexity)]
    pub all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        NcclComm,
        CudaStream,
    ) -> NcclResult,
    pub send: unsafe extern "C" fn(
        *const c_void,
        usize,
        c_int,
        c_int,
        NcclComm,
        CudaStream,
    ) -> NcclResult,
    pub recv:
        unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, NcclComm, CudaStream) -> NcclResult,
}

impl NcclLib {
    /// NCCL's version code (e.g. 23203 for 2.32.3).
    pub fn version(&self) -> Result<i32> {
        let mut v: c_int = 0;
        // SAFETY: writes one int.
        let r = unsafe { (self.get_version)(&mut v) };
        self.check("ncclGetVersion", r, std::ptr::null_mut())?;
        Ok(v)
    }

    /// NCCL's own words for `r` (and, for a communicator, its last error message).
    pub fn describe(&self, r: NcclResult, comm: NcclComm) -> String {
        // SAFETY: NCCL returns static (or per-communicator) NUL-terminated strings.
        let text = |p: *const c_char| unsafe {
            (!p.is_null()).then(|| CStr::from_ptr(p).to_string_lossy().into_owned())
        };
        let mut s = format!(
            "NCCL error {r} ({})",
            text(unsafe { (self.get_error_string)(r) }).unwrap_or_default()
        );
        if !comm.is_null() {
            if let Some(last) =
                text(unsafe { (self.get_last_error)(comm) }).filter(|t| !t.is_empty())
            {
                s.push_str(": ");
                s.push_str(&last);
            }
        }
        s
    }

    /// `Ok` for success and for a non-blocking communicator's "in progress" (the wait
    /// polls it to completion), else `Error::Comm` naming `what` in NCCL's words.
    pub fn check(&self, what: &str, r: NcclResult, comm: NcclComm) -> Result<()> {
        match r {
            NCCL_SUCCESS | NCCL_IN_PROGRESS => Ok(()),
            r => Err(Error::Comm(format!("{what}: {}", self.describe(r, comm)))),
        }
    }
}

// SAFETY: plain function pointers into a library that stays loaded for the process.
unsafe impl Send for NcclLib {}
unsafe impl Sync for NcclLib {}

/// Where `libnccl.so.2` of the `nvidia-nccl-cu*` wheel would be, for each `site-packages`
/// directory one of `loaded` (paths of loaded libraries) lives in, then `$VIRTUAL_ENV`'s
/// (`venv`); in order, no repeats.
pub fn wheel_candidates<'a>(
    loaded: impl IntoIterator<Item = &'a str>,
    venv: Option<&Path>,
) -> Vec<PathBuf> {
    dl::site_packages(loaded, venv)
        .into_iter()
        .map(|s| s.join("nvidia/nccl/lib/libnccl.so.2"))
        .collect()
}

/// The NCCL library of this process, loaded on first success (a failure is not kept:
/// a later call, after torch has loaded its copy, tries again).
pub fn lib() -> Result<&'static NcclLib> {
    static LIB: Mutex<Option<&'static NcclLib>> = Mutex::new(None);
    dl::load_once(&LIB, || load(dl::env_path("FO_NCCL_LIBRARY")))
}

/// Loads NCCL from `explicit` (`FO_NCCL_LIBRARY`) when given, else by the search.
fn load(explicit: Option<String>) -> Result<NcclLib> {
    if let Some(p) = explicit {
        // SAFETY: loading a library the user named for this purpose.
        let h = unsafe { dl::open(&p, libc::RTLD_NOW) }
            .map_err(|e| Error::Unsupported(format!("FO_NCCL_LIBRARY={p}: {e}")))?;
        return unsafe { resolve(h) };
    }
    let mut tried = Vec::new();
    for name in ["libnccl.so.2", "libnccl.so"] {
        // SAFETY: RTLD_NOLOAD only finds a library already in the process.
        if let Ok(h) = unsafe { dl::open(name, libc::RTLD_NOW | libc::RTLD_NOLOAD) } {
            return unsafe { resolve(h) };
        }
    }
    tried.push("a libnccl already loaded (torch's)".to_string());
    let venv = dl::virtual_env();
    let dirs = wheel_candidates(
        dl::loaded_libraries().iter().map(String::as_str),
        venv.as_deref(),
    );
    for c in dirs.iter().filter(|c| c.is_file()) {
        // SAFETY: the NCCL wheel's library.
        if let Ok(h) = unsafe { dl::open(&c.to_string_lossy(), libc::RTLD_NOW) } {
            return unsafe { resolve(h) };
        }
    }
    tried.extend(dirs.iter().map(|d| d.display().to_string()));
    for name in ["libnccl.so.2", "libnccl.so"] {
        // SAFETY: the system's NCCL, by its usual names.
        match unsafe { dl::open(name, libc::RTLD_NOW) } {
            Ok(h) => return unsafe { resolve(h) },
            Err(e) => tried.push(e),
        }
    }
    Err(Error::Unsupported(format!(
        "the NCCL library (libnccl.so.2) could not be loaded; tried: {}. Set FO_NCCL_LIBRARY \
         to its path (pip's nvidia-nccl-cu12 has it under site-packages/nvidia/nccl/lib)",
        tried.join("; ")
    )))
}

/// Every function of `NcclLib` from the library `h` (kept loaded for the process).
unsafe fn resolve(h: *mut c_void) -> Result<NcclLib> {
    let path = dl::library_path(h, "libnccl");
    let sym = |name: &CStr| dl::required_symbol(h, name, &path, "NCCL older than 2.14?");
    macro_rules! f {
        ($name:literal) => {
            std::mem::transmute_copy::<*mut c_void, _>(&sym($name)?)
        };
    }
    Ok(NcclLib {
        get_version: f!(c"ncclGetVersion"),
        get_error_string: f!(c"ncclGetErrorString"),
        get_last_error: f!(c"ncclGetLastError"),
        comm_count: f!(c"ncclCommCount"),
        comm_cu_device: f!(c"ncclCommCuDevice"),
        comm_user_rank: f!(c"ncclCommUserRank"),
        comm_get_async_error: f!(c"ncclCommGetAsyncError"),
        comm_abort: f!(c"ncclCommAbort"),
        broadcast: f!(c"ncclBroadcast"),
        all_reduce: f!(c"ncclAllReduce"),
        send: f!(c"ncclSend"),
        recv: f!(c"ncclRecv"),
        path,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wheel_is_looked_for_beside_every_loaded_site_packages_library() {
        assert_eq!(
            wheel_candidates(dl::TEST_LOADED, None),
            [
                PathBuf::from("/v/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"),
                PathBuf::from("/usr/lib/python3/dist-packages/nvidia/nccl/lib/libnccl.so.2"),
            ]
        );
    }

    #[test]
    fn fo_nccl_library_is_that_file_or_an_error_naming_it() {
        let e = load(Some("/nonexistent/libnccl.so.2".into()))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("FO_NCCL_LIBRARY=/nonexistent/libnccl.so.2: "),
            "{e}"
        );
        let Some(wheel) = std::env::var_os("FO_TEST_NCCL_LIBRARY") else {
            eprintln!("skipped: FO_TEST_NCCL_LIBRARY (the wheel's libnccl.so.2) is not set");
            return;
        };
        let wheel = wheel.to_string_lossy().into_owned();
        let l = load(Some(wheel.clone())).unwrap();
        assert_eq!(l.path, wheel);
        assert!(l.version().unwrap() >= 21400);
        assert!(l
            .describe(4, std::ptr::null_mut())
            .starts_with("NCCL error 4 (invalid argument"));
    }
}
