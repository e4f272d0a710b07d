//! All-or-nothing saves across ranks: the staging directory, the done markers, the commit
//! record, and which files make up a checkpoint (committed ones, or a legacy directory's).
//!
//! Every rank writes its file for save `S` into the staging directory
//! `DIR/.fo-stage-<hash of S>/`, then a done marker `done-<rank>.json` naming `S`, the
//! world size and the file's header digest. Whichever rank finds all `world_size` markers
//! of `S` present after writing its own (the last to finish; two finishing together both
//! write the same record) writes `DIR/fo-commit.json` atomically: that rename is the
//! commit. It then moves the staged files over the visible ones, removes shard files of
//! ranks beyond the world size and other saves' staging directories.
//!
//! A reader that finds `fo-commit.json` reads, for each rank, the file (visible or still
//! staged) whose digest the record names, so a kill at any point leaves either the
//! previous or the new checkpoint readable, never a mix. Markers are per save id, so
//! ranks of two different saves can never complete one commit.
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::ckpt::format::checksum::xxh64;
use crate::ckpt::format::header::{read_header, DIGEST_KEY};
use crate::ckpt::format::naming::{
    parse_part_file_name, parse_shard_file_name, part_file_name, shard_file_name, tmp_prefix,
    COMMIT_FILE, COMMIT_STAGE_PREFIX as STAGE_PREFIX,
};
use crate::error::{Error, Result};

/// Most ranks one checkpoint may have (`FO_MAX_WORLD_SIZE`): a commit record and the
/// per-rank tables scale with it, so a nonsense world size is refused, not allocated.
pub(crate) const MAX_WORLD_SIZE: usize = 1 << 20;

/// `world_size` is 1..=MAX_WORLD_SIZE.
pub(crate) fn check_world_size(world_size: usize) -> Result<()> {
    if world_size == 0 || world_size > MAX_WORLD_SIZE {
        return Err(Error::invalid(
            "world_size",
            format!("{world_size} is outside 1..={MAX_WORLD_SIZE}"),
        ));
    }
    Ok(())
}

/// `fo-commit.json`: which save is the checkpoint, and each rank file's header digest.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Commit {
    pub save_id: String,
    pub world_size: usize,
    pub digests: Vec<String>,
    /// How many files each rank wrote (its rank file and extra parts); empty: one each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<usize>,
}

impl Commit {
    /// How many files rank `r` wrote.
    pub fn parts_of(&self, r: usize) -> usize {
        self.parts.get(r).copied().unwrap_or(1)
    }
}

/// `done-<rank>.json` in a staging directory.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Done {
    save_id: String,
    rank: usize,
    world_size: usize,
    digest: String,
    #[serde(default = "one")]
    parts: usize,
}

fn one() -> usize {
    1
}

/// The staging directory of save `save_id` (hashed: ids may hold any characters).
pub fn stage_dir(dir: &Path, save_id: &str) -> PathBuf {
    dir.join(format!("{STAGE_PREFIX}{:016x}", xxh64(save_id.as_bytes())))
}

pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}

/// Writes `bytes` to `path` through a temporary file, fsync and rename (the rename is
/// atomic, so a reader sees the old content or the new, never a part).
pub(crate) fn write_file_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_then_rename(path, bytes, || Ok(()))?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Writes `bytes` to a temporary file beside `path`, fsyncs it, runs `before_rename` and
/// renames it to `path`; on any error before the rename the temporary file is removed
/// and nothing is visible. The directory is not synced: the callers do it.
fn write_then_rename(
    path: &Path,
    bytes: &[u8],
    before_rename: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    let tmp = dir.join(format!(
        "{}{}-{:?}",
        tmp_prefix(name),
        std::process::id(),
        std::thread::current().id()
    ));
    let res = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        before_rename().map_err(|e| std::io::Error::other(e.to_string()))?;
        std::fs::rename(&tmp, path)
    })();
    res.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

