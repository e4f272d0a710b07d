//! The logical checkpoint reader: a sharded checkpoint directory (fo's or torch DCP's), a
//! directory holding a consolidated file, or one full safetensors file, read as logical keys.
//!
//! A compressed pair `K::quantized` + `K::scales` is the single key `K`, dequantized; every
//! other key is read as saved, as f64 values. Reads go slab by slab (rows of dim 0), so
//! memory stays bounded by the slab size whatever the key's size (`diff.rs` compares two).
use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::info::{logical_keys, LogicalKey};
use crate::ckpt::format::header::{read_header, TensorEntry};
use crate::ckpt::format::naming::{codes_key, scales_key, CONSOLIDATED_FILE, GROUP};
use crate::ckpt::load::quant::decode_codes;
use crate::ckpt::load::reader::Checkpoint;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shard::{Placement, ShardSpec};
use crate::tensor::Tensor;

/// Elements per slab read (64 MiB of f64 values per side at most, rows permitting).
pub const SLAB_ELEMS: usize = 1 << 23;

/// A checkpoint read as logical keys.
pub(crate) enum Source {
    Sharded(Box<Checkpoint>),
    Full(FullFile),
}

/// One full safetensors file (a consolidated one, or FlashOptim's), read by byte range.
pub(crate) struct FullFile {
    path: PathBuf,
    file: File,
    data_start: u64,
    tensors: BTreeMap<String, TensorEntry>,
}

impl Source {
    /// A directory of shard files, a directory holding a consolidated file, or a file.
    pub(crate) fn open(p: &Path) -> Result<Source> {
        let file_path = if p.is_file() {
            Some(p.to_path_buf())
        } else if p.join(CONSOLIDATED_FILE).is_file() {
            Some(p.join(CONSOLIDATED_FILE))
        } else {
            None
        };
        let Some(path) = file_path else {
            return Checkpoint::open(p).map(|c| Source::Sharded(Box::new(c)));
        };
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        let h = read_header(&path, &file)?;
        let tensors = h.tensors.into_iter().map(|t| (t.name.clone(), t)).collect();
        Ok(Source::Full(FullFile {
            path,
            file,
            data_start: h.data_start,
            tensors,
        }))
    }

    fn raw_keys(&self) -> Vec<(String, DType, Vec<usize>)> {
        match self {
            Source::Sharded(ck) => ck
                .keys
                .iter()
                .map(|(k, i)| (k.clone(), i.dtype, i.global_shape.clone()))
                .collect(),
            Source::Full(f) => f
                .tensors
                .iter()
                .map(|(k, t)| (k.clone(), t.dtype, t.shape.clone()))
                .collect(),
        }
    }

    fn has(&self, key: &str) -> bool {
        match self {
            Source::Sharded(ck) => ck.keys.contains_key(key),
            Source::Full(f) => f.tensors.contains_key(key),
        }
    }

    /// Every logical key (compressed pairs folded into their base, as f32 values).
    pub(crate) fn keys(&self) -> BTreeMap<String, LogicalKey> {
        logical_keys(self.raw_keys(), |k| self.has(k))
    }

    /// The slabs `shape` is read in: Shard(0) over as many ranks as it takes to keep each
    /// under `slab_elems` elements (one unsharded slab for 0-dim and small tensors).
    pub(crate) fn slabs(shape: &[usize], slab_elems: usize) -> Result<Vec<ShardSpec>> {
        let numel: usize = shape.iter().product();
        let n = if shape.is_empty() {
            1
        } else {
            numel.div_ceil(slab_elems.max(1)).clamp(1, shape[0].max(1))
        };
        if n == 1 {
            return Ok(vec![ShardSpec::unsharded(shape.to_vec())?]);
        }
        (0..n)
            .map(|i| ShardSpec::new(shape.to_vec(), vec![n], vec![i], vec![Placement::Shard(0)]))
            .collect()
    }

