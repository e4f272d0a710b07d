//! The directory `fo bench ckpt` writes into: new, empty, or one an earlier run left with
//! --keep (marked); afterwards it removes only what it wrote, and the directory itself
//! only if it created it, so a user's files are never touched.
use std::path::{Path, PathBuf};

use super::cleanup;

/// Left in DIR while the benchmark owns it: a DIR holding it may be benchmarked into again
/// (a run with --keep left it); any other non-empty DIR is refused.
pub const MARKER: &str = ".fo-bench-ckpt";

/// Whether `name` (an entry of DIR) is something this benchmark writes: the checkpoint's
/// files, commit record, staging directories and temporaries, the plain file, the
/// compressed checkpoint, the marker.
fn is_bench_entry(name: &str) -> bool {
    use fo::ckpt::naming::{parse_part_file_name, parse_shard_file_name, COMMIT_FILE};
    parse_shard_file_name(name).is_some()
        || parse_part_file_name(name).is_some()
        || name == COMMIT_FILE
        || name.starts_with(".fo-stage-")
        || name.contains(".tmp-")
        || [MARKER, "plain.bin", "compressed", "sync", "async"].contains(&name)
}

/// The directory the benchmark writes into, and what it removes afterwards.
pub struct BenchDir {
    pub dir: PathBuf,
    /// The topmost directory this run created (everything under it is removed), if any.
    created: Option<PathBuf>,
}

impl BenchDir {
    /// A new directory, an empty one, or one a previous run left (`MARKER`); anything
    /// else is refused, so no file the benchmark did not write is ever touched.
    /// Also returns the guards that remove, on an interruption, what this run writes
    /// (registered before anything is created, so no window leaves a directory behind).
    pub fn open(
        dir: Option<&Path>,
        world: usize,
        seed: u64,
    ) -> Result<(BenchDir, Vec<cleanup::Guard>), String> {
        let dir = match dir {
            Some(d) => d.to_path_buf(),
            None => std::env::temp_dir().join(format!("fo-bench-ckpt-{}", std::process::id())),
        };
        if dir.exists() {
            if !dir.is_dir() {
                return Err(format!(
                    "--dir {}: exists and is not a directory",
                    dir.display()
                ));
            }
            let first = std::fs::read_dir(&dir)
                .map_err(|e| format!("--dir {}: {e}", dir.display()))?
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .next();
            if let Some(f) = first.filter(|_| !dir.join(MARKER).exists()) {
                return Err(format!(
                    "--dir {}: not empty (it holds {f:?}, not written by fo bench ckpt); give a new or empty directory",
                    dir.display()
                ));
            }
        }
        let mut top = None;
        let mut a = dir.as_path();
        while !a.as_os_str().is_empty() && !a.exists() {
            top = Some(a.to_path_buf());
            a = a.parent().unwrap_or(Path::new(""));
        }
        let b = BenchDir { dir, created: top };
        let guards = b.register(world, seed);
        let made = std::fs::create_dir_all(&b.dir)
            .map_err(|e| format!("--dir {}: cannot create it: {e}", b.dir.display()))
            .and_then(|_| {
                std::fs::write(b.dir.join(MARKER), b"written by fo bench ckpt\n")
                    .map_err(|e| format!("--dir {}: {e}", b.dir.display()))
            });
        if let Err(e) = made {
            if let Some(top) = &b.created {
                cleanup::remove_path(top);
            } else {
                cleanup::remove_path(&b.dir.join(MARKER));
            }
            return Err(e);
        }
        Ok((b, guards))
    }

    /// What an interruption removes: the created directory, else the entries of DIR this
    /// run writes.
    fn register(&self, world: usize, seed: u64) -> Vec<cleanup::Guard> {
        if let Some(top) = &self.created {
            return vec![cleanup::register(top)];
        }
        let mut paths: Vec<PathBuf> = [
            MARKER,
            "plain.bin",
            "compressed",
            "sync",
            "async",
            fo::ckpt::naming::COMMIT_FILE,
        ]
        .iter()
        .map(|n| self.dir.join(n))
        .collect();
        paths.extend((0..world).map(|r| self.dir.join(fo::ckpt::naming::shard_file_name(r))));
        paths.push(fo::ckpt::stage_dir(&self.dir, &format!("bench-{seed}")));
        paths.iter().map(|p| cleanup::register(p)).collect()
    }

    /// Removes what the benchmark wrote, and DIR itself if this run created it.
    pub fn remove(&self) -> Result<(), String> {
        if let Some(top) = &self.created {
            return std::fs::remove_dir_all(top)
                .map_err(|e| format!("cannot remove {}: {e}", top.display()));
        }
        for e in std::fs::read_dir(&self.dir)
            .map_err(|e| format!("{}: {e}", self.dir.display()))?
            .filter_map(|e| e.ok())
        {
            if is_bench_entry(&e.file_name().to_string_lossy()) && !cleanup::remove_path(&e.path())
            {
                return Err(format!("cannot remove {}", e.path().display()));
            }
        }
        Ok(())
    }
}
