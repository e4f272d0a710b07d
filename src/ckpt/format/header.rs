//! The on-disk format: safetensors files whose `__metadata__` carries PyTorch DCP's
//! HuggingFace sharding info plus fo's own metadata (a JSON string under `"fo"`).
//!
//! A safetensors file is `u64 LE header length`, a JSON header, then the tensor bytes.
//! fo pads the header with spaces to a multiple of 8 (as the safetensors writer does) so
//! tensor data starts aligned.
use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::checked_numel;

/// The largest header fo accepts (the safetensors crate uses the same limit).
const MAX_HEADER: u64 = 100_000_000;

/// Version of fo's metadata layout; readers refuse newer versions. 2: header digest
/// (`fo_digest`), per-tensor dtype and shape, checksums bound to placement, committed
/// saves (`fo-commit.json`). fo 0.1.0's version 1 files are still read (no digest).
pub(crate) const FORMAT_VERSION: u32 = 2;

/// The `__metadata__` entry holding [`header_digest`].
pub const DIGEST_KEY: &str = "fo_digest";

/// fo's per-file metadata, stored as a JSON string under `__metadata__["fo"]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FoMeta {
    pub fo_version: String,
    pub format_version: u32,
    /// The same in every file of one save; a directory mixing saves is refused on load.
    pub save_id: String,
    pub rank: usize,
    pub world_size: usize,
    /// `"compressed"` or `"portable"` (what the optimizer glue packed), or `"raw"`.
    pub mode: String,
    #[serde(default)]
    pub param_groups: Value,
    #[serde(default)]
    pub extra: Value,
    /// `"xxh64"` over blocks of `checksum_block_bytes` of each tensor's data.
    pub checksum: String,
    pub checksum_block_bytes: usize,
    /// Every tensor in this file: which key it is a chunk of, and where that chunk lies.
    pub tensors: BTreeMap<String, FoTensor>,
    /// How each key saved in this file was sharded when saved.
    pub keys: BTreeMap<String, FoKey>,
    /// Which part of its rank's state this file is (0: the rank file).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub part: usize,
    /// In the rank file: the header digests of parts 1.. (what commits them with it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<String>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FoTensor {
    pub key: String,
    pub global_shape: Vec<usize>,
    pub global_offset: Vec<usize>,
    /// Block checksums, 16 hex digits each, concatenated.
    pub xxh64: String,
    /// The tensor's dtype and (local) shape as the header must state them (format 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<usize>>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FoKey {
    pub mesh: Vec<usize>,
    /// Placements as `fo shard` spells them (`R`, `S0`, `SS0:2`, `P`).
    pub placements: Vec<String>,
    /// Set for quant8 scales: the key of the codes they scale. Scales are stored as one
    /// 1-D tensor: the scales of every owning coordinate's local groups, in rank order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_scales_of: Option<String>,
}

/// One tensor entry of a safetensors header. `start`/`end` are relative to the data.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub start: u64,
    pub end: u64,
}

/// A parsed header: metadata strings, tensors, and where the data begins in the file.
#[derive(Debug, Clone)]
pub struct Header {
    pub metadata: BTreeMap<String, String>,
    pub tensors: Vec<TensorEntry>,
    pub data_start: u64,
}

/// The serialized header (length prefix included) for tensors laid out back to back in
/// the given order.
pub fn encode_header(metadata: &BTreeMap<String, String>, tensors: &[TensorEntry]) -> Vec<u8> {
    let mut obj = serde_json::Map::new();
    obj.insert(
        "__metadata__".into(),
        serde_json::to_value(metadata).unwrap(),
    );
    for t in tensors {
        obj.insert(
            t.name.clone(),
            serde_json::json!({"dtype": t.dtype.safetensors_name(), "shape": t.shape, "data_offsets": [t.start, t.end]}),
        );
    }
    let mut json = serde_json::to_vec(&Value::Object(obj)).unwrap();
    while !(json.len() + 8).is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out
}

fn corrupt(path: &Path, detail: impl Into<String>) -> Error {
    Error::corrupt(path, detail)
}

