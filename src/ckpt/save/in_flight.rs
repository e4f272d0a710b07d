//! The async saves of this process still in flight, per directory, so that a save never
//! races an earlier save's commit (issue 38): two commits into one directory at once can
//! leave a commit record naming one save over the other's files, or the older save
//! visible after the newer one reported OK.
//!
//! Before an async save writes anything it takes a ticket for its directory (canonical
//! path) here, and every earlier save that would commit into the same directory, or that
//! is the same optimizer's previous save, must be out of the way first:
//! - a save without a communicator commits in its writer thread: the new save waits for
//!   that writer to finish (its commit included), so commits land in call order;
//! - a save with a communicator commits at its `wait`, on the caller's thread, in a
//!   collective no other save can run for it: until that wait has begun, the new save is
//!   refused (`Error::Busy`, naming the save in flight), never queued behind a wait that
//!   only the caller can make.
//!
//! Ranks of one save in one process (an in-process group: same save id, same world size,
//! different ranks) share the directory by design and do not wait for each other. Saves
//! from other processes are not seen here: one directory, one saving process group.
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};

use super::snapshot::Snapshot;
use crate::error::{Error, Result};
use crate::sync::lock;

/// Where a save stands, as far as a later save into its directory is concerned.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Phase {
    /// No communicator: the writer is at work and commits when it is done.
    Writing,
    /// A communicator: the commit collective runs at `wait`, which has not begun.
    CommitPending,
    /// A communicator: `wait` is running the commit collective.
    Committing,
    /// Committed, failed or abandoned: nothing of it will touch the directory again.
    Settled,
}

/// One save's entry in the registry.
pub(crate) struct Ticket {
    dir: PathBuf,
    save_id: String,
    rank: usize,
    world_size: usize,
    /// The save's snapshot (set once it exists): identifies the optimizer's last save.
    snap: OnceLock<Weak<Snapshot>>,
    phase: Mutex<Phase>,
    cv: Condvar,
}

static IN_FLIGHT: Mutex<Vec<Arc<Ticket>>> = Mutex::new(Vec::new());

impl Ticket {
    fn phase(&self) -> Phase {
        *lock(&self.phase)
    }

    pub(crate) fn set_phase(&self, p: Phase) {
        *lock(&self.phase) = p;
        self.cv.notify_all();
        if p == Phase::Settled {
            lock(&IN_FLIGHT).retain(|t| !std::ptr::eq(&**t, self));
        }
    }

    /// Nothing of this save will touch its directory again.
    pub(crate) fn settle(&self) {
        self.set_phase(Phase::Settled)
    }

    /// Records the save's snapshot (which the optimizer keeps as its last save).
    pub(crate) fn attach(&self, snap: &Arc<Snapshot>) {
        let _ = self.snap.set(Arc::downgrade(snap));
    }

