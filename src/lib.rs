//! fo: memory-efficient optimizer steps and distributed checkpoint state.
//!
//! The crate is a safe Rust core with a thin C ABI on top (`ffi`, exported from
//! `libfo.so` and described by the generated `include/fo.h`). Each module holds one
//! concept: first the four jobs (`fo_wrap_uneven`, `fo_optimizer_step`, `fo_state_pack`,
//! `fo_broadcast_state_dict`), then what they stand on. (`cbindgen:ignore` keeps the core
//! out of the generated header: only `ffi` is the ABI.)

// The four jobs.
/// Rank 0's full state dict pushed out to every rank's destinations (shards or whole tensors).
/// cbindgen:ignore
pub mod broadcast;
/// Distributed checkpoints: pack, save, load with resharding, consolidate, verify (rooms
/// `format`, `save`, `load`, `tools`; the public surface is re-exported from `ckpt`).
/// cbindgen:ignore
pub mod ckpt;
/// Optimizer steps (AdamW, Adam, SGD, SGDW, Lion) with FlashOptim's compressed state:
/// the handle, its math (`optim::math`) and its placement (`optim::placement`).
/// cbindgen:ignore
pub mod optim;
/// DTensor sharding: placements, `torch.chunk` splitting, uneven and strided shards.
/// cbindgen:ignore
pub mod shard;

// What they stand on: collectives, devices, kernels, tensors, errors; the C ABI last.
/// Element-wise dtype conversion with fo's casting rules (no implicit float8, int<->float opt-in).
/// cbindgen:ignore
pub mod cast;
/// The FSDP2-safe global gradient norm and clip.
/// cbindgen:ignore
pub mod clip;
/// The C codes, each written once: `code_table!` and the tables the ABI's constants come from.
/// cbindgen:ignore
pub mod codes;
/// Communicators: in-process groups, host callbacks, NCCL (feature `cuda`).
/// cbindgen:ignore
pub mod comm;
/// Devices: host or CUDA ordinal, the backend trait, CUDA / no-CUDA / emulated backends.
/// cbindgen:ignore
pub mod device;
/// Element types (`F32`, `BF16`, ...) with their C codes and safetensors names.
/// cbindgen:ignore
pub mod dtype;
/// The crate's one error type and its mapping to C status codes.
/// cbindgen:ignore
pub mod error;
/// The C ABI: pointer and code conversion, panic catching, status codes. No logic lives here.
pub mod ffi;
/// The element-wise kernels by target: host SIMD, GPU `.cuh` source, the tables both read.
/// cbindgen:ignore
pub mod kernels;
/// Locking without poisoning (one helper for every lock that outlives a panic).
/// cbindgen:ignore
pub(crate) mod sync;
/// What the host reports about itself (memory available now).
/// cbindgen:ignore
pub mod sys;
/// Owned tensors, borrowed views over caller memory (with strides and their `Device`).
/// cbindgen:ignore
pub mod tensor;

pub use dtype::DType;
pub use error::{Error, Result};
pub use shard::{Placement, ShardSpec};
pub use tensor::{Device, Tensor, TensorView};

/// cbindgen:ignore
/// The crate version, as `fo_version()` reports it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