/// Reads and validates the header of `file` (named `path` in errors): header length
/// within the file, JSON well formed, dtypes known, every tensor's byte range matching
/// its shape and lying inside the file (a truncated file fails here).
pub fn read_header(path: &Path, file: &File) -> Result<Header> {
    let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if file_len < 8 {
        return Err(corrupt(
            path,
            format!("file is {file_len} bytes, too short for a safetensors header"),
        ));
    }
    let mut len8 = [0u8; 8];
    file.read_exact_at(&mut len8, 0)
        .map_err(|e| Error::io(path, e))?;
    let n = u64::from_le_bytes(len8);
    if n > MAX_HEADER || 8 + n > file_len {
        return Err(corrupt(
            path,
            format!("header length {n} does not fit in a file of {file_len} bytes (truncated?)"),
        ));
    }
    let mut buf = vec![0u8; n as usize];
    file.read_exact_at(&mut buf, 8)
        .map_err(|e| Error::io(path, e))?;
    let json: Value = serde_json::from_slice(&buf)
        .map_err(|e| corrupt(path, format!("header is not valid JSON: {e}")))?;
    let Value::Object(obj) = json else {
        return Err(corrupt(path, "header is not a JSON object"));
    };
    let data_start = 8 + n;
    let data_len = file_len - data_start;
    let mut metadata = BTreeMap::new();
    let mut tensors = Vec::new();
    for (name, v) in obj {
        if name == "__metadata__" {
            let Value::Object(m) = v else {
                return Err(corrupt(path, "__metadata__ is not an object"));
            };
            for (k, v) in m {
                let Value::String(s) = v else {
                    return Err(corrupt(
                        path,
                        format!("__metadata__[{k:?}] is not a string"),
                    ));
                };
                metadata.insert(k, s);
            }
            continue;
        }
        tensors.push(parse_entry(path, &name, &v, data_len)?);
    }
    check_layout(path, &tensors, data_len)?;
    Ok(Header {
        metadata,
        tensors,
        data_start,
    })
}

/// safetensors' own rule, before any digest is looked at: walked in offset order, each
/// tensor starts where the previous one ended, and the last ends at the end of the data.
/// Overlapping, aliased, shifted or gapped tensors cannot pass (a digest proves the
/// bytes are the writer's, not that the writer was honest).
fn check_layout(path: &Path, tensors: &[TensorEntry], data_len: u64) -> Result<()> {
    let mut order: Vec<&TensorEntry> = tensors.iter().collect();
    order.sort_by_key(|t| (t.start, t.end));
    let mut at = 0u64;
    for t in order {
        if t.start != at {
            return Err(corrupt(
                path,
                format!(
                    "tensor {:?}: invalid offset: data_offsets [{}, {}] {} (the tensors must \
                     be contiguous and not overlap)",
                    t.name,
                    t.start,
                    t.end,
                    if t.start < at {
                        format!("overlap the previous tensor, which ends at {at}")
                    } else {
                        format!("leave a gap after byte {at}")
                    }
                ),
            ));
        }
        at = t.end;
    }
    if at != data_len {
        return Err(corrupt(
            path,
            format!("the tensors cover {at} of the file's {data_len} data bytes (invalid offsets)"),
        ));
    }
    Ok(())
}

fn parse_entry(path: &Path, name: &str, v: &Value, data_len: u64) -> Result<TensorEntry> {
    let bad = |what: &str| corrupt(path, format!("tensor {name:?}: {what}"));
    let dtype_name = v
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("missing dtype"))?;
    let dtype = DType::from_safetensors_name(dtype_name).map_err(|_| {
        Error::Dtype(format!(
            "{}: tensor {name:?} has unknown dtype {dtype_name:?}",
            path.display()
        ))
    })?;
    let shape: Vec<usize> = v
        .get("shape")
        .and_then(|s| serde_json::from_value(s.clone()).ok())
        .ok_or_else(|| bad("missing or invalid shape"))?;
    let offs: [u64; 2] = v
        .get("data_offsets")
        .and_then(|s| serde_json::from_value(s.clone()).ok())
        .ok_or_else(|| bad("missing or invalid data_offsets"))?;
    let numel = checked_numel(&shape, name).map_err(|_| bad("shape overflows"))?;
    let expect = (numel as u64)
        .checked_mul(dtype.size() as u64)
        .ok_or_else(|| bad("shape overflows"))?;
    if offs[1] < offs[0] || offs[1] - offs[0] != expect {
        return Err(bad(&format!(
            "data_offsets {offs:?} do not hold {expect} bytes of {dtype} {shape:?}"
        )));
    }
    if offs[1] > data_len {
        return Err(bad(&format!(
            "data ends at byte {} but the file holds {data_len} data bytes (truncated?)",
            offs[1]
        )));
    }
    Ok(TensorEntry {
        name: name.to_string(),
        dtype,
        shape,
        start: offs[0],
        end: offs[1],
    })
}

