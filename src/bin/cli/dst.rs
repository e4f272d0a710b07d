//! Output directories of `fo ckpt convert` and `fo ckpt consolidate`: the library's rules
//! (`fo::ckpt::output`: DST appears whole or not at all, SRC is never touched) plus what
//! only a process can do:
//! - An interrupted run removes its staging directory (`cleanup.rs`); one killed outright
//!   leaves it behind under its pid, and the next run for the same DST removes staging
//!   directories of processes that no longer exist (restoring a DST that was moved aside
//!   and never replaced).
use std::path::{Path, PathBuf};

use fo::ckpt::naming::{output_stage_name, parse_output_stage_name};
use fo::ckpt::{check_dst, check_dst_contents, missing_ancestors, swap_in};

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
            let Some((pid, old)) = parse_output_stage_name(f, name, verb) else {
                continue;
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
    let (parent, name) = check_dst(src, dst)?;
    // First, so a DST an earlier killed run moved aside is back before DST is judged.
    clean_stale(&parent, &name, &parent.join(&name));
    check_dst_contents(dst, force, "--force")?;
    // Missing ancestors are created one by one, so the topmost one is known and a
    // failure removes exactly what this run created.
    let missing = missing_ancestors(&parent);
    let stage = parent.join(output_stage_name(&name, verb, std::process::id()));
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
        let guard = self.guard.take().expect("published once");
        let moved = guard.publish(|| swap_in(&self.dir, &self.dst));
        let old = match moved {
            Err(e) => {
                cleanup::remove_path(&self.created);
                self.created = PathBuf::new();
                return Err(e);
            }
            Ok(old) => old,
        };
        self.created = PathBuf::new();
        if let Some(old) = old.filter(|o| !cleanup::remove_path(o)) {
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