    fn is_of(&self, snap: &Arc<Snapshot>) -> bool {
        self.snap
            .get()
            .is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(snap)))
    }

    fn wait_settled(&self) {
        let mut g = lock(&self.phase);
        while *g != Phase::Settled {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn busy(&self, whose: &str) -> Error {
        Error::Busy(format!(
            "save {:?} into {} ({whose}) is in flight and commits at its fo_save_wait, \
             through its communicator: wait for it (on every rank) before starting another \
             save {}",
            self.save_id,
            self.dir.display(),
            if whose == "this optimizer's last save" {
                "of this optimizer"
            } else {
                "into this directory"
            }
        ))
    }
}

/// A save's ticket: settled when dropped (a save that failed to start, or is dropped).
pub(crate) struct Registration(pub(crate) Arc<Ticket>);

impl Drop for Registration {
    fn drop(&mut self) {
        self.0.settle();
    }
}

/// `dir` made absolute with symbolic links resolved, for as much of it as exists (the
/// first save creates the directory), so two spellings of one directory are one key.
pub(crate) fn canonical(dir: &Path) -> PathBuf {
    let abs = match std::env::current_dir() {
        Ok(cwd) if dir.is_relative() => cwd.join(dir),
        _ => dir.to_path_buf(),
    };
    let mut tail = Vec::new();
    let mut cur = abs.as_path();
    loop {
        if let Ok(mut c) = std::fs::canonicalize(cur) {
            c.extend(tail.iter().rev());
            return c;
        }
        match (cur.parent(), cur.file_name()) {
            (Some(p), Some(n)) => {
                tail.push(n.to_owned());
                cur = p;
            }
            _ => return abs,
        }
    }
}

/// Takes a ticket for save `save_id` (this rank `rank` of `world_size`) into `dir`, once
/// `last` (the optimizer's previous save, if any) and every other save of the process
/// that commits into `dir` are out of the way (see the module doc): waits for those
/// that commit on their own, and fails with `Error::Busy` on one whose commit waits for
/// its caller's `wait`. `with_comm`: this save commits at its own `wait`.
pub(crate) fn enter(
    last: Option<&Arc<Snapshot>>,
    dir: &Path,
    save_id: &str,
    rank: usize,
    world_size: usize,
    with_comm: bool,
) -> Result<Registration> {
    let dir = canonical(dir);
    loop {
        let mut reg = lock(&IN_FLIGHT);
        let mut blocker = None;
        for t in reg.iter() {
            let own = last.is_some_and(|s| t.is_of(s));
            let same_save = t.save_id == save_id && t.world_size == world_size && t.rank != rank;
            if !(own || t.dir == dir && !same_save) {
                continue;
            }
            let whose = if own {
                "this optimizer's last save"
            } else {
                "another save of this process"
            };
            match t.phase() {
                Phase::Settled => continue,
                Phase::CommitPending => return Err(t.busy(whose)),
                Phase::Writing | Phase::Committing => blocker = Some(t.clone()),
            }
        }
        match blocker {
            Some(t) => {
                drop(reg);
                t.wait_settled();
            }
            None => {
                let t = Arc::new(Ticket {
                    dir,
                    save_id: save_id.to_string(),
                    rank,
                    world_size,
                    snap: OnceLock::new(),
                    phase: Mutex::new(if with_comm {
                        Phase::CommitPending
                    } else {
                        Phase::Writing
                    }),
                    cv: Condvar::new(),
                });
                reg.push(t.clone());
                return Ok(Registration(t));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_resolves_the_existing_part_and_keeps_the_rest() {
        let base = std::env::temp_dir().join(format!("fo-canon-{}", std::process::id()));
        std::fs::create_dir_all(base.join("a")).unwrap();
        let real = canonical(&base.join("a"));
        assert_eq!(
            canonical(&base.join("a").join(".").join("b")),
            real.join("b")
        );
        assert_eq!(canonical(&base.join("a/../a/b/c")), real.join("b/c"));
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_pending_commit_in_the_dir_is_busy_and_a_writing_save_is_waited_for() {
        let dir = std::env::temp_dir().join(format!("fo-inflight-{}", std::process::id()));
        let a = enter(None, &dir, "a", 0, 1, true).unwrap();
        let e = enter(None, &dir, "b", 0, 1, false).err().unwrap();
        assert!(
            matches!(e, Error::Busy(ref m) if m.contains("\"a\"")),
            "{e}"
        );
        // Another rank of the same save shares the directory.
        let a1 = enter(None, &dir, "a", 1, 2, true);
        assert!(a1.is_err(), "a different world size is another save");
        a.0.set_phase(Phase::Committing);
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(100));
            drop(a);
        });
        let t0 = std::time::Instant::now();
        let b = enter(None, &dir, "b", 0, 1, false).unwrap();
        assert!(t0.elapsed() >= std::time::Duration::from_millis(90));
        t.join().unwrap();
        drop(b);
        assert!(lock(&IN_FLIGHT).iter().all(|t| t.dir != canonical(&dir)));
    }
}
