//! A checkpoint's table of contents in logical keys: a compressed pair `K::quantized` +
//! `K::scales` is the one key `K` (f32 values, the codes' shape), every other key as saved.
//! `fo_checkpoint_info_json`, Python's `fo.ckpt.info` and `fo ckpt diff` read it, so no
//! reader outside the library parses headers or knows the pair suffixes.
use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};

use crate::ckpt::format::naming::{codes_key, scales_key, split_part};
use crate::ckpt::load::reader::Checkpoint;
use crate::dtype::DType;
use crate::error::Result;

/// One logical key: its element type and global shape; `compressed` when stored as a
/// quant8 pair (then `dtype` is F32, what it decodes to).
#[derive(Debug, Clone, PartialEq)]
pub struct LogicalKey {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub compressed: bool,
}

/// Folds saved keys (name, dtype, global shape) into logical keys; `has` says whether a
/// saved key exists (a `::quantized` or `::scales` key without its partner stays itself).
pub(crate) fn logical_keys(
    raw: impl IntoIterator<Item = (String, DType, Vec<usize>)>,
    has: impl Fn(&str) -> bool,
) -> BTreeMap<String, LogicalKey> {
    let mut out = BTreeMap::new();
    for (key, dtype, shape) in raw {
        match split_part(&key).map(|(b, _)| b) {
            Some(b) if has(&codes_key(b)) && has(&scales_key(b)) => {
                if key == codes_key(b) {
                    let k = LogicalKey {
                        dtype: DType::F32,
                        shape,
                        compressed: true,
                    };
                    out.insert(b.to_string(), k);
                }
            }
            _ => {
                let k = LogicalKey {
                    dtype,
                    shape,
                    compressed: false,
                };
                out.insert(key, k);
            }
        }
    }
    out
}

impl Checkpoint {
    /// Every logical key of the checkpoint (see `logical_keys`).
    pub fn logical_keys(&self) -> BTreeMap<String, LogicalKey> {
        let raw = self
            .keys
            .iter()
            .map(|(k, i)| (k.clone(), i.dtype, i.global_shape.clone()));
        logical_keys(raw, |k| self.keys.contains_key(k))
    }

    /// The table of contents as JSON: `{"mode", "param_groups"` (both null in files fo did
    /// not write)`, "keys": {key: {"dtype", "shape", "compressed"}}}`.
    pub fn info_json(&self) -> Value {
        let keys: serde_json::Map<String, Value> = self
            .logical_keys()
            .into_iter()
            .map(|(k, l)| {
                let v = json!({
                    "dtype": l.dtype.safetensors_name(),
                    "shape": l.shape,
                    "compressed": l.compressed,
                });
                (k, v)
            })
            .collect();
        let (mode, groups) = match &self.meta {
            Some(m) => (json!(m.mode), m.param_groups.clone()),
            None => (Value::Null, Value::Null),
        };
        json!({"mode": mode, "param_groups": groups, "keys": keys})
    }
}

/// Opens (and validates) checkpoint `dir` and returns its table of contents as JSON.
pub fn info_json(dir: &Path) -> Result<String> {
    Ok(Checkpoint::open(dir)?.info_json().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(k: &str, d: DType, s: &[usize]) -> (String, DType, Vec<usize>) {
        (k.to_string(), d, s.to_vec())
    }

    #[test]
    fn a_compressed_pair_is_one_f32_key_and_a_lone_half_stays_itself() {
        let saved = [
            raw("state.w.exp_avg::quantized", DType::I8, &[4, 8]),
            raw("state.w.exp_avg::scales", DType::F16, &[1]),
            raw("state.w.step", DType::F32, &[]),
            raw("state.v.exp_avg_sq::scales", DType::F16, &[2]),
            raw("w", DType::BF16, &[4, 8]),
        ];
        let names: Vec<String> = saved.iter().map(|r| r.0.clone()).collect();
        let got = logical_keys(saved.clone(), |k| names.iter().any(|n| n == k));
        let keys: Vec<&str> = got.keys().map(|k| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "state.v.exp_avg_sq::scales",
                "state.w.exp_avg",
                "state.w.step",
                "w"
            ]
        );
        let pair = &got["state.w.exp_avg"];
        assert_eq!(
            pair,
            &LogicalKey {
                dtype: DType::F32,
                shape: vec![4, 8],
                compressed: true
            }
        );
        assert!(!got["state.v.exp_avg_sq::scales"].compressed);
        assert_eq!(got["w"].dtype, DType::BF16);
    }
}