/// The commit record of `dir`, if it has one.
pub fn read_commit(dir: &Path) -> Result<Option<Commit>> {
    let path = dir.join(COMMIT_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(&path, e)),
    };
    let c: Commit = serde_json::from_slice(&bytes)
        .map_err(|e| Error::corrupt(&path, format!("commit record is not valid: {e}")))?;
    if c.world_size == 0 || c.digests.len() != c.world_size {
        return Err(Error::corrupt(
            &path,
            format!(
                "commit record names {} digests for a world of {}",
                c.digests.len(),
                c.world_size
            ),
        ));
    }
    if !(c.parts.is_empty() || c.parts.len() == c.world_size && c.parts.iter().all(|&n| n >= 1)) {
        return Err(Error::corrupt(
            &path,
            format!(
                "commit record names files per rank {:?} for a world of {}",
                c.parts, c.world_size
            ),
        ));
    }
    Ok(Some(c))
}

/// Records that `rank` of save `save_id` has its file staged, and commits the save if
/// every rank has. Returns whether this call committed.
pub(crate) fn finish_rank(
    dir: &Path,
    save_id: &str,
    rank: usize,
    world_size: usize,
    digest: &str,
    parts: usize,
) -> Result<bool> {
    mark_done(dir, save_id, rank, world_size, digest, parts)?;
    try_commit(dir, save_id, world_size)
}

/// Removes `rank`'s done marker of save `save_id` left by an interrupted earlier attempt
/// of the same save, so that it cannot be committed with this attempt's files.
pub(crate) fn clear_marker(dir: &Path, save_id: &str, rank: usize) -> Result<()> {
    let p = stage_dir(dir, save_id).join(format!("done-{rank}.json"));
    ignore_missing(std::fs::remove_file(&p), &p)
}

/// Writes `rank`'s done marker for save `save_id` (no commit attempt): the header digest
/// of its rank file and how many files (parts) it staged.
pub(crate) fn mark_done(
    dir: &Path,
    save_id: &str,
    rank: usize,
    world_size: usize,
    digest: &str,
    parts: usize,
) -> Result<()> {
    let stage = stage_dir(dir, save_id);
    let done = Done {
        save_id: save_id.to_string(),
        rank,
        world_size,
        digest: digest.to_string(),
        parts,
    };
    write_file_atomic(
        &stage.join(format!("done-{rank}.json")),
        serde_json::to_string(&done).unwrap().as_bytes(),
    )
}

/// Commits save `save_id` if all of its `world_size` done markers are present.
///
/// The commit point is one rename: the record is written to a temporary file and fsynced
/// first, and any failure up to and including the rename leaves the previous checkpoint
/// the visible one (an error). After the rename the new checkpoint *is* the visible one,
/// so what follows (fsync of the directory, moving staged files, removing stale ones) is
/// tidying: its failure is not a failed commit. It is reported on stderr, naming the
/// directory, and readers still find every committed file (visible or staged).
pub(crate) fn try_commit(dir: &Path, save_id: &str, world_size: usize) -> Result<bool> {
    check_world_size(world_size)?;
    let stage = stage_dir(dir, save_id);
    let mut digests: Vec<String> = Vec::new();
    let mut parts: Vec<usize> = Vec::new();
    if digests.try_reserve_exact(world_size).is_err()
        || parts.try_reserve_exact(world_size).is_err()
    {
        return Err(Error::invalid(
            "world_size",
            format!("cannot allocate the commit record of {world_size} ranks"),
        ));
    }
    for r in 0..world_size {
        let Ok(bytes) = std::fs::read(stage.join(format!("done-{r}.json"))) else {
            return Ok(false);
        };
        match serde_json::from_slice::<Done>(&bytes) {
            Ok(d) if d.save_id == save_id && d.world_size == world_size && d.rank == r && d.parts >= 1 => {
                digests.push(d.digest);
                parts.push(d.parts);
            }
            Ok(d) => {
                return Err(Error::invalid(
                    "save_id",
                    format!(
                        "rank {r} of save {save_id:?} in {} was saved with world size {} (this rank: {world_size})",
                        dir.display(),
                        d.world_size
                    ),
                ))
            }
            Err(_) => return Ok(false),
        }
    }
    if parts.iter().all(|&n| n == 1) {
        parts.clear();
    }
    let commit = Commit {
        save_id: save_id.to_string(),
        world_size,
        digests,
        parts,
    };
    publish_commit(dir, &commit)?;
    if let Err(e) = fault(Step::AfterRename).and_then(|_| {
        sync_dir(dir)?;
        roll_forward(dir, &commit)
    }) {
        eprintln!(
            "fo: checkpoint {} is committed (save {:?}), but tidying after the commit failed: {e}; \
             readers use the committed files",
            dir.display(),
            commit.save_id
        );
    }
    Ok(true)
}

