//! Opening a checkpoint directory (fo's or PyTorch's HuggingFace DCP files) and reading
//! any destination shard of any key from exactly the overlapping parts of saved chunks.
use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::reshard::{overlap_runs, BoxIn, Run};
use super::validate;
use crate::ckpt::format::checksum::{block_sum, chunk_binding};
use crate::ckpt::format::header::{parse_sharding_info, read_header, FoMeta};
use crate::ckpt::format::index::{KeyInfo, SavedChunk};
use crate::ckpt::format::naming::{part_file_name, COMMIT_FILE};
use crate::ckpt::save::commit::{
    committed_file, committed_files, legacy_files, missing, read_commit, Commit,
};
use crate::error::{Error, Result};
use crate::shard::{Chunk, ShardSpec};
use crate::tensor::Tensor;

/// An open checkpoint directory.
#[derive(Debug)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub files: Vec<PathBuf>,
    handles: Vec<File>,
    block_bytes: Vec<usize>,
    pub keys: BTreeMap<String, KeyInfo>,
    /// fo's metadata of the first file, without its per-tensor table (None: not fo's).
    pub meta: Option<FoMeta>,
}

impl Checkpoint {
    /// Opens `dir` and validates it as a whole before any data is read
    /// (`validate.rs`): the committed save's files (or, with no commit record, every shard
    /// file), each header's digest, fo's metadata against the header and DCP's sharding
    /// info, one save across files, and every element of every key saved exactly once.
    ///
    /// A safetensors file, or a directory holding only a consolidated file, opens as
    /// one full tensor per key (`full.rs`).
    /// Whether this checkpoint is one full safetensors file (consolidated).
    pub fn is_single_file(&self) -> bool {
        self.files.len() == 1 && super::full::single_file(&self.dir).ok().flatten().is_some()
    }

    pub fn open(dir: &Path) -> Result<Checkpoint> {
        if let Some(path) = super::full::single_file(dir)? {
            let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
            let keys = super::full::keys(&path, &file)?;
            return Ok(Checkpoint {
                dir: dir.to_path_buf(),
                files: vec![path],
                handles: vec![file],
                block_bytes: vec![0],
                keys,
                meta: None,
            });
        }
        let (paths, commit) = match read_commit(dir)? {
            Some(c) => (committed_files(dir, &c)?, Some(c)),
            None => (legacy_files(dir)?, None),
        };
        let mut ck = Checkpoint {
            dir: dir.to_path_buf(),
            files: vec![],
            handles: vec![],
            block_bytes: vec![],
            keys: BTreeMap::new(),
            meta: None,
        };
        let mut world = paths.len();
        let num_ranks = paths.len();
        for (i, path) in paths.into_iter().enumerate() {
            let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
            let (fo, digest) = ck.add_file(&path, &file, ck.files.len())?;
            ck.files.push(path.clone());
            ck.handles.push(file);
            let parts = fo.clone();
            if let Some(fo) = fo {
                if fo.part != 0 {
                    return Err(Error::corrupt(
                        &path,
                        format!("a rank file says it is part {} of its rank", fo.part),
                    ));
                }
                if let Some(c) = &commit {
                    if fo.parts.len() + 1 != c.parts_of(i) {
                        return Err(Error::corrupt(
                            &path,
                            format!(
                                "names {} files of its rank where the commit record names {}",
                                fo.parts.len() + 1,
                                c.parts_of(i)
                            ),
                        ));
                    }
                }
                validate::same_save(
                    &path,
                    &fo,
                    i,
                    ck.meta.as_ref().map(|m| (m, ck.files[0].as_path())),
                )?;
                if let Some(c) = &commit {
                    if fo.save_id != c.save_id || fo.world_size != c.world_size {
                        return Err(Error::corrupt(
                            &path,
                            format!(
                                "file of save {:?} (world {}) where the commit record names save {:?} (world {})",
                                fo.save_id, fo.world_size, c.save_id, c.world_size
                            ),
                        ));
                    }
                }
                if ck.meta.is_none() {
                    world = fo.world_size;
                    ck.meta = Some(FoMeta {
                        tensors: BTreeMap::new(),
                        parts: vec![],
                        ..fo
                    });
                }
            } else if ck.meta.is_some() {
                return Err(Error::corrupt(
                    &path,
                    "has no fo metadata while the other rank files do",
                ));
            }
            if let Some(c) = &commit {
                if digest.as_deref() != Some(c.digests[i].as_str()) {
                    return Err(Error::corrupt(
                        &path,
                        format!(
                            "its header digest {digest:?} is not the one the commit record {} names ({}): not the committed file",
                            COMMIT_FILE, c.digests[i]
                        ),
                    ));
                }
            }
            ck.add_parts(&path, parts.as_ref(), i, commit.as_ref())?;
        }
        if world > num_ranks {
            return Err(missing(
                dir,
                num_ranks,
                format!("the checkpoint was saved by {world} ranks"),
            ));
        }
        for info in ck.keys.values() {
            validate::coverage(info, &ck.files)?;
        }
        Ok(ck)
    }

