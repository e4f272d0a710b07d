//! Writing checkpoints: packing a rank's state into chunks (`pack.rs`), what an
//! `Optimizer` saves (`optim.rs`), the atomic streaming writer (`writer.rs`), the staging
//! directory and commit record that make a save all-or-nothing (`commit.rs`), saves
//! through a communicator (`collective.rs`), and async saves (`async_save.rs` over the
//! copy-on-write `snapshot.rs`, its staging pool `stage_copy.rs`, `live_reader.rs` and
//! `in_flight.rs`). Uses `format`.
pub(crate) mod async_save;
pub(crate) mod collective;
pub(crate) mod commit;
pub(crate) mod in_flight;
pub(crate) mod live_reader;
pub(crate) mod optim;
pub(crate) mod pack;
pub(crate) mod snapshot;
#[cfg(test)]
mod step_pause_tests;
pub(crate) mod writer;