/// Writes the commit record: temporary file, fsync, rename. The rename is the commit;
/// on any error before it the temporary file is removed and nothing is visible.
fn publish_commit(dir: &Path, commit: &Commit) -> Result<()> {
    let json = serde_json::to_string_pretty(commit).unwrap();
    write_then_rename(&dir.join(COMMIT_FILE), json.as_bytes(), || {
        fault(Step::BeforeRename)
    })
}

/// Where a test may make the commit fail (root ignores permissions, so a directory that
/// cannot be listed is simulated here).
#[derive(Clone, Copy, PartialEq, Debug)]
enum Step {
    BeforeRename,
    AfterRename,
}

/// A rank's shard file is missing from checkpoint `dir`.
pub(crate) fn missing(dir: &Path, rank: usize, why: String) -> Error {
    Error::NotFound(format!(
        "checkpoint {}: shard file {} is missing ({why})",
        dir.display(),
        shard_file_name(rank)
    ))
}

/// The shard files of a directory without a commit record (fo 0.1.0's or torch's): every
/// `shard-*` file, ranks 0..n with none missing.
pub(crate) fn legacy_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let rd = std::fs::read_dir(dir).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::NotFound(format!(
            "checkpoint directory {} does not exist",
            dir.display()
        )),
        _ => Error::io(dir, e),
    })?;
    let mut ranks = Vec::new();
    for e in rd {
        let name = e.map_err(|e| Error::io(dir, e))?.file_name();
        if let Some(r) = name.to_str().and_then(parse_shard_file_name) {
            ranks.push(r);
        }
    }
    ranks.sort_unstable();
    if ranks.is_empty() {
        return Err(Error::NotFound(format!(
            "no shard-*-model-00001-of-00001.safetensors files in {}",
            dir.display()
        )));
    }
    for (i, &r) in ranks.iter().enumerate() {
        if r != i {
            return Err(missing(
                dir,
                i,
                format!("{} exists", shard_file_name(*ranks.last().unwrap())),
            ));
        }
    }
    Ok(ranks
        .iter()
        .map(|&r| dir.join(shard_file_name(r)))
        .collect())
}

#[cfg(test)]
thread_local! {
    static FAULT: std::cell::Cell<Option<Step>> = const { std::cell::Cell::new(None) };
}

fn fault(_at: Step) -> Result<()> {
    #[cfg(test)]
    if FAULT.with(|f| f.get()) == Some(_at) {
        return Err(Error::io(
            "injected",
            std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        ));
    }
    Ok(())
}

fn ignore_missing(r: std::io::Result<()>, path: &Path) -> Result<()> {
    match r {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io(path, e)),
        _ => Ok(()),
    }
}

/// After a commit: staged files replace the visible ones, shard files of ranks beyond the
/// world size and every other staging directory go. Safe to repeat or to race with another
/// rank doing the same (every step tolerates a file already moved or removed).
fn roll_forward(dir: &Path, commit: &Commit) -> Result<()> {
    let stage = stage_dir(dir, &commit.save_id);
    for r in 0..commit.world_size {
        let n = commit.parts_of(r);
        for j in (0..n).rev() {
            let from = stage.join(part_file_name(r, j, n));
            ignore_missing(
                std::fs::rename(&from, dir.join(part_file_name(r, j, n))),
                &from,
            )?;
        }
    }
    for e in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let p = e.map_err(|e| Error::io(dir, e))?.path();
        let Some(name) = p.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        // Parts of ranks beyond the world or of a rank that now writes another number of
        // parts are an older save's: torch's reader would read every one.
        let stale_part = parse_part_file_name(name)
            .is_some_and(|(r, _, n)| r >= commit.world_size || n != commit.parts_of(r));
        if stale_part || parse_shard_file_name(name).is_some_and(|r| r >= commit.world_size) {
            ignore_missing(std::fs::remove_file(&p), &p)?;
        } else if name.starts_with(STAGE_PREFIX) {
            ignore_missing(std::fs::remove_dir_all(&p), &p)?;
        }
    }
    sync_dir(dir)
}

