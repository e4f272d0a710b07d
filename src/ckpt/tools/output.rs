//! Output directories of the offline tools (convert, consolidate): DST appears whole or not
//! at all, and nothing the tool did not create is touched.
//!
//! - DST must not be SRC, lie inside SRC, or (when replacing, `force`) hold SRC.
//! - A non-empty DST is refused unless `force`; a file at DST is always refused.
//! - Everything is written into `.<name>.<verb>-<pid>` beside DST (`format/naming.rs`), then
//!   renamed onto it; a replaced DST is moved aside to `<stage>.old` first and removed only
//!   once the new one is in place. Missing parent directories are created and, on failure,
//!   removed.
//!
//! The CLI adds interrupt cleanup on top (`src/bin/cli/dst.rs`); [`Staged`] is the library's
//! own: dropped unpublished (an error, a panic), it removes everything it created.
use std::path::{Component, Path, PathBuf};

use crate::ckpt::format::naming::output_stage_name;
use crate::error::{Error, Result};

/// `p` made absolute and free of `.`/`..` and symlinks as far as it exists.
pub(crate) fn resolved(p: &Path) -> Result<PathBuf> {
    let abs = std::path::absolute(p).map_err(|e| Error::io(p, e))?;
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

pub(crate) fn non_empty(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some())
}

/// Where DST's staging directory goes: `(resolved parent, DST's name)`, once DST is checked
/// against SRC. The reason of a refusal is returned as text for the caller to wrap.
pub fn check_dst(src: &Path, dst: &Path) -> std::result::Result<(PathBuf, String), String> {
    let (s, d) = (
        resolved(src).map_err(|e| e.to_string())?,
        resolved(dst).map_err(|e| e.to_string())?,
    );
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
    Ok((d.parent().unwrap_or(Path::new("/")).to_path_buf(), name))
}

/// Refuses a DST that is a file, or a non-empty directory without `force` (named
/// `force_name` in the reason: `--force`, `force`).
pub fn check_dst_contents(
    dst: &Path,
    force: bool,
    force_name: &str,
) -> std::result::Result<(), String> {
    if dst.exists() && !dst.is_dir() {
        return Err(format!("{} exists and is not a directory", dst.display()));
    }
    if non_empty(dst) && !force {
        return Err(format!(
            "{} exists and is not empty ({force_name} replaces it)",
            dst.display()
        ));
    }
    Ok(())
}

/// The missing ancestors of `parent`, deepest first (the last is the topmost).
pub fn missing_ancestors(parent: &Path) -> Vec<PathBuf> {
    let mut missing = Vec::new();
    let mut a = parent;
    while !a.exists() {
        missing.push(a.to_path_buf());
        a = a.parent().unwrap_or(Path::new("/"));
    }
    missing
}

/// Moves the finished `stage` to `dst`; a non-empty `dst` is moved aside to `<stage>.old`
/// first (and back on failure). Returns the moved-aside copy to remove, if any.
pub fn swap_in(stage: &Path, dst: &Path) -> std::result::Result<Option<PathBuf>, String> {
    let name = stage.file_name().unwrap_or_default().to_string_lossy();
    let old = stage.with_file_name(format!("{name}.old"));
    let had = non_empty(dst);
    if had {
        std::fs::rename(dst, &old)
            .map_err(|e| format!("cannot move {} aside: {e}", dst.display()))?;
    }
    // An empty DST directory is replaced by rename(2) itself.
    std::fs::rename(stage, dst).map_err(|e| {
        if had {
            let _ = std::fs::rename(&old, dst);
        }
        format!(
            "cannot rename {} to {}: {e}",
            stage.display(),
            dst.display()
        )
    })?;
    Ok(had.then_some(old))
}

/// Removes a file or a directory tree; true when nothing is left at `p`.
pub fn remove_path(p: &Path) -> bool {
    match std::fs::symlink_metadata(p) {
        Err(_) => true,
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p).is_ok() || !p.exists(),
        Ok(_) => std::fs::remove_file(p).is_ok(),
    }
}

/// A staging directory for DST, removed (with every ancestor it created) on drop unless
/// published.
pub(crate) struct Staged {
    pub(crate) dir: PathBuf,
    dst: PathBuf,
    /// The topmost directory this stage created (the stage, or a missing ancestor of DST).
    created: Option<PathBuf>,
}

/// Checks DST against SRC and `force` and creates the staging directory beside it.
pub(crate) fn stage(src: &Path, dst: &Path, force: bool, verb: &str) -> Result<Staged> {
    let bad = |m: String| Error::invalid("dst", m);
    let (parent, name) = check_dst(src, dst).map_err(bad)?;
    check_dst_contents(dst, force, "force").map_err(bad)?;
    let missing = missing_ancestors(&parent);
    let dir = parent.join(output_stage_name(&name, verb, std::process::id()));
    if std::fs::symlink_metadata(&dir).is_ok() {
        // This process's name: another call writing DST right now, or what a dead process
        // with this pid left. Either way not ours to remove.
        return Err(Error::Busy(format!(
            "{} exists: another {verb} into {} is running in this process, or a killed one left it (remove it)",
            dir.display(),
            dst.display()
        )));
    }
    let mut staged = Staged {
        created: None,
        dir: dir.clone(),
        dst: dst.to_path_buf(),
    };
    // Created one by one from the top, so a failure removes exactly what this call created.
    for m in missing.iter().rev().chain([&dir]) {
        std::fs::create_dir(m).map_err(|e| Error::io(m, e))?;
        staged.created.get_or_insert_with(|| m.clone());
    }
    Ok(staged)
}

impl Staged {
    /// Moves the finished staging directory to DST; a replaced DST is removed only after
    /// the new one is in place.
    pub(crate) fn publish(mut self) -> Result<()> {
        let old = swap_in(&self.dir, &self.dst).map_err(|m| Error::invalid("dst", m))?;
        self.created = None;
        if let Some(old) = old {
            if !remove_path(&old) {
                return Err(Error::invalid(
                    "dst",
                    format!(
                        "wrote {}, but cannot remove the replaced copy {}",
                        self.dst.display(),
                        old.display()
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl Drop for Staged {
    /// Not published: remove everything this stage created.
    fn drop(&mut self) {
        if let Some(c) = self.created.take() {
            remove_path(&c);
        }
    }
}
