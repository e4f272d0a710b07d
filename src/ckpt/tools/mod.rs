//! The offline tools over whole checkpoints: consolidate (`consolidate.rs`), convert
//! (`convert.rs`), diff (`diff.rs`, reading logical keys through `logical.rs` and
//! `info.rs`), info, verify (`verify.rs`), and the all-or-nothing output directories of
//! convert and consolidate (`output.rs`). Uses `format`, `save` and `load`.
pub(crate) mod consolidate;
pub(crate) mod convert;
pub(crate) mod diff;
pub(crate) mod info;
pub(crate) mod logical;
pub(crate) mod output;
pub(crate) mod verify;
