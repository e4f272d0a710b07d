//! The optimizer's math, free of any handle or placement: the element-wise updates and the
//! stored formats they decode and encode. Everything here is pure and tested on the host.
//!
//! - `config`: algorithms, state formats, arithmetic and one param group's
//!   hyper-parameters, with their C codes;
//! - `rule`: the element-wise updates, each written once over an arithmetic backend
//!   (torch's arithmetic for fp32 state, FlashOptim's for compressed state, and the
//!   `fast` one with its bound, the distance from exact), and their per-step scalars;
//! - `quant8`: the 8-bit grouped state codec;
//! - `master_split`: bf16/f16 params plus error bits as a 24- or 32-bit master weight;
//! - `state`: stored state and the chunk views kernels decode and encode;
//! - `live`: the f32 moment's buffer, lendable as live memory.
pub mod config;
pub mod live;
pub mod master_split;
pub mod quant8;
pub mod rule;
pub mod state;
