//! Distributed checkpoints of optimizer state: pack local state into named chunks, save
//! one safetensors file per rank (atomic, streaming), load into any sharding, consolidate.
//!
//! On-disk format (`format.rs`): `shard-{rank+1:05}-model-00001-of-00001.safetensors`,
//! one per rank (plus part files for strided shards), each a plain safetensors file. `__metadata__` holds `format = "pt"`,
//! `DCP_VERSION = "1.0"`, `DCP_SHARDING_INFO` (torch's HuggingFace DCP sharding info:
//! every tensor's `saved_offsets`) and `fo` (a JSON string: fo version, save id, rank,
//! world size, mode, `param_groups`, per-tensor key / global shape / offset / block
//! checksums, per-key mesh and placements). Decisions:
//! - A rank's shard that is one box is stored under its key, exactly like torch. A
//!   strided shard (not a box) is stored as its boxes, box j in the rank's part file j,
//!   each under the key, so torch's reader sees chunks of one key (`format::part_file_name`).
//!   fo before this layout named them `<key>#<j>` in one file; those are still read.
//! - A shard held identically by several coordinates (Replicate/Partial mesh dims) is
//!   written by the coordinate at 0 on those dims; unsharded entries by rank 0.
//! - quant8 scales belong to a rank's local groups of 32, so they are not a slice of any
//!   global tensor. They are saved as one 1-D tensor concatenating every owning
//!   coordinate's scales in rank order; each rank computes its offset locally from the
//!   codes' spec (`pack::scales_offset`). A loader whose destination shard is exactly a
//!   saved coordinate's shard copies codes and scales bit for bit; any other destination
//!   is dequantized with the saved groups and requantized in its own groups
//!   (`quant.rs` states the error bound).
//! - Checksums: xxh64 per 4 MiB block of each tensor, seeded by the chunk's key, dtype,
//!   shape and offset, so partial (resharding) reads verify exactly the blocks they
//!   touch and data never passes as another chunk's. A header digest (`fo_digest`)
//!   covers everything the header says (`format.rs`).
//! - Saves are staged and committed by a record written once every rank is done
//!   (`commit.rs`, `collective.rs`); every reader runs the same checks (`validate.rs`).
//! - A 0-element shard writes nothing (torch writes an empty tensor; fo reads both).
pub mod async_save;
pub mod checksum;
pub mod collective;
pub mod commit;
pub mod consolidate;
pub mod convert;
pub mod diff;
pub mod format;
pub mod full;
pub(crate) mod in_flight;
pub mod index;
pub mod info;
pub mod live_reader;
pub mod load;
pub mod logical;
pub mod naming;
pub mod optim;
pub mod output;
pub mod pack;
pub mod quant;
pub mod reader;
pub mod reshard;
pub mod snapshot;
#[cfg(test)]
mod step_pause_tests;
pub mod validate;
pub mod verify;
pub mod writer;

pub use async_save::{save_async, save_async_held, AsyncSave, Background};
pub use collective::save_optimizer_comm;
pub use consolidate::consolidate;
pub use convert::{convert, ConvertOptions, ConvertReport};
pub use diff::{diff, DiffOptions, DiffReport};
pub use index::{KeyInfo, SavedChunk};
pub use info::{info_json, LogicalKey};
pub use load::{load, LoadOptions, LoadReport};
pub use optim::{pack, save as save_optimizer, Mode, ParamsAs, SaveOptions};
pub use pack::{EntryMeta, Layout, PackOptions, Packed, StateEntry};
pub use quant::Quant8;
pub use reader::Checkpoint;
pub use reshard::local_shard;
pub use snapshot::{default_staging_budget, SnapshotStats, FALLBACK_STAGING_BUDGET};
pub use verify::verify;
pub use writer::{save, save_rank, save_streaming};