    /// Adds the extra part files rank `rank`'s file `path` names (boxes 1.. of strided
    /// shards): each the same save and rank, and stating the digest the rank file names.
    fn add_parts(
        &mut self,
        path: &Path,
        fo: Option<&FoMeta>,
        rank: usize,
        commit: Option<&Commit>,
    ) -> Result<()> {
        let Some(fo) = fo else { return Ok(()) };
        let n = fo.parts.len() + 1;
        for (j, want) in (1..n).zip(&fo.parts) {
            let name = part_file_name(rank, j, n);
            let part = match commit {
                Some(c) => committed_file(&self.dir, &c.save_id, &name, want),
                None => Some(self.dir.join(&name)),
            }
            .filter(|p| p.exists())
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "checkpoint {}: part file {name} of rank {rank} is missing ({} names it)",
                    self.dir.display(),
                    path.display()
                ))
            })?;
            let file = File::open(&part).map_err(|e| Error::io(&part, e))?;
            let (m, digest) = self.add_file(&part, &file, self.files.len())?;
            let m = m.ok_or_else(|| Error::corrupt(&part, "part file has no fo metadata"))?;
            validate::same_save(&part, &m, rank, Some((fo, path)))?;
            if m.part != j || !m.parts.is_empty() {
                return Err(Error::corrupt(
                    &part,
                    format!("says it is part {} of its rank, its name says {j}", m.part),
                ));
            }
            if digest.as_deref() != Some(want.as_str()) {
                return Err(Error::corrupt(
                    &part,
                    format!("its header digest {digest:?} is not the one its rank file names ({want}): not this save's part"),
                ));
            }
            self.files.push(part);
            self.handles.push(file);
        }
        Ok(())
    }

    /// Adds a rank file's chunks; returns its fo metadata and stated digest.
    fn add_file(
        &mut self,
        path: &Path,
        file: &File,
        idx: usize,
    ) -> Result<(Option<FoMeta>, Option<String>)> {
        let h = read_header(path, file)?;
        let digest = h
            .metadata
            .get(crate::ckpt::format::header::DIGEST_KEY)
            .cloned();
        let fo = validate::fo_meta(path, &h)?;
        let dcp = match h.metadata.get("DCP_SHARDING_INFO") {
            Some(s) => parse_sharding_info(path, s)?,
            None => BTreeMap::new(),
        };
        if let Some(m) = &fo {
            validate::tables_agree(path, m, &h, &dcp)?;
        }
        let v2 = fo.as_ref().is_some_and(|m| m.format_version >= 2);
        self.block_bytes
            .push(fo.as_ref().map_or(0, |m| m.checksum_block_bytes.max(1)));
        for t in h.tensors {
            let fot = fo.as_ref().and_then(|m| m.tensors.get(&t.name));
            let (key, offset, gshape, sums) = match fot {
                Some(x) => (
                    x.key.clone(),
                    x.global_offset.clone(),
                    Some(x.global_shape.clone()),
                    Some(x.xxh64.clone()),
                ),
                None => {
                    let off = dcp.get(&t.name).cloned().ok_or_else(|| {
                        Error::corrupt(
                            path,
                            format!(
                                "tensor {:?} has no saved_offsets in DCP_SHARDING_INFO",
                                t.name
                            ),
                        )
                    })?;
                    (t.name.clone(), off, None, None)
                }
            };
            if offset.len() != t.shape.len() {
                return Err(Error::corrupt(
                    path,
                    format!(
                        "tensor {:?}: offsets {offset:?} do not match shape {:?}",
                        t.name, t.shape
                    ),
                ));
            }
            let fo_key = fo.as_ref().and_then(|m| m.keys.get(&key).cloned());
            let info = self.keys.entry(key.clone()).or_insert_with(|| KeyInfo {
                key: key.clone(),
                dtype: t.dtype,
                global_shape: gshape.clone().unwrap_or_else(|| vec![0; t.shape.len()]),
                chunks: vec![],
                fo: fo_key.clone(),
            });
            if info.dtype != t.dtype
                || info.global_shape.len() != t.shape.len()
                || gshape.as_ref().is_some_and(|g| *g != info.global_shape)
                || info.fo != fo_key
            {
                return Err(Error::corrupt(
                    path,
                    format!(
                        "key {key}: chunk {:?} is {} {:?} of global {gshape:?} saved as {fo_key:?}, other chunks are {} of global {:?} saved as {:?}",
                        t.name, t.dtype, t.shape, info.dtype, info.global_shape, info.fo
                    ),
                ));
            }
            if gshape.is_none() {
                // torch's files carry no global shape: it is where the furthest chunk ends.
                for ((g, o), n) in info.global_shape.iter_mut().zip(&offset).zip(&t.shape) {
                    *g = (*g).max(o.saturating_add(*n));
                }
            }
            if t.shape.iter().product::<usize>() > 0 {
                let bind = if v2 {
                    chunk_binding(&key, t.dtype.safetensors_name(), &t.shape, &offset)
                } else {
                    0
                };
                info.chunks.push(SavedChunk {
                    file: idx,
                    name: t.name.clone(),
                    global_offset: offset,
                    shape: t.shape.clone(),
                    data_start: h.data_start + t.start,
                    nbytes: (t.end - t.start) as usize,
                    checksums: sums,
                    bind,
                });
            }
        }
        Ok((fo, digest))
    }

    pub fn file(&self, i: usize) -> &File {
        &self.handles[i]
    }

    pub fn key(&self, key: &str) -> Result<&KeyInfo> {
        self.keys.get(key).ok_or_else(|| {
            Error::NotFound(format!(
                "key {key} is not in checkpoint {}",
                self.dir.display()
            ))
        })
    }

    /// The local shard `dest` describes of `key`, in the saved dtype.
    pub fn read(&self, key: &str, dest: &ShardSpec) -> Result<Tensor> {
        let info = self.key(key)?;
        if dest.global_shape() != info.global_shape.as_slice() {
            return Err(Error::Shape(format!(
                "key {key}: checkpoint {} holds global shape {:?}, the destination expects {:?}",
                self.dir.display(),
                info.global_shape,
                dest.global_shape()
            )));
        }
        self.read_chunks(info, &dest.local_shape(), &dest.chunks())
    }

    /// The whole global tensor of `key`.
    pub fn read_full(&self, key: &str) -> Result<Tensor> {
        let info = self.key(key)?;
        self.read(key, &ShardSpec::unsharded(info.global_shape.clone())?)
    }

    /// Fills a local tensor of `local_shape` whose boxes are `dest` (local and global
    /// offsets) from every saved chunk they overlap; errors if any element is in no chunk.
    pub fn read_chunks(
        &self,
        info: &KeyInfo,
        local_shape: &[usize],
        dest: &[Chunk],
    ) -> Result<Tensor> {
        let mut out = Tensor::zeros(info.dtype, local_shape.to_vec());
        let es = info.dtype.size();
        let mut covered = 0usize;
        for c in &info.chunks {
            let src = BoxIn {
                global_offset: &c.global_offset,
                shape: &c.shape,
                storage_shape: &c.shape,
                storage_offset: &vec![0; c.shape.len()],
            };
            let mut runs = Vec::new();
            for d in dest {
                let dst = BoxIn::of_chunk(d, local_shape);
                runs.extend(overlap_runs(&src, &dst));
            }
            if !runs.is_empty() {
                covered += runs.iter().map(|r| r.len).sum::<usize>();
                self.read_runs(info, c, &runs, es, &mut out.data)?;
            }
        }
        let want: usize = dest.iter().map(|d| d.shape.iter().product::<usize>()).sum();
        if covered != want {
            return Err(Error::NotFound(format!(
                "key {}: {} of the {want} requested elements are in no saved chunk of {} (missing or overlapping shard files?)",
                info.key, want.abs_diff(covered), self.dir.display()
            )));
        }
        Ok(out)
    }

    /// Copies `runs` (elements) of saved chunk `c` into `out`, reading only the checksum
    /// blocks they touch and verifying each one.
    fn read_runs(
        &self,
        info: &KeyInfo,
        c: &SavedChunk,
        runs: &[Run],
        es: usize,
        out: &mut [u8],
    ) -> Result<()> {
        let path = &self.files[c.file];
        let file = &self.handles[c.file];
        let io = |e| Error::io(path, e);
        let block = match (&c.checksums, self.block_bytes[c.file]) {
            (Some(_), b) if b > 0 => b,
            _ => {
                // No checksums (torch's files): read exactly the runs, nothing more.
                for r in runs {
                    let at = c.data_start + (r.src * es) as u64;
                    file.read_exact_at(&mut out[r.dst * es..(r.dst + r.len) * es], at)
                        .map_err(io)?;
                }
                return Ok(());
            }
        };
        // A run covering the whole chunk is read straight into place.
        if runs.len() == 1 && runs[0].src == 0 && runs[0].len * es == c.nbytes {
            let dst = &mut out[runs[0].dst * es..runs[0].dst * es + c.nbytes];
            file.read_exact_at(dst, c.data_start).map_err(io)?;
            for (i, b) in dst.chunks(block).enumerate() {
                self.verify(info, c, i, b)?;
            }
            return Ok(());
        }
        let mut blocks: Vec<usize> = runs
            .iter()
            .flat_map(|r| (r.src * es / block)..=((r.src + r.len) * es - 1) / block)
            .collect();
        blocks.sort_unstable();
        blocks.dedup();
        let mut buf = vec![0u8; 0];
        let mut i = 0;
        while i < blocks.len() {
            let mut j = i + 1;
            while j < blocks.len() && blocks[j] == blocks[j - 1] + 1 {
                j += 1;
            }
            let (a, b) = (
                blocks[i] * block,
                ((blocks[j - 1] + 1) * block).min(c.nbytes),
            );
            let at = buf.len();
            buf.resize(at + (b - a), 0);
            file.read_exact_at(&mut buf[at..], c.data_start + a as u64)
                .map_err(io)?;
            for (k, bytes) in buf[at..].chunks(block).enumerate() {
                self.verify(info, c, blocks[i] + k, bytes)?;
            }
            i = j;
        }
        // Block blocks[k] sits at buf[k*block..]: only the tensor's last block is short.
        for r in runs {
            let (mut a, end) = (r.src * es, (r.src + r.len) * es);
            let mut d = r.dst * es;
            while a < end {
                let blk = a / block;
                let k = blocks.binary_search(&blk).unwrap();
                let n = end.min((blk + 1) * block) - a;
                let from = k * block + (a - blk * block);
                out[d..d + n].copy_from_slice(&buf[from..from + n]);
                a += n;
                d += n;
            }
        }
        Ok(())
    }

    /// The checksum block size of file `i` (0: the file has no checksums).
    pub fn block_bytes(&self, i: usize) -> usize {
        self.block_bytes[i]
    }

    /// Checks block `block` of chunk `c` against its stored checksum.
    pub fn verify(&self, info: &KeyInfo, c: &SavedChunk, block: usize, bytes: &[u8]) -> Result<()> {
        let Some(sums) = &c.checksums else {
            return Ok(());
        };
        let want = sums.get(block * 16..block * 16 + 16);
        let got = block_sum(bytes, c.bind, block);
        if want != Some(got.as_str()) {
            return Err(Error::corrupt(
                &self.files[c.file],
                format!(
                    "key {} (tensor {:?}): checksum mismatch in block {block} (stored {}, computed {got})",
                    info.key,
                    c.name,
                    want.unwrap_or("none")
                ),
            ));
        }
        Ok(())
    }
}
