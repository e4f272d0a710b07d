//! The sharding C ABI: shard metadata, indices, FSDP2 padding and the grouped-weight
//! shift. Thin: converts pointers and codes; `crate::shard` validates.
use super::args::{arg_count, arg_mut, arg_slice_mut};
use super::status::{fo_status, guard};
use super::types::{fo_placement, fo_shard_info, shard_spec_from_parts};
use crate::error::{Error, Result};
use crate::shard::{grouped_placements, padded_shard_size};

/// The local shape, global offset, global shape and stride of the shard held at `coord`
/// (PyTorch 2.15's `compute_local_shape_and_global_offset`, uneven and strided shards
/// included). `placements` has `mesh_ndim` entries.
#[no_mangle]
pub unsafe extern "C" fn fo_wrap_uneven(
    ndim: i32,
    global_shape: *const i64,
    mesh_ndim: i32,
    mesh_shape: *const i64,
    coord: *const i64,
    placements: *const fo_placement,
    out: *mut fo_shard_info,
) -> fo_status {
    guard(|| {
        let spec =
            shard_spec_from_parts(ndim, global_shape, mesh_ndim, mesh_shape, coord, placements)?;
        *arg_mut(out, "out")? = spec.info().into();
        Ok(())
    })
}

/// The sorted global indices `coord` holds along tensor dim `dim`, written to `out`
/// (`capacity` entries). `*out_len` is always set to the count; when it exceeds
/// `capacity` nothing is written and FO_ERR_INVALID_ARGUMENT is returned.
#[no_mangle]
pub unsafe extern "C" fn fo_shard_indices(
    ndim: i32,
    global_shape: *const i64,
    mesh_ndim: i32,
    mesh_shape: *const i64,
    coord: *const i64,
    placements: *const fo_placement,
    dim: i32,
    out: *mut i64,
    capacity: i64,
    out_len: *mut i64,
) -> fo_status {
    guard(|| {
        let spec =
            shard_spec_from_parts(ndim, global_shape, mesh_ndim, mesh_shape, coord, placements)?;
        let out_len = arg_mut(out_len, "out_len")?;
        let runs = spec.runs(arg_count(dim as i64, "dim")?)?;
        let capacity = arg_count(capacity, "capacity")?;
        let n = runs.len();
        *out_len = n as i64;
        if n > capacity {
            let reason =
                format!("{capacity} is too small for the {n} indices held along dim {dim}");
            return Err(Error::invalid("capacity", reason));
        }
        runs.write_into(arg_slice_mut(out, n, "out")?);
        Ok(())
    })
}

/// FSDP2's padded shard size along the sharded dim: `ceil(len / world)` rows.
#[no_mangle]
pub unsafe extern "C" fn fo_padded_shard_size(len: i64, world: i64, out: *mut i64) -> fo_status {
    guard(|| {
        let n = padded_shard_size(arg_count(len, "len")?, arg_count(world, "world")?)?;
        *arg_mut(out, "out")? = n as i64;
        Ok(())
    })
}

/// The grouped-weight placement shift: writes to `out` the placements for a stacked
/// `(num_gemms, out, in)` tensor given those of one `(out, in)` weight: `Shard(d)` and
/// `_StridedShard(d, sf)` move to dim `d + 1`; others are unchanged. `out` may alias `placements`.
#[no_mangle]
pub unsafe extern "C" fn fo_grouped_placements(
    mesh_ndim: i32,
    placements: *const fo_placement,
    out: *mut fo_placement,
) -> fo_status {
    guard(|| {
        let n = super::args::arg_ndim(mesh_ndim, "mesh_ndim", true)?;
        // Copied, converted and shifted before `out` is written: it may alias `placements`.
        let src: Vec<fo_placement> = super::args::arg_slice(placements, n, "placements")?.to_vec();
        let dst = arg_slice_mut(out, n, "out")?;
        let src = src
            .iter()
            .enumerate()
            .map(|(i, p)| p.to_placement(&format!("placements[{i}]")))
            .collect::<Result<Vec<_>>>()?;
        let shifted: Vec<fo_placement> = grouped_placements(&src)?
            .into_iter()
            .map(fo_placement::from_placement)
            .collect();
        dst.copy_from_slice(&shifted);
        Ok(())
    })
}
