//! Atomic, streaming writes of rank files (temporary name, header, tensors, fsync, rename),
//! committed together by `commit.rs`.
//!
//! Each file is written to a temporary name in the save's staging directory, header
//! first with placeholder checksums and digest of the final length, then tensor by tensor
//! (only one entry's data is held at a time), then the real header is written over the
//! placeholder, the file is fsynced and renamed to its staged name. The rank then drops
//! its done marker; the last rank to do so commits the save (`commit::finish_rank`).
//! Nothing of a save is visible before its commit, so a kill at any point leaves the
//! previous checkpoint loadable.
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::commit::{check_world_size, clear_marker, finish_rank, stage_dir, sync_dir};
use super::pack::{chunk_bytes, ChunkMeta, EntryMeta, PackOptions, Packed, Plan};
use crate::ckpt::format::checksum::{block_hex, chunk_binding, num_blocks, BLOCK_BYTES};
use crate::ckpt::format::header::{
    encode_header, header_digest, sharding_info, FoMeta, FoTensor, TensorEntry, DIGEST_KEY,
    FORMAT_VERSION,
};
use crate::ckpt::format::naming::{part_file_name, tmp_prefix};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// A fully written, fsynced temporary file waiting for its rename.
#[derive(Debug)]
pub struct Staged {
    tmp: PathBuf,
    dest: PathBuf,
    /// The header digest (empty for files that are not rank files).
    digest: String,
    rank: usize,
    world_size: usize,
    save_id: String,
    /// The rank's extra part files (boxes 1.. of strided shards), committed with it.
    extra: Vec<Staged>,
}

impl Staged {
    /// How many files the rank writes: its rank file and its extra parts.
    pub fn num_parts(&self) -> usize {
        self.extra.len() + 1
    }
}

impl Drop for Staged {
    /// An uncommitted stage (an error in another rank) removes its temporary file.
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.tmp);
    }
}

/// The save id a save uses: the caller's, or for a single rank a fresh one. Several ranks
/// saving independently cannot agree on a generated id, so they must name one.
pub(crate) fn resolve_save_id(save_id: &str, world_size: usize) -> Result<String> {
    if !save_id.is_empty() {
        return Ok(save_id.to_string());
    }
    if world_size > 1 {
        return Err(Error::invalid(
            "save_id",
            format!(
                "a save by {world_size} ranks needs a save_id, the same on every rank (e.g. the step): \
                 it is what keeps ranks of two saves from being committed together"
            ),
        ));
    }
    Ok(generated_save_id())
}

/// A save id unique to this process and moment.
pub(crate) fn generated_save_id() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!(
        "auto-{}-{}-{}",
        t.as_secs(),
        t.subsec_nanos(),
        std::process::id()
    )
}

/// What one file of a rank holds: part `part` of its plan, and (rank file only) the
/// digests of its other parts.
struct PartMeta<'p> {
    part: usize,
    chunks: Vec<&'p ChunkMeta>,
    parts: Vec<String>,
}

fn metadata(
    plan: &Plan,
    pm: &PartMeta,
    opts: &PackOptions,
    sums: &[String],
    entries: &[TensorEntry],
    placeholder: bool,
) -> BTreeMap<String, String> {
    let offsets: Vec<(String, Vec<usize>)> = pm
        .chunks
        .iter()
        .map(|c| (c.name.clone(), c.global_offset.clone()))
        .collect();
    let tensors = pm
        .chunks
        .iter()
        .zip(sums)
        .map(|(c, s)| {
            let t = FoTensor {
                key: c.key.clone(),
                global_shape: c.global_shape.clone(),
                global_offset: c.global_offset.clone(),
                xxh64: s.clone(),
                dtype: Some(c.dtype.safetensors_name().to_string()),
                shape: Some(c.shape.clone()),
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
        part: pm.part,
        parts: pm.parts.clone(),
    };
    let mut m = BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        ("DCP_VERSION".to_string(), "1.0".to_string()),
        ("DCP_SHARDING_INFO".to_string(), sharding_info(&offsets)),
        ("fo".to_string(), serde_json::to_string(&fo).unwrap()),
    ]);
    let digest = if placeholder {
        "0".repeat(16)
    } else {
        header_digest(&m, entries)
    };
    m.insert(DIGEST_KEY.to_string(), digest);
    m
}

/// A checkpoint directory must be named: an empty path would write into the current
/// directory, which no caller means.
pub(crate) fn check_dir(dir: &Path) -> Result<()> {
    if dir.as_os_str().is_empty() {
        return Err(Error::invalid(
            "dir",
            "empty path (name the checkpoint directory)",
        ));
    }
    Ok(())
}

