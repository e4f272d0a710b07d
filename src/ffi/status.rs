//! Status codes and the thread-local last-error message of the C ABI, and `guard`: the
//! panic-catching wrapper every exported function runs its body in.
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::{Error, Result};

/// Return code of every fo function: `FO_OK` (0) or one of the `FO_ERR_*` codes.
pub type fo_status = i32;

pub const FO_OK: fo_status = 0;
/// A NULL pointer, a negative size, an index out of range, an unknown enum value.
pub const FO_ERR_INVALID_ARGUMENT: fo_status = 1;
/// An unknown or unsupported dtype, or a dtype that differs where it must not.
pub const FO_ERR_DTYPE: fo_status = 2;
/// Shapes that do not agree.
pub const FO_ERR_SHAPE: fo_status = 3;
/// A key, parameter or file that does not exist.
pub const FO_ERR_NOT_FOUND: fo_status = 4;
/// The operating system refused a file operation.
pub const FO_ERR_IO: fo_status = 5;
/// A truncated file, a bad header, a checksum mismatch.
pub const FO_ERR_CORRUPT: fo_status = 6;
/// A collective failed, or ranks disagreed.
pub const FO_ERR_COMM: fo_status = 7;
/// A non-finite gradient or an unrepresentable update (numerics checks on).
pub const FO_ERR_NUMERICS: fo_status = 8;
/// Valid, but not available in this build or on this machine (CUDA absent, ...).
pub const FO_ERR_UNSUPPORTED: fo_status = 9;
/// A bug in fo (a caught panic); the message says where.
pub const FO_ERR_INTERNAL: fo_status = 10;
/// The handle is in use by another call: another thread (handles take one call at a
/// time), or a callback re-entering fo with the handle whose call is running it. The
/// message names the call in progress; nothing was done.
pub const FO_ERR_BUSY: fo_status = 11;
/// A wait ran out of time (`fo_save_wait`); the work goes on: wait again.
pub const FO_ERR_TIMEOUT: fo_status = 12;

/// Most tensor or mesh dims fo accepts.
pub const FO_MAX_DIMS: usize = 8;

/// Most threads `fo_set_num_threads` accepts.
pub const FO_MAX_THREADS: i32 = 1024;

/// Most ranks of an in-process group (`fo_comm_create_local_group`).
pub const FO_MAX_LOCAL_WORLD: i32 = 1024;

/// Most ranks of one checkpoint (`fo_pack_options.world_size`).
pub const FO_MAX_WORLD_SIZE: i32 = 1 << 20;

/// The ABI version this header describes; compare with `fo_abi_version()` at load time.
pub const FO_ABI_VERSION: u32 = 2;

/// The status code for a core error: one code per variant, fixed forever.
pub(crate) fn status_of(e: &Error) -> fo_status {
    match e {
        Error::InvalidArgument { .. } => FO_ERR_INVALID_ARGUMENT,
        Error::Dtype(_) => FO_ERR_DTYPE,
        Error::Shape(_) => FO_ERR_SHAPE,
        Error::NotFound(_) => FO_ERR_NOT_FOUND,
        Error::Io { .. } => FO_ERR_IO,
        Error::Corrupt { .. } => FO_ERR_CORRUPT,
        Error::Comm(_) => FO_ERR_COMM,
        Error::Numerics(_) => FO_ERR_NUMERICS,
        Error::Unsupported(_) => FO_ERR_UNSUPPORTED,
        Error::Timeout(_) => FO_ERR_TIMEOUT,
        Error::Internal(_) => FO_ERR_INTERNAL,
        Error::Busy(_) => FO_ERR_BUSY,
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: String) {
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".to_string()
    }
}

/// Runs one entry point's body: a core error becomes its status and message, a panic
/// becomes `FO_ERR_INTERNAL` with the panic text. Nothing unwinds into C.
pub(crate) fn guard(f: impl FnOnce() -> Result<()>) -> fo_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => FO_OK,
        Ok(Err(e)) => {
            let code = status_of(&e);
            set_last_error(e.to_string());
            code
        }
        Err(payload) => {
            set_last_error(
                Error::Internal(format!("panic: {}", panic_text(payload.as_ref()))).to_string(),
            );
            FO_ERR_INTERNAL
        }
    }
}

