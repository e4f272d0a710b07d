//! Resource checks before a benchmark allocates or writes: a size the machine cannot hold
//! is a one-line error (exit 1), not an abort on allocation or an OOM kill halfway.
use std::path::Path;

use super::ckpt::bytes as human;

/// Fails when `need` bytes (None: overflowed) exceed the available memory. `what` names
/// the flags that set the size (`--size 64M`).
pub fn check_memory(need: Option<u64>, what: &str) -> Result<(), String> {
    let avail = fo::sys::available_memory();
    match (need, avail) {
        (None, _) => Err(format!("{what}: the memory it needs overflows")),
        (Some(n), Some(a)) if n > a => Err(format!(
            "{what} needs about {} of memory, {} is available",
            human(n),
            human(a)
        )),
        _ => Ok(()),
    }
}

/// Fails when the file system holding `dir` (or its nearest existing ancestor) has fewer
/// than `need` bytes free.
pub fn check_disk(dir: &Path, need: Option<u64>, what: &str) -> Result<(), String> {
    let Some(need) = need else {
        return Err(format!("{what}: the disk space it needs overflows"));
    };
    let mut at = dir;
    while !at.exists() {
        at = match at.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
    }
    let Ok(c) = std::ffi::CString::new(at.as_os_str().as_encoded_bytes()) else {
        return Ok(());
    };
    // SAFETY: a NUL-terminated path and a zeroed out-struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Ok(()); // unknown: the writes themselves will report a full disk
    }
    let free = (st.f_bavail as u64).saturating_mul(st.f_frsize as u64);
    if need > free {
        return Err(format!(
            "{what} needs about {} of disk space in {}, {} is free",
            human(need),
            at.display(),
            human(free)
        ));
    }
    Ok(())
}

/// A vector of `n` elements made by `f`, or an error instead of an abort when the
/// allocation fails.
pub fn try_vec<T>(n: usize, what: &str, f: impl FnMut(usize) -> T) -> Result<Vec<T>, String> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        format!(
            "{what}: cannot allocate {}",
            human((n as u64).saturating_mul(std::mem::size_of::<T>() as u64))
        )
    })?;
    v.extend((0..n).map(f));
    Ok(v)
}
