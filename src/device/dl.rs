//! Loading the CUDA-family libraries that pip wheels ship (NVRTC, NCCL), which a plain
//! `dlopen` by name misses: torch's wheels put them under `site-packages/nvidia/...`
//! and find them through their own RPATH, so they are on no search path. The pieces the
//! searches share (`comm::nccl_lib`, `device::nvrtc_lib`): `dlopen` with `dlerror`'s text,
//! the libraries already in the process, the `site-packages` directories those live in,
//! and the file a handle came from. Plain `dlopen`, no CUDA: built with or without `cuda`.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// `dlopen`, with `dlerror`'s text (prefixed by `name`) on failure.
///
/// # Safety
/// Loading a library runs its initializers: `name` must be a library meant to be loaded.
pub unsafe fn open(name: &str, flags: c_int) -> std::result::Result<*mut c_void, String> {
    let c = CString::new(name).map_err(|_| format!("{name:?}: a path with a NUL byte"))?;
    let h = libc::dlopen(c.as_ptr(), flags);
    if h.is_null() {
        let e = libc::dlerror();
        let why = if e.is_null() {
            "not found".to_string()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        };
        // dlerror's text usually starts with the name already; say it once.
        return Err(if why.starts_with(name) {
            why
        } else {
            format!("{name}: {why}")
        });
    }
    Ok(h)
}

/// The function `name` of the library `h`, or None.
///
/// # Safety
/// `h` is a live `dlopen` handle.
pub unsafe fn symbol(h: *mut c_void, name: &CStr) -> Option<*mut c_void> {
    let f = libc::dlsym(h, name.as_ptr());
    (!f.is_null()).then_some(f)
}

/// `symbol`, or `Error::Unsupported` naming the library's file, the symbol and what its
/// absence says (`why`: which libraries lack it).
///
/// # Safety
/// As `symbol`.
pub unsafe fn required_symbol(
    h: *mut c_void,
    name: &CStr,
    path: &str,
    why: &str,
) -> crate::error::Result<*mut c_void> {
    symbol(h, name).ok_or_else(|| {
        crate::error::Error::Unsupported(format!(
            "{path}: no symbol {} ({why})",
            name.to_string_lossy()
        ))
    })
}

/// The file a `dlopen` handle came from (as the loader recorded it), or `fallback`.
///
/// # Safety
/// `h` is a live `dlopen` handle.
pub unsafe fn library_path(h: *mut c_void, fallback: &str) -> String {
    let mut map: *mut libc::c_void = std::ptr::null_mut();
    // RTLD_DI_LINKMAP = 2: the handle's `struct link_map`, whose second field is l_name.
    if libc::dlinfo(h, 2, &mut map as *mut _ as *mut c_void) == 0 && !map.is_null() {
        let name = *(map as *const *const c_char).add(1);
        if !name.is_null() && *name != 0 {
            return CStr::from_ptr(name).to_string_lossy().into_owned();
        }
    }
    fallback.into()
}

/// The paths of every library loaded in this process (the main program excluded).
pub fn loaded_libraries() -> Vec<String> {
    unsafe extern "C" fn each(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> c_int {
        let out = &mut *(data as *mut Vec<String>);
        let name = (*info).dlpi_name;
        if !name.is_null() {
            let s = CStr::from_ptr(name).to_string_lossy();
            if !s.is_empty() {
                out.push(s.into_owned());
            }
        }
        0
    }
    let mut out: Vec<String> = Vec::new();
    // SAFETY: the callback only reads the entries it is given.
    unsafe { libc::dl_iterate_phdr(Some(each), &mut out as *mut _ as *mut c_void) };
    out
}

/// The `site-packages` (or Debian's `dist-packages`) directories the `loaded` libraries
/// live in (torch's, or fo's own when pip-installed), then those of `$VIRTUAL_ENV`
/// (`venv`), in order, without repeats.
pub fn site_packages<'a>(
    loaded: impl IntoIterator<Item = &'a str>,
    venv: Option<&Path>,
) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    let mut add = |p: PathBuf| {
        if !out.contains(&p) {
            out.push(p);
        }
    };
    for p in loaded {
        for marker in ["/site-packages/", "/dist-packages/"] {
            if let Some(at) = p.find(marker) {
                add(PathBuf::from(&p[..at + marker.len() - 1]));
            }
        }
    }
    if let Some(v) = venv {
        // <venv>/lib/python3.X/site-packages, whichever Python made the venv.
        let mut found: Vec<PathBuf> = std::fs::read_dir(v.join("lib"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path().join("site-packages"))
            .filter(|p| p.is_dir())
            .collect();
        found.sort();
        found.into_iter().for_each(add);
    }
    out
}

