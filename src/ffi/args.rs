//! Checked conversions from raw C arguments. Each names the argument in its error.
use std::ffi::{c_char, CStr};
use std::path::Path;

use crate::error::{Error, Result};
use crate::tensor::MAX_DIMS;

pub(crate) unsafe fn arg_ref<'a, T>(p: *const T, name: &str) -> Result<&'a T> {
    p.as_ref()
        .ok_or_else(|| Error::invalid(name, "NULL pointer"))
}

pub(crate) unsafe fn arg_mut<'a, T>(p: *mut T, name: &str) -> Result<&'a mut T> {
    p.as_mut()
        .ok_or_else(|| Error::invalid(name, "NULL pointer"))
}

/// A slice of `len` elements; NULL is allowed only for `len == 0`.
pub(crate) unsafe fn arg_slice<'a, T>(p: *const T, len: usize, name: &str) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Error::invalid(
            name,
            format!("NULL pointer for {len} elements"),
        ));
    }
    if len
        .checked_mul(std::mem::size_of::<T>())
        .is_none_or(|b| b > isize::MAX as usize)
    {
        return Err(Error::invalid(name, format!("length {len} is too large")));
    }
    Ok(std::slice::from_raw_parts(p, len))
}

pub(crate) unsafe fn arg_slice_mut<'a, T>(
    p: *mut T,
    len: usize,
    name: &str,
) -> Result<&'a mut [T]> {
    if len == 0 {
        return Ok(&mut []);
    }
    arg_slice(p as *const T, len, name)?;
    Ok(std::slice::from_raw_parts_mut(p, len))
}

/// A NUL-terminated UTF-8 string.
pub(crate) unsafe fn arg_str<'a>(p: *const c_char, name: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(Error::invalid(name, "NULL string"));
    }
    CStr::from_ptr(p)
        .to_str()
        .map_err(|_| Error::invalid(name, "not valid UTF-8"))
}

/// A NUL-terminated UTF-8 file system path, not empty (an empty path would mean the
/// current directory to some calls and nothing to others).
pub(crate) unsafe fn arg_path<'a>(p: *const c_char, name: &str) -> Result<&'a Path> {
    let s = arg_str(p, name)?;
    if s.is_empty() {
        return Err(Error::invalid(name, "empty path"));
    }
    Ok(Path::new(s))
}

/// A count of dims: `0..=FO_MAX_DIMS` (or `1..=` when `min_one`).
pub(crate) fn arg_ndim(n: i32, name: &str, min_one: bool) -> Result<usize> {
    let lo = if min_one { 1 } else { 0 };
    if n < lo || n as usize > MAX_DIMS {
        return Err(Error::invalid(
            name,
            format!("{n} is outside {lo}..={MAX_DIMS}"),
        ));
    }
    Ok(n as usize)
}

/// A C boolean flag: exactly 0 or 1 (any other value is a caller's bug, not "true").
pub(crate) fn arg_flag(v: i32, name: &str) -> Result<bool> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(Error::invalid(name, format!("{v} is not 0 or 1"))),
    }
}

/// A non-negative count from a signed C integer.
pub(crate) fn arg_count(n: i64, name: &str) -> Result<usize> {
    usize::try_from(n).map_err(|_| Error::invalid(name, format!("negative value {n}")))
}

/// Sizes or coordinates: every entry non-negative. `name` is the array's name.
pub(crate) fn arg_dims(v: &[i64], name: &str) -> Result<Vec<usize>> {
    v.iter()
        .enumerate()
        .map(|(i, &x)| arg_count(x, &format!("{name}[{i}]")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_and_negative_arguments_are_named() {
        let e = unsafe { arg_slice::<i64>(std::ptr::null(), 3, "mesh_shape") }.unwrap_err();
        assert!(e.to_string().contains("mesh_shape"), "{e}");
        assert!(unsafe { arg_slice::<i64>(std::ptr::null(), 0, "x") }
            .unwrap()
            .is_empty());
        let e = arg_dims(&[3, -1], "global_shape").unwrap_err();
        assert!(
            e.to_string().contains("global_shape[1]") && e.to_string().contains("-1"),
            "{e}"
        );
        let e = arg_ndim(9, "ndim", false).unwrap_err();
        assert!(e.to_string().contains("0..=8"), "{e}");
        assert!(arg_ndim(0, "mesh_ndim", true).is_err());
        let e = arg_flag(7, "options.strict").unwrap_err();
        assert!(
            e.to_string().contains("options.strict") && e.to_string().contains("7 is not 0 or 1"),
            "{e}"
        );
        assert!(arg_flag(1, "x").unwrap() && !arg_flag(0, "x").unwrap());
        let e = unsafe { arg_path(c"".as_ptr(), "dir") }.unwrap_err();
        assert!(e.to_string().contains("`dir`: empty path"), "{e}");
        let e = unsafe { arg_path(c"/tmp/caf\xe9".as_ptr(), "dir") }.unwrap_err();
        assert!(e.to_string().contains("not valid UTF-8"), "{e}");
        let e = unsafe { arg_str(std::ptr::null(), "fqn") }.unwrap_err();
        assert!(e.to_string().contains("fqn"), "{e}");
    }
}
