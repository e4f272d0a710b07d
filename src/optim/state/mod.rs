//! The optimizer's state seen from outside a step: read and written by key, lent live,
//! and kept still for an async save in flight.
//!
//! - `io`: state by key, read (`state_keys`, `get_state*`, `master`);
//! - `out`: the conversions `io` and checkpoint writers fill output buffers with;
//! - `set`: state by key, written (`set_states`);
//! - `share`: an f32 moment lent without a copy (`share_state`);
//! - `save_hooks`: what an async save in flight needs to hear before state changes.
mod io;
pub(crate) mod out;
pub(crate) mod save_hooks;
mod set;
mod share;