    /// The values of logical `key` in `slab` (one of `slabs(shape)`), as f64.
    pub(crate) fn read(&self, key: &str, k: &LogicalKey, slab: &ShardSpec) -> Result<Vec<f64>> {
        match self {
            Source::Sharded(ck) if k.compressed => {
                Ok(ck.read_f32(key, slab)?.into_iter().map(f64::from).collect())
            }
            Source::Sharded(ck) => values(&ck.read(key, slab)?),
            Source::Full(f) if k.compressed => f.read_quant8(key, slab),
            Source::Full(f) => values(&f.read_rows(key, slab)?),
        }
    }
}

impl FullFile {
    /// `buf.len()` bytes at `offset` into the data of the tensor starting at `start`.
    fn read_at(&self, buf: &mut [u8], start: u64, offset: usize) -> Result<()> {
        self.file
            .read_exact_at(buf, self.data_start + start + offset as u64)
            .map_err(|e| Error::io(&self.path, e))
    }

    /// The rows of `slab` (a dim-0 range, contiguous in a full file) of raw key `key`.
    fn read_rows(&self, key: &str, slab: &ShardSpec) -> Result<Tensor> {
        let t = self.tensors.get(key).ok_or_else(|| {
            Error::NotFound(format!("key {key} is not in {}", self.path.display()))
        })?;
        let local = slab.local_shape();
        let row_bytes = t.shape.iter().skip(1).product::<usize>() * t.dtype.size();
        let first_row = slab.global_offset().first().copied().unwrap_or(0);
        let mut buf = vec![0u8; local.iter().product::<usize>() * t.dtype.size()];
        self.read_at(&mut buf, t.start, first_row * row_bytes)?;
        Tensor::new(t.dtype, local, buf)
    }

    /// FlashOptim's unsharded layout: codes of the full tensor, one fp16 scale per 32
    /// consecutive elements of it.
    fn read_quant8(&self, base: &str, slab: &ShardSpec) -> Result<Vec<f64>> {
        let path = &self.path;
        let (ck, sk) = (codes_key(base), scales_key(base));
        let codes = self.read_rows(&ck, slab)?;
        let st = &self.tensors[&sk];
        if st.dtype != DType::F16 || st.shape.len() != 1 {
            return Err(Error::corrupt(
                path,
                format!(
                    "key {sk}: expected 1-dim F16 scales, found {} {:?}",
                    st.dtype, st.shape
                ),
            ));
        }
        // Only the slab's groups are read, not the whole scales tensor.
        let row: usize = codes.shape.iter().skip(1).product();
        let e0 = slab.global_offset().first().copied().unwrap_or(0) * row;
        let (g0, g1) = (e0 / GROUP, (e0 + codes.numel()).div_ceil(GROUP));
        if g1 > st.shape[0] {
            return Err(Error::corrupt(
                path,
                format!("key {sk} holds {} groups, its codes need {g1}", st.shape[0]),
            ));
        }
        let mut buf = vec![0u8; (g1 - g0) * 2];
        self.read_at(&mut buf, st.start, g0 * 2)?;
        let scales: Vec<half::f16> = buf
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
            .collect();
        let x = decode_codes(&codes, &ck, |i| scales[(e0 + i) / GROUP - g0])?;
        Ok(x.into_iter().map(f64::from).collect())
    }
}

/// Every element as f64 (integers above 2^53 lose their low bits; bool is 0/1).
pub(crate) fn values(t: &Tensor) -> Result<Vec<f64>> {
    let b = &t.data;
    Ok(match t.dtype {
        DType::F64 => b
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::I8 => b.iter().map(|&x| f64::from(x as i8)).collect(),
        DType::U8 | DType::Bool => b.iter().map(|&x| f64::from(x)).collect(),
        DType::I16 => b
            .chunks_exact(2)
            .map(|c| f64::from(i16::from_le_bytes([c[0], c[1]])))
            .collect(),
        DType::I32 => b
            .chunks_exact(4)
            .map(|c| f64::from(i32::from_le_bytes(c.try_into().unwrap())))
            .collect(),
        DType::I64 => b
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        _ => t.to_f32()?.into_iter().map(f64::from).collect(),
    })
}