/// Writes one rank's file to a temporary name in the staging directory of `opts.save_id`
/// (which must be resolved: see `resolve_save_id`). `fetch(entry)` returns the local
/// tensor of an entry; it is called once per entry that has chunks, in order.
pub fn stage_rank_file<'t>(
    dir: &Path,
    plan: &Plan,
    opts: &PackOptions,
    fetch: &mut dyn FnMut(usize) -> Result<Cow<'t, Tensor>>,
) -> Result<Staged> {
    check_dir(dir)?;
    check_world_size(opts.world_size)?;
    if opts.rank >= opts.world_size {
        return Err(Error::invalid(
            "rank",
            format!("{} is outside a world of {}", opts.rank, opts.world_size),
        ));
    }
    if opts.save_id.is_empty() {
        return Err(Error::invalid("save_id", "a rank file needs its save's id"));
    }
    let stage = stage_dir(dir, &opts.save_id);
    std::fs::create_dir_all(&stage).map_err(|e| Error::io(&stage, e))?;
    clear_marker(dir, &opts.save_id, opts.rank)?;
    let num_parts = plan.chunks.iter().map(|c| c.part + 1).max().unwrap_or(1);
    // Parts 1.. first: the rank file (part 0) states their digests.
    let mut files = Vec::with_capacity(num_parts);
    for j in 0..num_parts {
        let pm = PartMeta {
            part: j,
            chunks: plan.chunks.iter().filter(|c| c.part == j).collect(),
            parts: if j == 0 {
                vec!["0".repeat(16); num_parts - 1]
            } else {
                vec![]
            },
        };
        let name = part_file_name(opts.rank, j, num_parts);
        remove_stale_temps(&stage, &name)?;
        let staged = Staged {
            tmp: stage.join(format!("{}{}", tmp_prefix(&name), std::process::id())),
            dest: stage.join(&name),
            digest: String::new(),
            rank: opts.rank,
            world_size: opts.world_size,
            save_id: opts.save_id.clone(),
            extra: vec![],
        };
        let entries = layout(&pm.chunks);
        let placeholder: Vec<String> = entries
            .iter()
            .map(|t| "0".repeat(16 * num_blocks((t.end - t.start) as usize)))
            .collect();
        let head = encode_header(
            &metadata(plan, &pm, opts, &placeholder, &entries, true),
            &entries,
        );
        let mut f = create_truncated(&staged.tmp)?;
        f.write_all(&head).map_err(|e| Error::io(&staged.tmp, e))?;
        files.push((staged, pm, entries, head, f, Vec::new()));
    }
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
            let (staged, _, _, _, f, sums) = &mut files[c.part];
            sums.push(block_hex(
                &bytes,
                chunk_binding(
                    &c.key,
                    c.dtype.safetensors_name(),
                    &c.shape,
                    &c.global_offset,
                ),
            ));
            f.write_all(&bytes).map_err(|e| Error::io(&staged.tmp, e))?;
            i += 1;
        }
    }
    let mut extra = Vec::with_capacity(num_parts - 1);
    for (mut staged, mut pm, entries, head, f, sums) in files.into_iter().rev() {
        if pm.part == 0 {
            pm.parts = extra
                .iter()
                .rev()
                .map(|s: &Staged| s.digest.clone())
                .collect();
        }
        let meta = metadata(plan, &pm, opts, &sums, &entries, false);
        staged.digest = meta[DIGEST_KEY].clone();
        let head2 = encode_header(&meta, &entries);
        if head2.len() != head.len() {
            return Err(Error::Internal(
                "checkpoint header changed length between placeholder and final write".into(),
            ));
        }
        let io = |e| Error::io(&staged.tmp, e);
        f.write_all_at(&head2, 0).map_err(io)?;
        f.sync_all().map_err(io)?;
        if pm.part == 0 {
            extra.reverse();
            staged.extra = extra;
            return Ok(staged);
        }
        extra.push(staged);
    }
    Err(Error::Internal(
        "a rank's plan produced no rank file".into(),
    ))
}

/// The header entries of chunks laid out back to back in the given order.
fn layout(chunks: &[&ChunkMeta]) -> Vec<TensorEntry> {
    let mut at = 0u64;
    chunks
        .iter()
        .map(|c| {
            let n = (c.shape.iter().product::<usize>() * c.dtype.size()) as u64;
            let t = TensorEntry {
                name: c.name.clone(),
                dtype: c.dtype,
                shape: c.shape.clone(),
                start: at,
                end: at + n,
            };
            at += n;
            t
        })
        .collect()
}

