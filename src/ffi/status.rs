//! Status codes (`Status`, the table `FO_OK` and the `FO_ERR_*` constants are generated
//! from) and the thread-local last-error message of the C ABI, and `guard`: the
//! panic-catching wrapper every exported function runs its body in.
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::codes::{FO_ABI_VERSION, FO_ERR_INTERNAL, FO_OK};
use crate::error::{Error, Result};

/// Return code of every fo function: `FO_OK` (0) or one of the `FO_ERR_*` codes.
pub type fo_status = i32;

crate::codes::code_table! {
    /// The C ABI's status codes (`fo_status`): `FO_OK`, then one per `Error` variant, fixed
    /// forever (`status_of`). The names are the C constants' (`fo_status_name` returns them).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Status {
        noun = "status", c_prefix = "", c_type = fo_status, c_doc = "";
        Ok = 0, "FO_OK", "";
        InvalidArgument = 1, "FO_ERR_INVALID_ARGUMENT",
            "A NULL pointer, a negative size, an index out of range, an unknown enum value.";
        Dtype = 2, "FO_ERR_DTYPE",
            "An unknown or unsupported dtype, or a dtype that differs where it must not.";
        Shape = 3, "FO_ERR_SHAPE", "Shapes that do not agree.";
        NotFound = 4, "FO_ERR_NOT_FOUND", "A key, parameter or file that does not exist.";
        Io = 5, "FO_ERR_IO", "The operating system refused a file operation.";
        Corrupt = 6, "FO_ERR_CORRUPT", "A truncated file, a bad header, a checksum mismatch.";
        Comm = 7, "FO_ERR_COMM", "A collective failed, or ranks disagreed.";
        Numerics = 8, "FO_ERR_NUMERICS",
            "A non-finite gradient or an unrepresentable update (numerics checks on).";
        Unsupported = 9, "FO_ERR_UNSUPPORTED",
            "Valid, but not available in this build or on this machine (CUDA absent, ...).";
        Internal = 10, "FO_ERR_INTERNAL", "A bug in fo (a caught panic); the message says where.";
        Busy = 11, "FO_ERR_BUSY",
            "The handle is in use by another call: another thread (handles take one call at a\n\
             time), or a callback re-entering fo with the handle whose call is running it. The\n\
             message names the call in progress; nothing was done.";
        Timeout = 12, "FO_ERR_TIMEOUT",
            "A wait ran out of time (`fo_save_wait`); the work goes on: wait again.";
    }
}

/// The status code for a core error: one code per variant, fixed forever.
pub(crate) fn status_of(e: &Error) -> fo_status {
    let s = match e {
        Error::InvalidArgument { .. } => Status::InvalidArgument,
        Error::Dtype(_) => Status::Dtype,
        Error::Shape(_) => Status::Shape,
        Error::NotFound(_) => Status::NotFound,
        Error::Io { .. } => Status::Io,
        Error::Corrupt { .. } => Status::Corrupt,
        Error::Comm(_) => Status::Comm,
        Error::Numerics(_) => Status::Numerics,
        Error::Unsupported(_) => Status::Unsupported,
        Error::Timeout(_) => Status::Timeout,
        Error::Internal(_) => Status::Internal,
        Error::Busy(_) => Status::Busy,
    };
    s.code()
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: String) {
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    crate::error::panic_message(payload)
        .unwrap_or("a panic with a non-string payload")
        .to_string()
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
    match Status::by_code(status) {
        Some(s) => s.name_c().as_ptr(),
        None => c"FO_ERR_UNKNOWN".as_ptr(),
    }
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
    use super::super::codes::{FO_ERR_BUSY, FO_ERR_SHAPE};
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
    }

    #[test]
    fn status_names_are_the_constants_names() {
        let name = |c| {
            unsafe { CStr::from_ptr(fo_status_name(c)) }
                .to_str()
                .unwrap()
        };
        assert_eq!(name(FO_OK), "FO_OK");
        assert_eq!(name(FO_ERR_BUSY), "FO_ERR_BUSY");
        assert_eq!(name(13), "FO_ERR_UNKNOWN");
        assert_eq!(name(-1), "FO_ERR_UNKNOWN");
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
