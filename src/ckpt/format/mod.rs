//! What a checkpoint is on disk, before anyone saves or loads one: the safetensors
//! header and fo's metadata in it (`header.rs`), every key and file name (`naming.rs`),
//! the block checksums (`checksum.rs`), and the index of an open checkpoint's chunks
//! (`index.rs`). Uses nothing else in `ckpt`.
pub(crate) mod checksum;
pub(crate) mod header;
pub(crate) mod index;
pub mod naming;