/// Removes temporary files a killed writer of the same file left behind (one writer per
/// rank file at a time, so any such file is dead).
fn remove_stale_temps(dir: &Path, name: &str) -> Result<()> {
    let prefix = tmp_prefix(name);
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

/// Renames a rank's staged file to its staged name and drops its done marker; the last
/// rank of the save to get here commits it.
pub fn finish(dir: &Path, staged: Staged) -> Result<()> {
    let (save_id, rank, world, parts) = (
        staged.save_id.clone(),
        staged.rank,
        staged.world_size,
        staged.num_parts(),
    );
    let digest = publish(dir, staged)?;
    finish_rank(dir, &save_id, rank, world, &digest, parts)?;
    Ok(())
}

/// Renames a rank's staged files (its extra parts, then the rank file) to their staged
/// names (still invisible to readers) and returns the rank file's header digest.
pub(crate) fn publish(dir: &Path, mut staged: Staged) -> Result<String> {
    for part in std::mem::take(&mut staged.extra) {
        std::fs::rename(&part.tmp, &part.dest).map_err(|e| Error::io(&part.dest, e))?;
    }
    std::fs::rename(&staged.tmp, &staged.dest).map_err(|e| Error::io(&staged.dest, e))?;
    sync_dir(staged.dest.parent().unwrap_or(dir))?;
    Ok(staged.digest.clone())
}

/// Saves the packed state of every in-process rank into `dir` (one file per rank,
/// written in parallel, committed together). Without a save id, one is generated.
pub fn save(dir: &Path, packs: &[Packed]) -> Result<()> {
    let given = packs
        .first()
        .map_or(String::new(), |p| p.opts.save_id.clone());
    if packs.iter().any(|p| p.opts.save_id != given) {
        return Err(Error::invalid(
            "save_id",
            "the packs of one save carry different save ids",
        ));
    }
    let save_id = if given.is_empty() {
        generated_save_id()
    } else {
        given
    };
    let staged: Vec<Result<Staged>> = std::thread::scope(|s| {
        let handles: Vec<_> = packs
            .iter()
            .map(|p| {
                let save_id = &save_id;
                s.spawn(move || {
                    let opts = PackOptions {
                        save_id: save_id.clone(),
                        ..p.opts.clone()
                    };
                    stage_rank_file(dir, &p.plan, &opts, &mut |e| {
                        Ok(Cow::Borrowed(&p.entries[e]))
                    })
                })
            })
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
    for s in staged {
        finish(dir, s)?;
    }
    Ok(())
}

/// Saves one rank's packed state (the call each process of a distributed job makes).
pub fn save_rank(dir: &Path, pack: &Packed) -> Result<()> {
    let opts = PackOptions {
        save_id: resolve_save_id(&pack.opts.save_id, pack.opts.world_size)?,
        ..pack.opts.clone()
    };
    let staged = stage_rank_file(dir, &pack.plan, &opts, &mut |e| {
        Ok(Cow::Borrowed(&pack.entries[e]))
    })?;
    finish(dir, staged)
}

/// Saves one rank's state without holding it all: `fetch(i)` produces entry `i`'s local
/// tensor on demand (the optimizer glue decodes one state at a time).
pub fn save_streaming(
    dir: &Path,
    metas: &[EntryMeta],
    opts: &PackOptions,
    fetch: &mut dyn FnMut(usize) -> Result<Tensor>,
) -> Result<()> {
    let opts = PackOptions {
        save_id: resolve_save_id(&opts.save_id, opts.world_size)?,
        ..opts.clone()
    };
    let plan = super::pack::plan(metas, &opts)?;
    let staged = stage_rank_file(dir, &plan, &opts, &mut |e| fetch(e).map(Cow::Owned))?;
    finish(dir, staged)
}

/// Writes `path` atomically from a header and a stream of data: temp file, fsync,
/// rename, fsync of the directory. `body` writes the data after the header.
pub(crate) fn write_atomic(
    path: &Path,
    head: &[u8],
    body: &mut dyn FnMut(&mut File) -> Result<()>,
) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    let staged = Staged {
        tmp: dir.join(format!("{}{}", tmp_prefix(name), std::process::id())),
        dest: path.to_path_buf(),
        digest: String::new(),
        rank: 0,
        world_size: 1,
        save_id: String::new(),
        extra: vec![],
    };
    let io = |e| Error::io(&staged.tmp, e);
    let mut f = create_truncated(&staged.tmp)?;
    f.write_all(head).map_err(io)?;
    body(&mut f)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&staged.tmp, &staged.dest).map_err(|e| Error::io(&staged.dest, e))?;
    sync_dir(dir)
}

/// A fresh (truncated) temporary file, the first step of every atomic write.
fn create_truncated(path: &Path) -> Result<File> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(|e| Error::io(path, e))
}
