//! Output directories of `fo ckpt convert` and `fo ckpt consolidate`: DST appears whole or
//! not at all, and nothing fo did not create is touched.
//!
//! - DST must not be SRC, lie inside SRC, or (with `--force`, which replaces it) hold SRC.
//! - A non-empty DST is refused unless `--force`; a file at DST is always refused.
//! - Everything is written into `.<name>.<verb>-<pid>` beside DST, then renamed onto it;
//!   a replaced DST is moved aside to `.<name>.<verb>-<pid>.old` first and removed only
//!   once the new one is in place. Missing parent directories are created and, on
//!   failure, removed again.
//! - An interrupted run removes its staging directory (`cleanup.rs`); one killed outright
//!   leaves it behind under its pid, and the next run for the same DST removes staging
//!   directories of processes that no longer exist (restoring a DST that was moved aside
//!   and never replaced).
use std::path::{Component, Path, PathBuf};

use super::cleanup::{self, Guard};

/// A staging directory for DST, removed on drop unless published.
pub struct Staged {
    pub dir: PathBuf,
    dst: PathBuf,
    /// The topmost directory this run created (the stage, or a missing ancestor of DST).
    created: PathBuf,
    guard: Option<Guard>,
}

const VERBS: [&str; 2] = ["convert", "consolidate"];

/// `p` made absolute and free of `.`/`..` and symlinks as far as it exists.
fn resolved(p: &Path) -> Result<PathBuf, String> {
    let abs = std::path::absolute(p).map_err(|e| format!("{}: {e}", p.display()))?;
    let mut existing = abs.clone();
    let mut rest = Vec::new();
    while !existing.exists() {
        match (existing.file_name(), existing.parent()) {
            (Some(n), Some(parent)) => {
                rest.push(n.to_os_string());
                existing = parent.to_path_buf();
            }
            _ => break,
        }
    }
    let mut out = existing.canonicalize().unwrap_or(existing);
    for n in rest.into_iter().rev() {
        if n == ".." {
            out.pop();
        } else if Path::new(&n).components().next() != Some(Component::CurDir) {
            out.push(n);
        }
    }
    Ok(out)
}

fn non_empty(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some())
}

fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    pid > 0
        && (unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

/// Removes staging directories for `dst` left by processes that no longer exist.
fn clean_stale(parent: &Path, name: &str, dst: &Path) {
    let Ok(rd) = std::fs::read_dir(parent) else {
        return;
    };
    for e in rd.filter_map(|e| e.ok()) {
        let f = e.file_name();
        let Some(f) = f.to_str() else { continue };
        for verb in VERBS {
            let Some(rest) = f.strip_prefix(&format!(".{name}.{verb}-")) else {
                continue;
            };
            let (pid, old) = match rest.strip_suffix(".old") {
                Some(p) => (p, true),
                None => (rest, false),
            };
            let Ok(pid) = pid.parse::<i32>() else {
                continue;
            };
            if pid_alive(pid) {
                continue;
            }
            let p = e.path();
            if old && !dst.exists() && std::fs::rename(&p, dst).is_ok() {
                eprintln!(
                    "note: restored {} from {} (an earlier run was killed while replacing it)",
                    dst.display(),
                    p.display()
                );
                continue;
            }
            if cleanup::remove_path(&p) {
                eprintln!(
                    "note: removed {} (left by an earlier run, process {pid}, that was killed)",
                    p.display()
                );
            }
        }
    }
}

/// Checks DST against SRC and `force`, and creates the staging directory beside DST.
pub fn prepare(src: &Path, dst: &Path, force: bool, verb: &'static str) -> Result<Staged, String> {
    let (s, d) = (resolved(src)?, resolved(dst)?);
    if s == d {
        return Err(format!(
            "{} is the source checkpoint: give another output directory",
            dst.display()
        ));
    }
    if d.starts_with(&s) {
        return Err(format!(
            "{} lies inside the source checkpoint {}: give a directory outside it",
            dst.display(),
            src.display()
        ));
    }
    if s.starts_with(&d) {
        return Err(format!(
            "{} holds the source checkpoint {}: writing it would replace the source",
            dst.display(),
            src.display()
        ));
    }
    let name = d
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| format!("{}: no directory name", dst.display()))?
        .to_string();
    let parent = d.parent().unwrap_or(Path::new("/")).to_path_buf();
    // First, so a DST an earlier killed run moved aside is back before DST is judged.
    clean_stale(&parent, &name, &d);
    if dst.exists() && !dst.is_dir() {
        return Err(format!("{} exists and is not a directory", dst.display()));
    }
    if non_empty(dst) && !force {
        return Err(format!(
            "{} exists and is not empty (--force replaces it)",
            dst.display()
        ));
    }
    // Missing ancestors are created one by one, so the topmost one is known and a
    // failure removes exactly what this run created.
    let mut missing = Vec::new();
    let mut a = parent.as_path();
    while !a.exists() {
        missing.push(a.to_path_buf());
        a = a.parent().unwrap_or(Path::new("/"));
    }
    let stage = parent.join(format!(".{name}.{verb}-{}", std::process::id()));
    let created = missing.last().cloned().unwrap_or_else(|| stage.clone());
    let guard = cleanup::register(&created);
    for (i, m) in missing.iter().rev().enumerate() {
        if let Err(e) = std::fs::create_dir(m) {
            if i > 0 {
                cleanup::remove_path(&created);
            }
            return Err(format!("cannot create {}: {e}", m.display()));
        }
    }
    // A staging directory with this pid can only be a dead process's (pids are reused).
    cleanup::remove_path(&stage);
    if let Err(e) = std::fs::create_dir(&stage) {
        if !missing.is_empty() {
            cleanup::remove_path(&created);
        }
        return Err(format!("cannot create {}: {e}", stage.display()));
    }
    Ok(Staged {
        dir: stage,
        dst: dst.to_path_buf(),
        created,
        guard: Some(guard),
    })
}

impl Staged {
    /// Moves the finished staging directory to DST; a replaced DST is removed only after
    /// the new one is in place.
    pub fn publish(mut self) -> Result<(), String> {
        let name = self.dir.file_name().unwrap().to_string_lossy().into_owned();
        let old = self.dir.with_file_name(format!("{name}.old"));
        let (stage, dst) = (self.dir.clone(), self.dst.clone());
        let guard = self.guard.take().expect("published once");
        let had = non_empty(&dst);
        let moved = guard.publish(|| -> Result<(), String> {
            if had {
                std::fs::rename(&dst, &old)
                    .map_err(|e| format!("cannot move {} aside: {e}", dst.display()))?;
            }
            // An empty DST directory is replaced by rename(2) itself.
            std::fs::rename(&stage, &dst).map_err(|e| {
                if had {
                    let _ = std::fs::rename(&old, &dst);
                }
                format!(
                    "cannot rename {} to {}: {e}",
                    stage.display(),
                    dst.display()
                )
            })
        });
        if let Err(e) = moved {
            cleanup::remove_path(&self.created);
            self.created = PathBuf::new();
            return Err(e);
        }
        self.created = PathBuf::new();
        if had && !cleanup::remove_path(&old) {
            return Err(format!(
                "wrote {}, but cannot remove the replaced copy {}",
                self.dst.display(),
                old.display()
            ));
        }
        Ok(())
    }
}

impl Drop for Staged {
    /// Not published: remove everything this run created.
    fn drop(&mut self) {
        if !self.created.as_os_str().is_empty() {
            cleanup::remove_path(&self.created);
        }
    }
}
