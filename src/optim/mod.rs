//! The optimizer: FlashOptim 0.1.4's algorithms and compressed state formats as a handle
//! (registration, groups, the step's entry), its math (`math`) and its placement (`placement`).
//!
//! - `math`: the element-wise rules, the state codecs and `config` (algorithms, state
//!   formats, one param group's hyper-parameters): pure, host-tested, below the kernels;
//! - `placement`: host / device / offloaded parameters and the host view of each;
//! - `optimizer`: the handle (groups, params, accessors); `step`: the step's entry, which
//!   drives `crate::kernels` (host SIMD, GPU tables);
//! - `keys`: state key names (the one owner; checkpoints re-export them);
//! - `state_io` / `state_set`: state by key, read / written; `numerics`: `check_numerics`;
//! - `threads`: fo's thread pool; `overlap`: the overlapped step (parameters stepped as
//!   their gradients arrive, bit-identical to one step, clipping included);
//! - `save_hooks`: what an async save in flight needs to hear before state changes.
pub mod keys;
pub mod math;
pub mod numerics;
pub mod optimizer;
pub mod overlap;
mod overlap_end;
mod overlap_open;
mod overlap_task;
pub mod placement;
mod save_hooks;
mod step;
pub mod threads;

mod groups_json;
mod state_io;
mod state_out;
mod state_set;
mod state_share;

pub use config::{Algorithm, Arithmetic, OptimConfig, StateFormat};
/// `optim::config` is `math::config` (the codes sit below the kernels that read them).
pub use math::config;
pub use math::live::Share;
pub use optimizer::Optimizer;
pub use placement::offload::plan_offload;
pub(crate) use save_hooks::SaveHook;
pub use threads::{num_threads, set_num_threads};
