//! The index of an open checkpoint: for each key, its dtype, global shape and the chunks
//! saved of it (which file, where, with which checksums). `load/reader.rs` builds it,
//! `load/validate.rs` checks it.
use super::header::FoKey;
use crate::dtype::DType;

/// One saved chunk: a box of its key's global tensor stored row-major in one file.
#[derive(Debug, Clone)]
pub struct SavedChunk {
    pub file: usize,
    pub name: String,
    pub global_offset: Vec<usize>,
    pub shape: Vec<usize>,
    pub data_start: u64,
    pub nbytes: usize,
    /// fo's block checksums (None in files torch wrote).
    pub checksums: Option<String>,
    /// The seed binding the checksums to key, dtype, shape and offset (0: fo 0.1.0's).
    pub bind: u64,
}

impl SavedChunk {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Everything saved for one key.
#[derive(Debug, Clone)]
pub struct KeyInfo {
    pub key: String,
    pub dtype: DType,
    pub global_shape: Vec<usize>,
    /// Non-empty chunks only (torch also writes empty local shards; they hold nothing).
    pub chunks: Vec<SavedChunk>,
    /// How fo saved it (None for torch's files).
    pub fo: Option<FoKey>,
}
