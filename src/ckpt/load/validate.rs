//! The checks every reader runs before it reads a byte of data (`Checkpoint::open`, so
//! load, consolidate, verify and inspect alike): a header says only what its digest
//! covers, fo's metadata and the header and DCP's sharding info describe the same chunks,
//! every file belongs to the same save, and every element of every key is saved exactly
//! once. Data is checked against the block checksums as it is read.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::ckpt::format::header::{header_digest, FoMeta, Header, DIGEST_KEY, FORMAT_VERSION};
use crate::ckpt::format::index::{KeyInfo, SavedChunk};
use crate::error::{Error, Result};

/// fo's metadata of a file (None: torch wrote it), its version readable and, from format
/// 2 on, the header matching its digest.
pub(crate) fn fo_meta(path: &Path, h: &Header) -> Result<Option<FoMeta>> {
    let Some(s) = h.metadata.get("fo") else {
        if h.metadata.contains_key(DIGEST_KEY) {
            return Err(Error::corrupt(
                path,
                "header has fo's digest but no fo metadata",
            ));
        }
        return Ok(None);
    };
    let m: FoMeta = serde_json::from_str(s)
        .map_err(|e| Error::corrupt(path, format!("fo metadata is not valid: {e}")))?;
    if m.format_version > FORMAT_VERSION {
        return Err(Error::Unsupported(format!(
            "{}: fo format version {} is newer than this fo ({FORMAT_VERSION})",
            path.display(),
            m.format_version
        )));
    }
    honoured(path, &m, s)?;
    match h.metadata.get(DIGEST_KEY) {
        Some(d) => {
            let got = header_digest(&h.metadata, &h.tensors);
            if *d != got {
                return Err(Error::corrupt(
                    path,
                    format!("header digest mismatch (stored {d}, computed {got}): the header or fo's metadata was edited"),
                ));
            }
        }
        None if m.format_version >= 2 => {
            return Err(Error::corrupt(
                path,
                format!("fo format {} header has no {DIGEST_KEY}", m.format_version),
            ))
        }
        None => {}
    }
    Ok(Some(m))
}

/// The fields fo writes in its metadata (anything else is some other writer's: warned).
const KNOWN_FIELDS: [&str; 14] = [
    "fo_version",
    "format_version",
    "save_id",
    "rank",
    "world_size",
    "mode",
    "param_groups",
    "extra",
    "checksum",
    "checksum_block_bytes",
    "tensors",
    "keys",
    "part",
    "parts",
];

/// Refuses what this fo cannot honour: a checksum algorithm other than xxh64 (its
/// checksums would be reported as verified without being checked), a mode it does not
/// write, a fo_version that is not `MAJOR.MINOR.PATCH`. Warns (stderr) on what it can:
/// unknown metadata fields, which it ignores.
fn honoured(path: &Path, m: &FoMeta, raw: &str) -> Result<()> {
    if m.checksum != "xxh64" {
        return Err(Error::Unsupported(format!(
            "{}: checksum algorithm {:?} is not one this fo can verify (xxh64)",
            path.display(),
            m.checksum
        )));
    }
    if !["compressed", "portable", "raw"].contains(&m.mode.as_str()) {
        return Err(Error::Unsupported(format!(
            "{}: mode {:?} is not one this fo reads (compressed, portable, raw)",
            path.display(),
            m.mode
        )));
    }
    let parts: Vec<&str> = m.fo_version.split('.').collect();
    if parts.len() != 3
        || parts
            .iter()
            .any(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(Error::corrupt(
            path,
            format!(
                "fo_version {:?} is not a MAJOR.MINOR.PATCH version",
                m.fo_version
            ),
        ));
    }
    if let Ok(serde_json::Value::Object(o)) = serde_json::from_str::<serde_json::Value>(raw) {
        let unknown: Vec<&String> = o
            .keys()
            .filter(|k| !KNOWN_FIELDS.contains(&k.as_str()))
            .collect();
        if !unknown.is_empty() {
            eprintln!(
                "fo: warning: {}: fo metadata has fields this fo does not know, ignored: {unknown:?}",
                path.display()
            );
        }
    }
    Ok(())
}

