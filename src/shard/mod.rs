//! DTensor sharding metadata, with PyTorch 2.15's semantics for uneven and strided shards.
mod placement;
mod runs;
mod spec;

pub use placement::{grouped_placements, Placement};
pub use runs::{chunk_range, padded_shard_size, Runs};
pub use spec::{coord_to_rank, mesh_coords, rank_to_coord, Chunk, ShardInfo, ShardSpec};
