//! Atomic, streaming writes of rank files.
//!
//! Each file is written to a temporary name in the target directory, header first with
//! placeholder checksums of the final length, then tensor by tensor (only one entry's
//! data is held at a time), then the real header is written over the placeholder, the
//! file is fsynced, renamed over its final name, and the directory fsynced. A kill or an
//! error before the rename leaves the previous file untouched. A save of several
//! in-process ranks stages every file before renaming any, so a kill during the long
//! data phase leaves the whole previous checkpoint loadable; the renames themselves take
//! microseconds, and a directory that still ends up mixing two saves is refused on load
//! (the files' `save_id`s differ).
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::checksum::{block_hex, num_blocks, BLOCK_BYTES};
use super::format::{
    encode_header, parse_shard_file_name, shard_file_name, sharding_info, FoMeta, FoTensor, TensorEntry, FORMAT_VERSION,
};
use super::pack::{chunk_bytes, EntryMeta, PackOptions, Packed, Plan};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// A fully written, fsynced temporary file waiting for its rename.
#[derive(Debug)]
pub struct Staged {
    tmp: PathBuf,
    dest: PathBuf,
}

impl Drop for Staged {
    /// An uncommitted stage (an error in another rank) removes its temporary file.
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.tmp);
    }
}

fn metadata(plan: &Plan, opts: &PackOptions, sums: &[String]) -> BTreeMap<String, String> {
    let offsets: Vec<(String, Vec<usize>)> = plan
        .chunks
        .iter()
        .map(|c| (c.name.clone(), c.global_offset.clone()))
        .collect();
    let tensors = plan
        .chunks
        .iter()
        .zip(sums)
        .map(|(c, s)| {
            let t = FoTensor {
                key: c.key.clone(),
                global_shape: c.global_shape.clone(),
                global_offset: c.global_offset.clone(),
                xxh64: s.clone(),
            };
            (c.name.clone(), t)
        })
        .collect();
    let fo = FoMeta {
        fo_version: crate::VERSION.to_string(),
        format_version: FORMAT_VERSION,
        save_id: opts.save_id.clone(),
        rank: opts.rank,
        world_size: opts.world_size,
        mode: opts.mode.clone(),
        param_groups: opts.param_groups.clone(),
        extra: opts.extra.clone(),
        checksum: "xxh64".into(),
        checksum_block_bytes: BLOCK_BYTES,
        tensors,
        keys: plan.keys.clone(),
    };
    BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        ("DCP_VERSION".to_string(), "1.0".to_string()),
        ("DCP_SHARDING_INFO".to_string(), sharding_info(&offsets)),
        ("fo".to_string(), serde_json::to_string(&fo).unwrap()),
    ])
}

/// Writes one rank's file to a temporary name in `dir`. `fetch(entry)` returns the local
/// tensor of an entry; it is called once per entry that has chunks, in order.
pub fn stage_rank_file<'t>(
    dir: &Path,
    plan: &Plan,
    opts: &PackOptions,
    fetch: &mut dyn FnMut(usize) -> Result<Cow<'t, Tensor>>,
) -> Result<Staged> {
    if opts.rank >= opts.world_size {
        return Err(Error::invalid(
            "rank",
            format!("{} is outside a world of {}", opts.rank, opts.world_size),
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let name = shard_file_name(opts.rank);
    remove_stale_temps(dir, &name)?;
    let staged = Staged {
        tmp: dir.join(format!(".{name}.tmp-{}", std::process::id())),
        dest: dir.join(&name),
    };
    let mut entries = Vec::with_capacity(plan.chunks.len());
    let mut at = 0u64;
    for c in &plan.chunks {
        let n = (c.shape.iter().product::<usize>() * c.dtype.size()) as u64;
        entries.push(TensorEntry {
            name: c.name.clone(),
            dtype: c.dtype,
            shape: c.shape.clone(),
            start: at,
            end: at + n,
        });
        at += n;
    }
    let placeholder: Vec<String> = entries
        .iter()
        .map(|t| "0".repeat(16 * num_blocks((t.end - t.start) as usize)))
        .collect();
    let head = encode_header(&metadata(plan, opts, &placeholder), &entries);
    let io = |e| Error::io(&staged.tmp, e);
    let mut f = create_truncated(&staged.tmp)?;
    f.write_all(&head).map_err(io)?;
    let mut sums = Vec::with_capacity(entries.len());
    let mut i = 0;
    while i < plan.chunks.len() {
        let entry = plan.chunks[i].entry;
        let local = fetch(entry)?;
        while i < plan.chunks.len() && plan.chunks[i].entry == entry {
            let c = &plan.chunks[i];
            if local.shape.len() != c.local_offset.len() || local.dtype != c.dtype {
                return Err(Error::Shape(format!(
                    "key {}: fetched a {} tensor of shape {:?}, planned {} of rank {}",
                    c.key,
                    local.dtype,
                    local.shape,
                    c.dtype,
                    c.local_offset.len()
                )));
            }
            let bytes = chunk_bytes(c, &local);
            sums.push(block_hex(&bytes));
            f.write_all(&bytes).map_err(io)?;
            i += 1;
        }
    }
    let head2 = encode_header(&metadata(plan, opts, &sums), &entries);
    if head2.len() != head.len() {
        return Err(Error::Internal(
            "checkpoint header changed length between placeholder and final write".into(),
        ));
    }
    f.write_all_at(&head2, 0).map_err(io)?;
    f.sync_all().map_err(io)?;
    Ok(staged)
}

/// Removes temporary files a killed writer of the same file left behind (one writer per
/// rank file at a time, so any such file is dead).
fn remove_stale_temps(dir: &Path, name: &str) -> Result<()> {
    let prefix = format!(".{name}.tmp-");
    for e in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let p = e.map_err(|e| Error::io(dir, e))?.path();
        if p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(&prefix))
        {
            std::fs::remove_file(&p).map_err(|e| Error::io(&p, e))?;
        }
    }
    Ok(())
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}

/// Renames staged files over their final names, then fsyncs the directory. When
/// `world_size` is given, shard files of ranks beyond it (left by an earlier, larger
/// save) are removed, so the directory holds exactly one checkpoint.
pub fn commit(dir: &Path, staged: Vec<Staged>, world_size: Option<usize>) -> Result<()> {
    for s in &staged {
        std::fs::rename(&s.tmp, &s.dest).map_err(|e| Error::io(&s.dest, e))?;
    }
    if let Some(world) = world_size {
        for e in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
            let p = e.map_err(|e| Error::io(dir, e))?.path();
            let rank = p.file_name().and_then(|n| n.to_str()).and_then(parse_shard_file_name);
            if rank.is_some_and(|r| r >= world) {
                std::fs::remove_file(&p).map_err(|e| Error::io(&p, e))?;
            }
        }
    }
    sync_dir(dir)
}