/// fo's tensor table, the header's tensors and DCP's sharding info name the same tensors
/// with the same dtype, shape and offsets. A tensor fo lists that the header lacks is an
/// error, never a zero-filled key.
pub(crate) fn tables_agree(
    path: &Path,
    m: &FoMeta,
    h: &Header,
    dcp: &BTreeMap<String, Vec<usize>>,
) -> Result<()> {
    let bad = |msg: String| Err(Error::corrupt(path, msg));
    let in_header: BTreeMap<&str, _> = h.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    for (name, ft) in &m.tensors {
        let Some(t) = in_header.get(name.as_str()) else {
            return bad(format!(
                "tensor {name:?} (key {}) is in fo's metadata but missing from the safetensors header",
                ft.key
            ));
        };
        if m.format_version >= 2 && (ft.dtype.is_none() || ft.shape.is_none()) {
            return bad(format!(
                "tensor {name:?}: fo's metadata has no dtype or shape"
            ));
        }
        if ft
            .dtype
            .as_deref()
            .is_some_and(|d| d != t.dtype.safetensors_name())
        {
            return bad(format!(
                "tensor {name:?}: the header says {} but fo saved {}",
                t.dtype.safetensors_name(),
                ft.dtype.as_deref().unwrap_or("")
            ));
        }
        if ft.shape.as_ref().is_some_and(|s| *s != t.shape) {
            return bad(format!(
                "tensor {name:?}: the header says shape {:?} but fo saved {:?}",
                t.shape, ft.shape
            ));
        }
        if dcp.get(name) != Some(&ft.global_offset) {
            return bad(format!(
                "tensor {name:?}: DCP_SHARDING_INFO offsets {:?} differ from fo's {:?}",
                dcp.get(name),
                ft.global_offset
            ));
        }
        if ft.global_shape.len() != ft.global_offset.len() {
            return bad(format!(
                "tensor {name:?}: global shape {:?} and offset {:?} differ in rank",
                ft.global_shape, ft.global_offset
            ));
        }
    }
    for t in &h.tensors {
        if !m.tensors.contains_key(&t.name) {
            return bad(format!("tensor {:?} is missing from fo's metadata", t.name));
        }
    }
    if let Some(extra) = dcp.keys().find(|k| !m.tensors.contains_key(*k)) {
        return bad(format!(
            "DCP_SHARDING_INFO names tensor {extra:?}, which the file does not hold"
        ));
    }
    Ok(())
}

/// File `idx` (`path`) is rank `idx` of the same save as the first file.
pub(crate) fn same_save(
    path: &Path,
    m: &FoMeta,
    idx: usize,
    first: Option<(&FoMeta, &Path)>,
) -> Result<()> {
    if m.rank != idx {
        return Err(Error::corrupt(
            path,
            format!(
                "the file says it is rank {}, its name says rank {idx}",
                m.rank
            ),
        ));
    }
    let Some((f, fpath)) = first else {
        return Ok(());
    };
    if f.save_id != m.save_id {
        return Err(Error::corrupt(
            path,
            format!(
                "save_id {:?} differs from {:?} in {}: the directory mixes two saves",
                m.save_id,
                f.save_id,
                fpath.display()
            ),
        ));
    }
    let differs = [
        ("world_size", f.world_size != m.world_size),
        ("mode", f.mode != m.mode),
        ("param_groups", f.param_groups != m.param_groups),
        ("format_version", f.format_version != m.format_version),
        (
            "checksum_block_bytes",
            f.checksum_block_bytes != m.checksum_block_bytes,
        ),
    ];
    if let Some((what, _)) = differs.iter().find(|(_, d)| *d) {
        return Err(Error::corrupt(
            path,
            format!("{what} differs from {} of the same save", fpath.display()),
        ));
    }
    Ok(())
}

fn overlaps(a: &SavedChunk, b: &SavedChunk) -> bool {
    (0..a.shape.len()).all(|d| {
        a.global_offset[d] < b.global_offset[d] + b.shape[d]
            && b.global_offset[d] < a.global_offset[d] + a.shape[d]
    })
}

/// Every element of the key is in exactly one chunk: chunks inside the global shape, no
/// two overlapping, and together as many elements as the global shape holds.
pub(crate) fn coverage(info: &KeyInfo, files: &[PathBuf]) -> Result<()> {
    for c in &info.chunks {
        let outside = (0..c.shape.len()).any(|d| {
            c.global_offset[d]
                .checked_add(c.shape[d])
                .is_none_or(|end| end > info.global_shape[d])
        });
        if outside {
            return Err(Error::corrupt(
                &files[c.file],
                format!(
                    "tensor {:?} at {:?} of shape {:?} lies outside key {}'s global shape {:?}",
                    c.name, c.global_offset, c.shape, info.key, info.global_shape
                ),
            ));
        }
    }
    for (i, a) in info.chunks.iter().enumerate() {
        if let Some(b) = info.chunks[i + 1..].iter().find(|b| overlaps(a, b)) {
            return Err(Error::corrupt(
                &files[a.file],
                format!(
                    "key {}: chunk {:?} at {:?} overlaps chunk {:?} at {:?} in {}",
                    info.key,
                    a.name,
                    a.global_offset,
                    b.name,
                    b.global_offset,
                    files[b.file].display()
                ),
            ));
        }
    }
    let numel = info
        .global_shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| {
            Error::corrupt(
                &files[0],
                format!(
                    "key {}: global shape {:?} overflows",
                    info.key, info.global_shape
                ),
            )
        })?;
    let saved: usize = info.chunks.iter().map(SavedChunk::numel).sum();
    if saved != numel {
        return Err(Error::corrupt(
            files[0].parent().unwrap_or(Path::new(".")),
            format!(
                "key {}: chunks hold {saved} of its {numel} elements {:?} (a gap: a shard file or a chunk is missing)",
                info.key, info.global_shape
            ),
        ));
    }
    Ok(())
}
