//! The optimizer: FlashOptim 0.1.4's algorithms and compressed state formats as a small
//! handle and its code by concern, over its math (`math`) and its placement (`placement`).
//!
//! - `optimizer`: the handle (its fields, the parameter table and the accessors every
//!   concern goes through; who may touch what is mapped at its head);
//! - `register`: parameters and groups registered, group configs changed, `param_groups`;
//! - `step`: the step's entry, which drives `crate::kernels`, and `step::numerics`;
//! - `overlap`: the overlapped step (parameters stepped as their gradients arrive,
//!   bit-identical to one step, clipping included);
//! - `state`: state by key (read, written, lent) and the async save's hooks;
//! - `keys`: state key names (the one owner; checkpoints re-export them);
//! - `threads`: fo's thread pool;
//! - `math`: the element-wise rules, the state codecs and `config` (algorithms, state
//!   formats, one param group's hyper-parameters): pure, host-tested, below the kernels;
//! - `placement`: host / device / offloaded parameters and the host view of each.
pub mod keys;
pub mod math;
pub mod optimizer;
pub mod overlap;
pub mod placement;
mod register;
mod state;
mod step;
pub mod threads;

pub use config::{Algorithm, Arithmetic, OptimConfig, StateFormat};
/// `optim::config` is `math::config` (the codes sit below the kernels that read them).
pub use math::config;
pub use math::live::Share;
pub use optimizer::Optimizer;
pub use placement::offload::plan_offload;
pub(crate) use state::save_hooks::SaveHook;
/// `optim::numerics` (`log2_min_step`, the checks `check_numerics` runs) is the step's.
pub use step::numerics;
pub use threads::{num_threads, set_num_threads};