/// Saves the packed state of every in-process rank into `dir` (one file per rank,
/// written in parallel, committed together).
pub fn save(dir: &Path, packs: &[Packed]) -> Result<()> {
    let staged: Vec<Result<Staged>> = std::thread::scope(|s| {
        let handles: Vec<_> = packs
            .iter()
            .map(|p| s.spawn(move || stage_rank_file(dir, &p.plan, &p.opts, &mut |e| Ok(Cow::Borrowed(&p.entries[e])))))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Internal("a writer thread panicked".into())))
            })
            .collect()
    });
    let staged = staged.into_iter().collect::<Result<Vec<_>>>()?;
    let world = packs.first().map(|p| p.opts.world_size);
    commit(dir, staged, world)
}

/// Saves one rank's packed state (the call each process of a distributed job makes).
pub fn save_rank(dir: &Path, pack: &Packed) -> Result<()> {
    let staged = stage_rank_file(dir, &pack.plan, &pack.opts, &mut |e| {
        Ok(Cow::Borrowed(&pack.entries[e]))
    })?;
    commit(dir, vec![staged], (pack.opts.rank == 0).then_some(pack.opts.world_size))
}

/// Saves one rank's state without holding it all: `fetch(i)` produces entry `i`'s local
/// tensor on demand (the optimizer glue decodes one state at a time).
pub fn save_streaming(
    dir: &Path,
    metas: &[EntryMeta],
    opts: &PackOptions,
    fetch: &mut dyn FnMut(usize) -> Result<Tensor>,
) -> Result<()> {
    let plan = super::pack::plan(metas, opts)?;
    let staged = stage_rank_file(dir, &plan, opts, &mut |e| fetch(e).map(Cow::Owned))?;
    commit(dir, vec![staged], (opts.rank == 0).then_some(opts.world_size))
}

/// Writes `path` atomically from a header and a stream of data: temp file, fsync,
/// rename, fsync of the directory. `body` writes the data after the header.
pub fn write_atomic(path: &Path, head: &[u8], body: &mut dyn FnMut(&mut File) -> Result<()>) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    let staged = Staged {
        tmp: dir.join(format!(".{name}.tmp-{}", std::process::id())),
        dest: path.to_path_buf(),
    };
    let io = |e| Error::io(&staged.tmp, e);
    let mut f = create_truncated(&staged.tmp)?;
    f.write_all(head).map_err(io)?;
    body(&mut f)?;
    f.sync_all().map_err(io)?;
    commit(dir, vec![staged], None)
}

/// A fresh (truncated) temporary file, the first step of every atomic write.
fn create_truncated(path: &Path) -> Result<File> {
    OpenOptions::new().write(true).create(true).truncate(true).open(path).map_err(|e| Error::io(path, e))
}
