//! `fo ckpt verify`: every checksum, and coverage: every global element of every key is
//! saved exactly once (no gaps, no overlaps between chunks).
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::checksum::xxh64;
use super::reader::{Checkpoint, SavedChunk};
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

fn overlaps(a: &SavedChunk, b: &SavedChunk) -> bool {
    (0..a.shape.len()).all(|d| {
        a.global_offset[d] < b.global_offset[d] + b.shape[d] && b.global_offset[d] < a.global_offset[d] + a.shape[d]
    })
}

/// Verifies checkpoint `dir`; `progress(done_bytes, total_bytes)` after each chunk.
pub fn verify(dir: &Path, progress: &mut dyn FnMut(u64, u64)) -> Result<Verified> {
    let ck = Checkpoint::open(dir)?;
    let mut v = Verified {
        files: ck.files.len(),
        keys: ck.keys.len(),
        ..Default::default()
    };
    let total: u64 = ck.keys.values().flat_map(|k| &k.chunks).map(|c| c.nbytes as u64).sum();
    let block = ck.meta.as_ref().map_or(1 << 22, |m| m.checksum_block_bytes.max(1));
    let mut buf = vec![0u8; block];
    for info in ck.keys.values() {
        let numel: usize = info.global_shape.iter().product();
        let saved: usize = info.chunks.iter().map(SavedChunk::numel).sum();
        for (i, a) in info.chunks.iter().enumerate() {
            if let Some(b) = info.chunks[i + 1..].iter().find(|b| overlaps(a, b)) {
                return Err(Error::corrupt(
                    &ck.files[a.file],
                    format!(
                        "key {}: chunk {:?} at {:?} overlaps chunk {:?} at {:?} in {}",
                        info.key,
                        a.name,
                        a.global_offset,
                        b.name,
                        b.global_offset,
                        ck.files[b.file].display()
                    ),
                ));
            }
        }
        if saved != numel {
            return Err(Error::corrupt(
                dir,
                format!(
                    "key {}: chunks hold {saved} of its {numel} elements {:?} (a shard file is missing or incomplete)",
                    info.key, info.global_shape
                ),
            ));
        }
        for c in &info.chunks {
            let path = &ck.files[c.file];
            let mut at = 0usize;
            let mut k = 0;
            while at < c.nbytes {
                let n = block.min(c.nbytes - at);
                ck_read(path, &ck, c, at, &mut buf[..n])?;
                if let Some(sums) = &c.checksums {
                    let got = format!("{:016x}", xxh64(&buf[..n]));
                    if sums.get(k * 16..k * 16 + 16) != Some(got.as_str()) {
                        return Err(Error::corrupt(
                            path,
                            format!("key {} (tensor {:?}): checksum mismatch in block {k}", info.key, c.name),
                        ));
                    }
                }
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
