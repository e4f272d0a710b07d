//! Consolidation: every key's full tensor in one safetensors file, plus the HuggingFace
//! index. Unlike torch 2.15's utility, integer tensors are kept and 0-dim tensors keep
//! their value. Compressed state is written in FlashOptim's unsharded layout (codes of
//! the full tensor, one scale per 32 elements of it): copied when the checkpoint was
//! saved unsharded, else requantized (bound in `load/quant.rs`).
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::ckpt::format::header::{encode_header, TensorEntry};
use crate::ckpt::load::reader::Checkpoint;
use crate::ckpt::save::writer::write_atomic;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shard::ShardSpec;
use crate::tensor::Tensor;

use crate::ckpt::format::naming::{
    codes_key, num_groups, split_part, Part, CONSOLIDATED_FILE, INDEX_FILE,
};

/// What was written.
#[derive(Debug, Clone)]
pub struct Consolidated {
    pub file: PathBuf,
    pub index: PathBuf,
    pub keys: usize,
    pub bytes: u64,
    /// Compressed keys whose codes were requantized (saved sharded, so their groups of 32
    /// are not the full tensor's), by base name.
    pub requantized: Vec<String>,
}

/// The base and part of a key of a compressed pair that `ck` holds whole.
fn pair_of<'a>(ck: &Checkpoint, key: &'a str) -> Option<(&'a str, Part)> {
    split_part(key).filter(|(b, _)| ck.is_compressed(b))
}

/// Consolidates checkpoint `dir` into `out`. `progress(done_bytes, total_bytes)` is
/// called after each key (the CLI draws its progress bar from it).
pub fn consolidate(
    dir: &Path,
    out: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Consolidated> {
    let ck = Checkpoint::open(dir)?;
    let mut entries = Vec::new();
    let mut at = 0u64;
    for (key, info) in &ck.keys {
        let (shape, dtype) = match pair_of(&ck, key) {
            Some((base, Part::Scales)) => {
                let codes = ck.key(&codes_key(base))?;
                (
                    vec![num_groups(codes.global_shape.iter().product())],
                    DType::F16,
                )
            }
            _ => (info.global_shape.clone(), info.dtype),
        };
        let n = (shape.iter().product::<usize>() * dtype.size()) as u64;
        entries.push(TensorEntry {
            name: key.clone(),
            dtype,
            shape,
            start: at,
            end: at + n,
        });
        at += n;
    }
    let total = at;
    let mut meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    if let Some(m) = &ck.meta {
        meta.insert("fo_param_groups".into(), m.param_groups.to_string());
    }
    let head = encode_header(&meta, &entries);
    let file = out.join(CONSOLIDATED_FILE);
    let mut done = 0u64;
    let mut pair_cache: Option<(String, crate::ckpt::load::quant::Quant8)> = None;
    let mut requantized = Vec::new();
    write_atomic(&file, &head, &mut |f| {
        for e in &entries {
            let t = match pair_of(&ck, &e.name) {
                Some((base, part)) => {
                    if pair_cache.as_ref().map(|(b, _)| b.as_str()) != Some(base) {
                        let codes = ck.key(&codes_key(base))?;
                        let spec = ShardSpec::unsharded(codes.global_shape.clone())?;
                        let q = ck.read_quant8(base, &spec, codes.dtype == DType::I8)?;
                        if !q.exact {
                            requantized.push(base.to_string());
                        }
                        pair_cache = Some((base.to_string(), q));
                    }
                    let q = &pair_cache.as_ref().unwrap().1;
                    if part == Part::Codes {
                        q.codes.clone()
                    } else {
                        q.scales.clone()
                    }
                }
                None => ck.read_full(&e.name)?,
            };
            check_len(&t, e)?;
            f.write_all(&t.data).map_err(|err| Error::io(&file, err))?;
            done += t.data.len() as u64;
            progress(done, total);
        }
        Ok(())
    })?;
    let weight_map: BTreeMap<&str, &str> = entries
        .iter()
        .map(|e| (e.name.as_str(), CONSOLIDATED_FILE))
        .collect();
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    let index_path = out.join(INDEX_FILE);
    write_atomic(
        &index_path,
        serde_json::to_string_pretty(&index).unwrap().as_bytes(),
        &mut |_| Ok(()),
    )?;
    Ok(Consolidated {
        file,
        index: index_path,
        keys: entries.len(),
        bytes: total,
        requantized,
    })
}

fn check_len(t: &Tensor, e: &TensorEntry) -> Result<()> {
    if t.data.len() as u64 != e.end - e.start {
        return Err(Error::Internal(format!(
            "consolidate: key {} produced {} bytes, planned {}",
            e.name,
            t.data.len(),
            e.end - e.start
        )));
    }
    Ok(())
}
