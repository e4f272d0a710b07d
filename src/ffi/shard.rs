use super::args::{arg_count, arg_mut, arg_slice_mut};
use super::status::{fo_status, guard};
use super::types::{fo_placement, fo_shard_info, shard_spec_from_parts};
use crate::error::Error;
use crate::shard::padded_shard_size;

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
        let d = arg_count(dim as i64, "dim")?;
        if d >= spec.global_shape().len() {
            return Err(Error::invalid(
                "dim",
                format!("{dim} is outside a tensor with {ndim} dims"),
            ));
        }
        let capacity = arg_count(capacity, "capacity")?;
        let runs = spec.runs(d);
        let n = runs.len();
        *out_len = n as i64;
        if n > capacity {
            let reason = format!("{capacity} is too small for the {n} indices held along dim {d}");
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
        let len = arg_count(len, "len")?;
        let world = arg_count(world, "world")?;
        if world == 0 {
            return Err(Error::invalid("world", "must be >= 1, got 0"));
        }
        *arg_mut(out, "out")? = padded_shard_size(len, world) as i64;
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
        let src: Vec<fo_placement> = super::args::arg_slice(placements, n, "placements")?.to_vec();
        let dst = arg_slice_mut(out, n, "out")?;
        // Checked before anything is written: `out` may alias `placements`. The stacked
        // tensor has one more dim than the weight, so a shifted dim must stay below 8.
        let shifted = src
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let q = p.to_placement(&format!("placements[{i}]"))?;
                match q.shard_dim() {
                    Some(d) if d + 1 >= crate::tensor::MAX_DIMS => Err(Error::invalid(
                        format!("placements[{i}].dim"),
                        format!(
                            "{d}: the stacked tensor's dim {} would exceed FO_MAX_DIMS",
                            d + 1
                        ),
                    )),
                    _ => Ok(fo_placement::from_placement(q.shifted_for_grouped())),
                }
            })
            .collect::<crate::error::Result<Vec<_>>>()?;
        dst.copy_from_slice(&shifted);
        Ok(())
    })
}