/// The file named `name` of committed save `save_id` whose header digest is `want`: the
/// visible one, else the staged one, else the visible one if it exists (so that opening
/// it reports what is wrong with it); None when neither exists.
pub(crate) fn committed_file(dir: &Path, save_id: &str, name: &str, want: &str) -> Option<PathBuf> {
    let visible = dir.join(name);
    let staged = stage_dir(dir, save_id).join(name);
    if stated_digest(&visible).as_deref() == Some(want) {
        return Some(visible);
    }
    if stated_digest(&staged).as_deref() == Some(want) {
        return Some(staged);
    }
    visible.exists().then_some(visible)
}

/// The header digest a rank file states (None: none, or not readable).
fn stated_digest(path: &Path) -> Option<String> {
    let f = File::open(path).ok()?;
    read_header(path, &f).ok()?.metadata.remove(DIGEST_KEY)
}

/// The file of each rank of the committed save: the visible one if its digest is the
/// committed one, else the one still staged (a commit interrupted while moving files).
/// When neither states the committed digest, the visible file is returned if it exists,
/// so that opening it reports what is wrong with it (truncated, edited, another save).
pub fn committed_files(dir: &Path, commit: &Commit) -> Result<Vec<PathBuf>> {
    (0..commit.world_size)
        .map(|r| {
            if let Some(p) = committed_file(
                dir,
                &commit.save_id,
                &shard_file_name(r),
                &commit.digests[r],
            ) {
                return Ok(p);
            }
            Err(Error::NotFound(format!(
                "checkpoint {}: shard file {} is missing (committed save {:?} of {} ranks)",
                dir.display(),
                shard_file_name(r),
                commit.save_id,
                commit.world_size
            )))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn staged(dir: &Path, id: &str) {
        let stage = stage_dir(dir, id);
        std::fs::create_dir_all(&stage).unwrap();
        mark_done(dir, id, 0, 1, "d", 1).unwrap();
    }

    /// Commits "old" cleanly, then tries to commit "new" over it with `step` failing.
    fn commit_new_over_old_failing_at(dir: &Path, step: Step) -> Result<bool> {
        staged(dir, "old");
        assert!(try_commit(dir, "old", 1).unwrap());
        staged(dir, "new");
        FAULT.with(|f| f.set(Some(step)));
        let r = try_commit(dir, "new", 1);
        FAULT.with(|f| f.set(None));
        r
    }

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("fo-commit-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_failure_before_the_rename_leaves_the_previous_commit_visible() {
        let dir = tmpdir("before");
        let e = commit_new_over_old_failing_at(&dir, Step::BeforeRename).unwrap_err();
        assert!(matches!(e, Error::Io { .. }), "{e}");
        assert_eq!(read_commit(&dir).unwrap().unwrap().save_id, "old");
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.contains(crate::ckpt::naming::TMP_MARKER))
            .collect();
        assert!(left.is_empty(), "temporary record left: {left:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failure_after_the_rename_is_not_reported_as_a_failed_commit() {
        let dir = tmpdir("after");
        // As with a directory that can be written but not listed (chmod 300): the record
        // is renamed into place, then fsync and listing the directory fail.
        let r = commit_new_over_old_failing_at(&dir, Step::AfterRename);
        assert!(r.unwrap(), "the commit happened, so it must say so");
        assert_eq!(read_commit(&dir).unwrap().unwrap().save_id, "new");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_nonsense_world_size_is_refused_before_anything_is_allocated() {
        let dir = tmpdir("world");
        let e = try_commit(&dir, "s", i32::MAX as usize - 1).unwrap_err();
        assert!(e.to_string().contains("world_size"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
