//! Reading checkpoints: opening a directory or a full file (`reader.rs`, `full.rs`)
//! behind the checks every reader runs (`validate.rs`), the overlap arithmetic of
//! resharding (`reshard.rs`), compressed state read into any sharding (`quant.rs`), and
//! loading into an `Optimizer` (`optim.rs`). Uses `format`, and from `save` the commit
//! record (which files make up a checkpoint), the packed layout of an optimizer's
//! parameters and the owners of quant8 scales.
pub(crate) mod full;
pub(crate) mod optim;
pub(crate) mod quant;
pub(crate) mod reader;
pub(crate) mod reshard;
pub(crate) mod validate;
