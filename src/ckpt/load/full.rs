//! Opening one full safetensors file as a checkpoint: fo's consolidated output
//! (`DIR/model-00001-of-00001.safetensors`), torch's consolidated `full.safetensors`, or
//! any safetensors file given by path. Every tensor is its key's whole global tensor
//! (one chunk at offset 0); a compressed pair `K::quantized` + `K::scales` is FlashOptim's
//! unsharded layout (one scale per 32 elements of the full tensor), described as saved
//! unsharded so every reader path (`read_f32`, `read_quant8`) maps scales to groups.
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use crate::ckpt::format::header::{read_header, FoKey};
use crate::ckpt::format::index::{KeyInfo, SavedChunk};
use crate::ckpt::format::naming::{
    codes_key, parse_part_file_name, parse_shard_file_name, scales_key, split_part, Part,
    COMMIT_FILE, CONSOLIDATED_FILE,
};
use crate::error::{Error, Result};

/// The full file `path` names: `path` itself when it is a file, or a directory's
/// consolidated file when the directory holds no shard files. None: a sharded directory.
pub(crate) fn single_file(path: &Path) -> Result<Option<PathBuf>> {
    if path.is_file() {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if parse_shard_file_name(name).is_some() || parse_part_file_name(name).is_some() {
            let dir = path.parent().unwrap_or(Path::new("."));
            return Err(Error::invalid(
                "path",
                format!(
                    "{} is one shard file of a sharded checkpoint: give its directory {}",
                    path.display(),
                    dir.display()
                ),
            ));
        }
        return Ok(Some(path.to_path_buf()));
    }
    let full = path.join(CONSOLIDATED_FILE);
    if !full.is_file() {
        return Ok(None);
    }
    let sharded = std::fs::read_dir(path)
        .map_err(|e| Error::io(path, e))?
        .filter_map(|e| e.ok())
        .any(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| parse_shard_file_name(n).is_some() || n == COMMIT_FILE)
        });
    Ok((!sharded).then_some(full))
}

/// The keys of the full file `path`, each one chunk covering its global shape.
pub(super) fn keys(path: &Path, file: &File) -> Result<BTreeMap<String, KeyInfo>> {
    let h = read_header(path, file)?;
    if h.metadata.contains_key("fo") || h.metadata.contains_key("DCP_SHARDING_INFO") {
        return Err(Error::corrupt(
            path,
            "carries sharding metadata: it is one rank's file of a sharded checkpoint, not a full one (give the checkpoint's directory)",
        ));
    }
    let names: Vec<&str> = h.tensors.iter().map(|t| t.name.as_str()).collect();
    let has = |k: &str| names.contains(&k);
    let mut keys = BTreeMap::new();
    for t in &h.tensors {
        let unsharded = |scales_of: Option<String>| FoKey {
            mesh: vec![1],
            placements: vec!["R".into()],
            group_scales_of: scales_of,
        };
        let fo = match split_part(&t.name) {
            Some((b, Part::Codes)) if has(&scales_key(b)) => Some(unsharded(None)),
            Some((b, Part::Scales)) if has(&codes_key(b)) => Some(unsharded(Some(codes_key(b)))),
            _ => None,
        };
        let numel: usize = t.shape.iter().product();
        let chunks = if numel == 0 {
            vec![]
        } else {
            vec![SavedChunk {
                file: 0,
                name: t.name.clone(),
                global_offset: vec![0; t.shape.len()],
                shape: t.shape.clone(),
                data_start: h.data_start + t.start,
                nbytes: (t.end - t.start) as usize,
                checksums: None,
                bind: 0,
            }]
        };
        keys.insert(
            t.name.clone(),
            KeyInfo {
                key: t.name.clone(),
                dtype: t.dtype,
                global_shape: t.shape.clone(),
                chunks,
                fo,
            },
        );
    }
    Ok(keys)
}
