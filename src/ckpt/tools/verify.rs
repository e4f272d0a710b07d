//! `fo ckpt verify`: every checksum, after `Checkpoint::open`'s checks (header digests,
//! metadata consistency, every global element of every key saved exactly once).
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::ckpt::format::index::SavedChunk;
use crate::ckpt::load::reader::Checkpoint;
use crate::error::{Error, Result};

/// What `verify` checked.
#[derive(Debug, Clone, Default)]
pub struct Verified {
    pub files: usize,
    pub keys: usize,
    pub chunks: usize,
    pub bytes: u64,
    /// Chunks with fo checksums (files torch wrote have none).
    pub checksummed_chunks: usize,
}

/// Verifies checkpoint `dir`; `progress(done_bytes, total_bytes)` after each chunk.
pub fn verify(dir: &Path, progress: &mut dyn FnMut(u64, u64)) -> Result<Verified> {
    let ck = Checkpoint::open(dir)?;
    let mut v = Verified {
        files: ck.files.len(),
        keys: ck.keys.len(),
        ..Default::default()
    };
    let total: u64 = ck
        .keys
        .values()
        .flat_map(|k| &k.chunks)
        .map(|c| c.nbytes as u64)
        .sum();
    let block = ck
        .meta
        .as_ref()
        .map_or(1 << 22, |m| m.checksum_block_bytes.max(1));
    let mut buf = Vec::new();
    buf.try_reserve_exact(block).map_err(|_| {
        Error::corrupt(
            dir,
            format!("checksum block of {block} bytes cannot be allocated"),
        )
    })?;
    buf.resize(block, 0);
    // Coverage (every element exactly once) and header consistency: `Checkpoint::open`.
    for info in ck.keys.values() {
        for c in &info.chunks {
            let path = &ck.files[c.file];
            let mut at = 0usize;
            let mut k = 0;
            while at < c.nbytes {
                let n = block.min(c.nbytes - at);
                ck_read(path, &ck, c, at, &mut buf[..n])?;
                ck.verify(info, c, k, &buf[..n])?;
                at += n;
                k += 1;
            }
            v.chunks += 1;
            v.checksummed_chunks += c.checksums.is_some() as usize;
            v.bytes += c.nbytes as u64;
            progress(v.bytes, total);
        }
    }
    Ok(v)
}

fn ck_read(path: &Path, ck: &Checkpoint, c: &SavedChunk, at: usize, buf: &mut [u8]) -> Result<()> {
    ck.file(c.file)
        .read_exact_at(buf, c.data_start + at as u64)
        .map_err(|e| Error::io(path, e))
}
