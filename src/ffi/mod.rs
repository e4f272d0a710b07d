//! The C ABI. Every exported function has one shape: check the raw arguments through
//! `args`, call the safe core, write the outputs; all inside `guard`, which catches
//! panics and turns errors into a status code plus a thread-local message.
#![allow(non_camel_case_types)]
#![allow(clippy::missing_safety_doc)]

mod args;
/// cbindgen:ignore
mod code_tables;
mod codes;
mod handle;
mod status;
mod types;

mod ckpt;
mod ckpt_info;
mod ckpt_tools;
mod comm;
mod gpu;
mod optim;
mod optim_state;
mod overlap;
mod save;
mod shard;
mod state_share;

pub use ckpt::*;
pub use ckpt_info::*;
pub use ckpt_tools::*;
pub use codes::*;
pub use comm::*;
pub use gpu::*;
pub use optim::*;
pub use optim_state::*;
pub use overlap::*;
pub use save::*;
pub use shard::*;
pub use state_share::*;
pub use status::*;
pub use types::*;
