//! Distributed checkpoints of optimizer state: pack local state into named chunks, save
//! one safetensors file per rank (atomic, streaming), load into any sharding, consolidate.
//!
//! On-disk format (`format/header.rs`): `shard-{rank+1:05}-model-00001-of-00001.safetensors`,
//! one per rank (plus part files for strided shards), each a plain safetensors file. `__metadata__` holds `format = "pt"`,
//! `DCP_VERSION = "1.0"`, `DCP_SHARDING_INFO` (torch's HuggingFace DCP sharding info:
//! every tensor's `saved_offsets`) and `fo` (a JSON string: fo version, save id, rank,
//! world size, mode, `param_groups`, per-tensor key / global shape / offset / block
//! checksums, per-key mesh and placements). Decisions:
//! - A rank's shard that is one box is stored under its key, exactly like torch. A
//!   strided shard (not a box) is stored as its boxes, box j in the rank's part file j,
//!   each under the key, so torch's reader sees chunks of one key (`naming::part_file_name`).
//!   fo before this layout named them `<key>#<j>` in one file; those are still read.
//! - A shard held identically by several coordinates (Replicate/Partial mesh dims) is
//!   written by the coordinate at 0 on those dims; unsharded entries by rank 0.
//! - quant8 scales belong to a rank's local groups of 32, so they are not a slice of any
//!   global tensor. They are saved as one 1-D tensor concatenating every owning
//!   coordinate's scales in rank order; each rank computes its offset locally from the
//!   codes' spec (`save/pack.rs`'s `scales_offset`). A loader whose destination shard is exactly a
//!   saved coordinate's shard copies codes and scales bit for bit; any other destination
//!   is dequantized with the saved groups and requantized in its own groups
//!   (`load/quant.rs` states the error bound).
//! - Checksums: xxh64 per 4 MiB block of each tensor, seeded by the chunk's key, dtype,
//!   shape and offset, so partial (resharding) reads verify exactly the blocks they
//!   touch and data never passes as another chunk's. A header digest (`fo_digest`)
//!   covers everything the header says (`format/header.rs`).
//! - Saves are staged and committed by a record written once every rank is done
//!   (`save/commit.rs`, `save/collective.rs`); every reader runs the same checks
//!   (`load/validate.rs`).
//! - A 0-element shard writes nothing (torch writes an empty tensor; fo reads both).
//!
//! Rooms, lowest first (each uses only those before it; `load` reads `save`'s commit
//! record):
//! - `format/`: the header and fo's metadata, names, checksums, the chunk index;
//! - `save/`: packing, the writer, commit, collective and async saves;
//! - `load/`: the reader, its checks, resharding, quant8 reads, loading an `Optimizer`;
//! - `tools/`: consolidate, convert, diff, info, verify and their output directories.
//!
//! The rooms are private to the crate; what the CLI, tests and Rust users need is
//! re-exported here (and `naming`, the vocabulary of keys and file names).
pub(crate) mod format;
pub(crate) mod load;
pub(crate) mod save;
pub(crate) mod tools;

pub use format::header::{
    encode_header, header_digest, parse_sharding_info, read_header, sharding_info, FoKey, FoMeta,
    FoTensor, Header, TensorEntry, DIGEST_KEY,
};
pub use format::index::{KeyInfo, SavedChunk};
pub use format::naming;

pub use save::async_save::{save_async, save_async_held, AsyncSave, Background};
pub use save::collective::save_optimizer_comm;
pub use save::commit::{committed_files, read_commit, stage_dir, Commit};
pub use save::optim::{pack, save as save_optimizer, Mode, ParamsAs, SaveOptions};
pub use save::pack::{EntryMeta, Layout, PackOptions, Packed, StateEntry};
pub use save::snapshot::{default_staging_budget, SnapshotStats, FALLBACK_STAGING_BUDGET};
pub use save::writer::{finish as finish_staged, save, save_rank, save_streaming};
pub use save::writer::{stage_rank_file, Staged};

pub use load::optim::{load, LoadOptions, LoadReport};
pub use load::quant::Quant8;
pub use load::reader::Checkpoint;
pub use load::reshard::local_shard;

pub use tools::consolidate::{consolidate, Consolidated};
pub use tools::convert::{convert, ConvertOptions, ConvertReport, OptionNames};
pub use tools::convert::{plan as plan_convert, write as write_convert};
pub use tools::convert::{Format as ConvertFormat, Plan as ConvertPlan};
pub use tools::diff::{diff, DiffOptions, DiffReport, KeyDiff};
pub use tools::info::{info_json, LogicalKey};
pub use tools::logical::SLAB_ELEMS;
pub use tools::output::{check_dst, check_dst_contents, missing_ancestors, remove_path, swap_in};
pub use tools::verify::{verify, Verified};