/// The library `held` keeps, else the one `load` gives, kept in `held` for the process.
/// A failure is not kept: a later call, after torch has loaded its copy, tries again.
pub fn load_once<T>(
    held: &Mutex<Option<&'static T>>,
    load: impl FnOnce() -> crate::error::Result<T>,
) -> crate::error::Result<&'static T> {
    let mut held = held.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(l) = *held {
        return Ok(l);
    }
    let l: &'static T = Box::leak(Box::new(load()?));
    *held = Some(l);
    Ok(l)
}

/// The path the environment variable `var` names (`FO_NCCL_LIBRARY`...), if set.
pub fn env_path(var: &str) -> Option<String> {
    std::env::var_os(var).map(|p| p.to_string_lossy().into_owned())
}

/// The `$VIRTUAL_ENV` of this process, if any.
pub fn virtual_env() -> Option<PathBuf> {
    std::env::var_os("VIRTUAL_ENV").map(PathBuf::from)
}

/// The libraries of a process with torch from a venv's wheels and fo from Debian's
/// `dist-packages` (for the searches' tests).
#[cfg(test)]
pub(crate) const TEST_LOADED: [&str; 4] = [
    "/usr/lib/x86_64-linux-gnu/libc.so.6",
    "/v/lib/python3.12/site-packages/torch/lib/libtorch_cuda.so",
    "/v/lib/python3.12/site-packages/torch/lib/libc10.so",
    "/usr/lib/python3/dist-packages/fo/libfo.so",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn site_packages_are_those_of_loaded_libraries_then_the_venv() {
        let venv = std::env::temp_dir().join(format!("fo-dl-venv-{}", std::process::id()));
        let sp = venv.join("lib/python3.12/site-packages");
        std::fs::create_dir_all(&sp).unwrap();
        assert_eq!(
            site_packages(TEST_LOADED, Some(&venv)),
            [
                PathBuf::from("/v/lib/python3.12/site-packages"),
                PathBuf::from("/usr/lib/python3/dist-packages"),
                sp,
            ]
        );
        std::fs::remove_dir_all(&venv).unwrap();
    }

    #[test]
    fn loaded_libraries_include_libc() {
        assert!(loaded_libraries().iter().any(|l| l.contains("libc.so")));
    }

    #[test]
    fn a_library_that_does_not_load_is_named_with_the_loaders_reason() {
        // SAFETY: the file does not exist; nothing is loaded.
        let e = unsafe { open("/nonexistent/libfoo.so.1", libc::RTLD_NOW) }.unwrap_err();
        assert!(e.starts_with("/nonexistent/libfoo.so.1: "), "{e}");
        assert!(e.contains("No such file"), "{e}");
        // SAFETY: libc is loaded in every process.
        let h = unsafe { open("libc.so.6", libc::RTLD_NOW | libc::RTLD_NOLOAD) }.unwrap();
        assert!(unsafe { library_path(h, "?") }.contains("libc.so"));
        assert!(unsafe { symbol(h, c"malloc") }.is_some());
        assert!(unsafe { symbol(h, c"fo_no_such_function") }.is_none());
    }
}