/// For entry points that return no status (destroy functions): an error or a panic is
/// recorded as the thread's last error message, since there is no way to return it.
pub(crate) fn guard_void(f: impl FnOnce() -> Result<()>) {
    let _ = guard(f);
}

/// The message of the last failed fo call on this thread (empty if none failed yet).
/// Valid until the next fo call on this thread; never NULL.
#[no_mangle]
pub extern "C" fn fo_last_error_message() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// A static name for a status code (`"FO_ERR_SHAPE"`), `"FO_ERR_UNKNOWN"` for others.
#[no_mangle]
pub extern "C" fn fo_status_name(status: fo_status) -> *const c_char {
    let s: &'static [u8] = match status {
        FO_OK => b"FO_OK\0",
        FO_ERR_INVALID_ARGUMENT => b"FO_ERR_INVALID_ARGUMENT\0",
        FO_ERR_DTYPE => b"FO_ERR_DTYPE\0",
        FO_ERR_SHAPE => b"FO_ERR_SHAPE\0",
        FO_ERR_NOT_FOUND => b"FO_ERR_NOT_FOUND\0",
        FO_ERR_IO => b"FO_ERR_IO\0",
        FO_ERR_CORRUPT => b"FO_ERR_CORRUPT\0",
        FO_ERR_COMM => b"FO_ERR_COMM\0",
        FO_ERR_NUMERICS => b"FO_ERR_NUMERICS\0",
        FO_ERR_UNSUPPORTED => b"FO_ERR_UNSUPPORTED\0",
        FO_ERR_INTERNAL => b"FO_ERR_INTERNAL\0",
        FO_ERR_BUSY => b"FO_ERR_BUSY\0",
        FO_ERR_TIMEOUT => b"FO_ERR_TIMEOUT\0",
        _ => b"FO_ERR_UNKNOWN\0",
    };
    s.as_ptr() as *const c_char
}

/// The library version, `"MAJOR.MINOR.PATCH"`; a static string.
#[no_mangle]
pub extern "C" fn fo_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const c_char
}

/// The C ABI version; bumped on every breaking change. Hosts check it at load time.
#[no_mangle]
pub extern "C" fn fo_abi_version() -> u32 {
    FO_ABI_VERSION
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last() -> String {
        unsafe { CStr::from_ptr(fo_last_error_message()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn every_error_variant_has_its_own_nonzero_status() {
        let all = [
            Error::invalid("a", "b"),
            Error::Dtype(String::new()),
            Error::Shape(String::new()),
            Error::NotFound(String::new()),
            Error::io("f", std::io::Error::other("x")),
            Error::corrupt("f", "x"),
            Error::Comm(String::new()),
            Error::Numerics(String::new()),
            Error::Unsupported(String::new()),
            Error::Internal(String::new()),
            Error::Busy(String::new()),
        ];
        let mut codes: Vec<fo_status> = all.iter().map(status_of).collect();
        assert!(codes.iter().all(|&c| c != FO_OK));
        codes.sort();
        codes.dedup();
        assert_eq!(codes.len(), all.len());
        assert_eq!(FO_MAX_DIMS, crate::tensor::MAX_DIMS);
        assert_eq!(FO_MAX_THREADS as usize, crate::optim::threads::MAX_THREADS);
        assert_eq!(FO_MAX_LOCAL_WORLD as usize, crate::comm::MAX_LOCAL_WORLD);
        assert_eq!(
            FO_MAX_WORLD_SIZE as usize,
            crate::ckpt::commit::MAX_WORLD_SIZE
        );
    }

    #[test]
    fn guard_turns_a_panic_into_internal_with_its_text() {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let code = guard(|| panic!("boom at layer 3"));
        std::panic::set_hook(prev);
        assert_eq!(code, FO_ERR_INTERNAL);
        assert!(last().contains("boom at layer 3"), "{}", last());
    }

    #[test]
    fn guard_records_the_error_message() {
        let code = guard(|| Err(Error::Shape("key w: [2] vs [3]".into())));
        assert_eq!(code, FO_ERR_SHAPE);
        assert_eq!(last(), "shape mismatch: key w: [2] vs [3]");
        let name = unsafe { CStr::from_ptr(fo_status_name(code)) };
        assert_eq!(name.to_str().unwrap(), "FO_ERR_SHAPE");
    }
}
