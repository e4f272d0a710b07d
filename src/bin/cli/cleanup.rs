//! What an interrupted `fo` removes: partial output registered while a command writes it,
//! removed by a forked child once the interrupted process is gone.
//!
//! SIGINT, SIGTERM and SIGHUP are blocked in every thread at start (threads inherit the
//! mask; `std::process::Command` resets it for children) and taken by one thread with
//! `sigwait`, which runs ordinary code. Worker threads may still be writing into a
//! registered path, so removing it while they run can lose the race (a directory made
//! again after it was removed): the thread forks a one-thread child first, and the
//! process dies of the same signal at once (a shell sees an interrupted process, not a
//! failure); the child waits until the process is gone, then removes every registered
//! path and says so on stderr (a caller reading stderr to its end has waited for it). Registration and publishing share a lock, so a destination is either still
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
            let name = match sig {
                libc::SIGINT => "SIGINT",
                libc::SIGTERM => "SIGTERM",
                _ => "SIGHUP",
            };
            let paths = take_registered();
            // SAFETY: getpid/fork. The child runs this thread alone and uses only file
            // removal (glibc's allocator is fork-safe) and write(2), no lock another
            // thread may have held at the fork.
            let parent = unsafe { libc::getpid() };
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                while unsafe { libc::getppid() } == parent {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                report(name, &remove_all(&paths));
                unsafe { libc::_exit(0) };
            }
            if pid < 0 {
                // No child: remove from here, racing the workers as well as can be.
                report(name, &remove_all(&paths));
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

/// The registered paths; the lock stays held, so nothing is published after this.
fn take_registered() -> Vec<PathBuf> {
    let reg = REGISTERED.lock().unwrap_or_else(|e| e.into_inner());
    let paths = reg.iter().map(|(_, p)| p.clone()).collect();
    std::mem::forget(reg);
    paths
}

/// Removes `paths`, retrying a path some thread is still writing into.
fn remove_all(paths: &[PathBuf]) -> Vec<String> {
    let mut removed = Vec::new();
    for p in paths {
        for _ in 0..50 {
            if remove_path(p) {
                break;
            }
        }
        removed.push(p.display().to_string());
    }
    removed
}

/// One line on stderr through write(2): no lock of Rust's stderr, which a thread of the
/// parent may have held at the fork.
fn report(name: &str, removed: &[String]) {
    let line = if removed.is_empty() {
        format!("fo: interrupted ({name})\n")
    } else {
        format!(
            "fo: interrupted ({name}); removed the partial output {}\n",
            removed.join(", ")
        )
    };
    // SAFETY: a valid buffer of that length; a short or failed write only loses the note.
    unsafe { libc::write(2, line.as_ptr() as *const libc::c_void, line.len()) };
}

pub use fo::ckpt::remove_path;

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