/// The digest of everything a header says: each tensor's name, dtype, shape and byte
/// range, and every `__metadata__` entry but the digest itself (fo's metadata with its
/// placements, checksums and `param_groups`; DCP's sharding info). 16 hex digits.
pub fn header_digest(metadata: &BTreeMap<String, String>, tensors: &[TensorEntry]) -> String {
    let mut ts: Vec<(&str, &str, &[usize], u64, u64)> = tensors
        .iter()
        .map(|t| {
            (
                t.name.as_str(),
                t.dtype.safetensors_name(),
                t.shape.as_slice(),
                t.start,
                t.end,
            )
        })
        .collect();
    ts.sort_unstable();
    let meta: Vec<(&String, &String)> = metadata.iter().filter(|(k, _)| *k != DIGEST_KEY).collect();
    let s = serde_json::to_string(&(ts, meta)).unwrap();
    format!(
        "{:016x}",
        super::checksum::xxh64_seeded(s.as_bytes(), 0x666f_6864_6967_6573)
    )
}

/// `DCP_SHARDING_INFO`: `{name: {"saved_offsets": [...]}}` as torch's HF writer stores it.
pub fn sharding_info(entries: &[(String, Vec<usize>)]) -> String {
    let m: serde_json::Map<String, Value> = entries
        .iter()
        .map(|(k, o)| (k.clone(), serde_json::json!({"saved_offsets": o})))
        .collect();
    Value::Object(m).to_string()
}

/// Parses `DCP_SHARDING_INFO` into `{name: saved_offsets}`.
pub fn parse_sharding_info(path: &Path, s: &str) -> Result<BTreeMap<String, Vec<usize>>> {
    let v: BTreeMap<String, Value> = serde_json::from_str(s)
        .map_err(|e| corrupt(path, format!("DCP_SHARDING_INFO is not valid JSON: {e}")))?;
    v.into_iter()
        .map(|(k, e)| {
            let offs = e
                .get("saved_offsets")
                .and_then(|o| serde_json::from_value(o.clone()).ok())
                .ok_or_else(|| {
                    corrupt(
                        path,
                        format!("DCP_SHARDING_INFO[{k:?}] has no valid saved_offsets"),
                    )
                })?;
            Ok((k, offs))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_padded_to_eight_bytes_and_parses_back() {
        let t = TensorEntry {
            name: "a".into(),
            dtype: DType::F32,
            shape: vec![2],
            start: 0,
            end: 8,
        };
        let h = encode_header(
            &BTreeMap::from([("format".to_string(), "pt".to_string())]),
            std::slice::from_ref(&t),
        );
        assert_eq!(h.len() % 8, 0);
        let dir = std::env::temp_dir().join(format!("fo-format-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("x.safetensors");
        let mut bytes = h.clone();
        bytes.extend_from_slice(&[0u8; 8]);
        std::fs::write(&p, &bytes).unwrap();
        let parsed = read_header(&p, &File::open(&p).unwrap()).unwrap();
        assert_eq!(parsed.tensors, vec![t]);
        assert_eq!(parsed.data_start, h.len() as u64);
        // Truncated data: named as such.
        std::fs::write(&p, &bytes[..bytes.len() - 1]).unwrap();
        let e = read_header(&p, &File::open(&p).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("truncated") && e.contains("\"a\""), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn overlapping_aliased_shifted_or_gapped_offsets_are_refused() {
        let dir = std::env::temp_dir().join(format!("fo-layout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("x.safetensors");
        let entry = |name: &str, start: u64, end: u64| TensorEntry {
            name: name.into(),
            dtype: DType::F32,
            shape: vec![((end - start) / 4) as usize],
            start,
            end,
        };
        let open = |ts: &[TensorEntry], data: usize| {
            let mut bytes = encode_header(&BTreeMap::new(), ts);
            bytes.extend(vec![0u8; data]);
            std::fs::write(&p, &bytes).unwrap();
            read_header(&p, &File::open(&p).unwrap()).map(|_| ())
        };
        open(&[entry("a", 0, 8), entry("b", 8, 16)], 16).unwrap();
        open(&[entry("e", 8, 8), entry("a", 0, 8), entry("b", 8, 16)], 16).unwrap();
        for (what, ts, data) in [
            ("alias", vec![entry("a", 0, 8), entry("b", 0, 8)], 16),
            ("shift by 4", vec![entry("a", 0, 8), entry("b", 4, 12)], 16),
            ("gap", vec![entry("a", 0, 8), entry("b", 12, 20)], 20),
            (
                "trailing bytes",
                vec![entry("a", 0, 8), entry("b", 8, 16)],
                24,
            ),
            ("not from 0", vec![entry("a", 4, 12)], 12),
        ] {
            let e = open(&ts, data).unwrap_err();
            assert!(matches!(e, Error::Corrupt { .. }), "{what}: {e}");
            assert!(e.to_string().contains("invalid offset"), "{what}: {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
