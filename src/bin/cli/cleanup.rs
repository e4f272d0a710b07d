//! What an interrupted `fo` removes: partial output registered while a command writes it.
//!
//! SIGINT, SIGTERM and SIGHUP are blocked in every thread at start (threads inherit the
//! mask; `std::process::Command` resets it for children) and taken by one thread with
//! `sigwait`, which runs ordinary code: it removes every registered path, says so on
//! stderr, then dies of the same signal (a shell sees an interrupted process, not a
//! failure). Registration and publishing share a lock, so a destination is either still
//! staged (and removed) or already in place (and kept), never half moved. SIGKILL cannot
//! be caught: the staging names carry the process id, and the next run removes those of
//! processes that no longer exist (`dst.rs`).
use std::path::{Path, PathBuf};
use std::sync::Mutex;

static REGISTERED: Mutex<Vec<(u64, PathBuf)>> = Mutex::new(Vec::new());
static NEXT: Mutex<u64> = Mutex::new(0);

fn signal_set() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise the set in place.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Blocks the termination signals and starts the thread that handles them. Call first
/// in `main`, before any other thread exists.
pub fn install() {
    let set = signal_set();
    // SAFETY: a valid set; only the calling (main) thread exists yet.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    let spawned = std::thread::Builder::new()
        .name("fo-signals".into())
        .spawn(move || loop {
            let mut sig = 0;
            // SAFETY: a valid set and out pointer.
            if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
                continue;
            }
            let removed = remove_all();
            let name = match sig {
                libc::SIGINT => "SIGINT",
                libc::SIGTERM => "SIGTERM",
                _ => "SIGHUP",
            };
            if removed.is_empty() {
                eprintln!("fo: interrupted ({name})");
            } else {
                eprintln!(
                    "fo: interrupted ({name}); removed the partial output {}",
                    removed.join(", ")
                );
            }
            // SAFETY: restore the default action, unblock here and re-raise: the process
            // ends by this signal, as it would have without fo's handling.
            unsafe {
                libc::signal(sig, libc::SIG_DFL);
                libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
                libc::raise(sig);
                libc::_exit(128 + sig);
            }
        });
    if spawned.is_err() {
        // Without the handler thread, let the signals act as they would by default.
        // SAFETY: as above.
        unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
    }
}

/// Removes the registered paths (the lock stays held: nothing is published after this).
fn remove_all() -> Vec<String> {
    let reg = REGISTERED.lock().unwrap_or_else(|e| e.into_inner());
    let mut removed = Vec::new();
    for (_, p) in reg.iter() {
        // Worker threads may still be creating files in it: retry until it is gone.
        for _ in 0..50 {
            if remove_path(p) {
                break;
            }
        }
        removed.push(p.display().to_string());
    }
    std::mem::forget(reg);
    removed
}

/// Removes a file or a directory tree; true when nothing is left at `p`.
pub fn remove_path(p: &Path) -> bool {
    match std::fs::symlink_metadata(p) {
        Err(_) => true,
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p).is_ok() || !p.exists(),
        Ok(_) => std::fs::remove_file(p).is_ok(),
    }
}

/// A path removed if the process is interrupted while this guard lives.
pub struct Guard(u64);

/// Registers `p` (created by this run) for removal on interruption.
pub fn register(p: &Path) -> Guard {
    let id = {
        let mut n = NEXT.lock().unwrap_or_else(|e| e.into_inner());
        *n += 1;
        *n
    };
    REGISTERED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((id, p.to_path_buf()));
    Guard(id)
}

impl Guard {
    /// Runs `f` (the publishing rename) with no interruption handled meanwhile, then
    /// unregisters the path: after this, the output is the user's.
    pub fn publish<T>(self, f: impl FnOnce() -> T) -> T {
        let mut reg = REGISTERED.lock().unwrap_or_else(|e| e.into_inner());
        let out = f();
        reg.retain(|(id, _)| *id != self.0);
        drop(reg);
        std::mem::forget(self);
        out
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        REGISTERED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(id, _)| *id != self.0);
    }
}
