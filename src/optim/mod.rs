//! The optimizer core: FlashOptim 0.1.4's algorithms and compressed state formats, on
//! host memory. Read in this order:
//! - `config`: algorithms, state formats, one param group's hyper-parameters;
//! - `quant8`: the 8-bit grouped state codec;
//! - `master_split`: bf16/f16 params plus error bits as a 24- or 32-bit master weight;
//! - `rule`: the element-wise updates (torch's arithmetic for fp32 state, FlashOptim's
//!   for compressed state);
//! - `state`: stored state and the chunk views kernels decode and encode;
//! - `fast`: the `fast` arithmetic's scalars and its bound (distance from exact);
//!   `fused`: its step, one quantization group at a time in registers;
//! - `kernel`: chunked, parallel, vectorized driving of the rules;
//! - `optimizer`: the handle (groups, params, accessors); `step`: the step's entry;
//!   `state_io` / `state_set`: state by key, read / written;
//!   `staging`: device parameters and state seen from the host, for state_io and checkpoints;
//!   `numerics`: `check_numerics`; `offload`: Megatron's offload plan; `offload_step`:
//!   host parameters with device gradients and device mirrors;
//!   `threads`: fo's thread pool; `overlap`: the overlapped step (parameters stepped
//!   as their gradients arrive, bit-identical to one step, clipping included);
//! - `gpu`: the GPU kernels' source (proven on the host), the launch table, and with
//!   feature `cuda` the launch path and device state; `device_step`: the device half of
//!   the step (not run on a GPU yet).
pub mod config;
mod device_step;
pub mod fast;
pub mod fused;
pub mod gpu;
pub mod master_split;
pub mod numerics;
pub mod offload;
mod offload_step;
pub mod optimizer;
pub mod overlap;
mod overlap_end;
mod overlap_task;
pub mod quant8;
pub mod rule;
mod save_hooks;
pub mod state;
mod step;
pub mod threads;

mod groups_json;
mod kernel;
pub(crate) mod staging;
mod state_io;
mod state_set;

pub use config::{Algorithm, Arithmetic, OptimConfig, StateFormat};
pub use offload::plan_offload;
pub use optimizer::Optimizer;
pub use threads::{num_threads, set_num_threads};
