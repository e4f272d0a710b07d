//! Checking one rank's destinations against rank 0's table, before any data moves, and
//! the fingerprint ranks compare to agree on which keys move and how they are sharded.
use super::table::Table;
use super::{BroadcastDest, BroadcastOptions};
use crate::cast;
use crate::error::{Error, Result};
use crate::shard::{coord_to_rank, Placement, ShardSpec};

/// What this rank receives for one table entry.
pub(super) struct Plan {
    /// Index into the caller's destinations.
    pub dest: usize,
    /// `None`: the whole tensor.
    pub spec: Option<ShardSpec>,
}

/// One plan per table entry (`None` where this rank has no destination for the key).
pub(super) fn plan(
    rank: usize,
    world: usize,
    table: &Table,
    dests: &[BroadcastDest],
    opts: &BroadcastOptions,
) -> Result<Vec<Option<Plan>>> {
    let mut plans: Vec<Option<Plan>> = (0..table.0.len()).map(|_| None).collect();
    let mut order: Vec<usize> = (0..dests.len()).collect();
    order.sort_by(|&a, &b| dests[a].key.cmp(&dests[b].key));
    for i in order {
        let d = &dests[i];
        let k = &d.key;
        let Some(t) = table.find(k) else {
            return Err(Error::NotFound(format!(
                "key {k:?} has a destination but is not in rank 0's state dict ({} keys)",
                table.0.len()
            )));
        };
        if plans[t].is_some() {
            return Err(Error::invalid(
                format!("dests[{i}].key"),
                format!("key {k:?} has two destinations"),
            ));
        }
        let e = &table.0[t];
        let local_shape = match &d.spec {
            None => e.shape.clone(),
            Some(s) => {
                if s.global_shape() != e.shape.as_slice() {
                    return Err(Error::Shape(format!(
                        "key {k:?}: rank 0's tensor has shape {:?} but the destination's global shape is {:?}",
                        e.shape,
                        s.global_shape()
                    )));
                }
                let mesh_ranks: usize = s.mesh_shape().iter().product();
                if mesh_ranks != world {
                    return Err(Error::invalid(
                        format!("dests[{i}].spec.mesh_shape"),
                        format!(
                            "key {k:?}: mesh {:?} has {mesh_ranks} ranks but the group has {world}",
                            s.mesh_shape()
                        ),
                    ));
                }
                let at = coord_to_rank(s.coord(), s.mesh_shape());
                if at != rank {
                    return Err(Error::invalid(
                        format!("dests[{i}].spec.coord"),
                        format!("key {k:?}: coord {:?} is rank {at} of the mesh, but this is rank {rank}", s.coord()),
                    ));
                }
                s.local_shape()
            }
        };
        if d.tensor.shape() != local_shape.as_slice() {
            return Err(Error::Shape(format!(
                "key {k:?}: destination has shape {:?} but {} {:?}",
                d.tensor.shape(),
                if d.spec.is_some() {
                    "this rank's shard of rank 0's tensor is"
                } else {
                    "rank 0's tensor is"
                },
                local_shape
            )));
        }
        cast::check(e.dtype, d.tensor.dtype(), opts.allow_int_float_cast).map_err(
            |err| match err {
                Error::Dtype(m) => Error::Dtype(format!("key {k:?}: {m}")),
                other => other,
            },
        )?;
        plans[t] = Some(Plan {
            dest: i,
            spec: d.spec.clone(),
        });
    }
    Ok(plans)
}

/// A fingerprint of how this rank receives an entry: 0 for no destination, otherwise a
/// 52-bit hash (exact in an f64) of whole/sharded, mesh and placements, plus one.
pub(super) fn layout_fingerprint(p: &Option<Plan>) -> f64 {
    let Some(p) = p else { return 0.0 };
    let mut h = Fnv::default();
    match &p.spec {
        None => h.put(1),
        Some(s) => {
            h.put(2);
            for &m in s.mesh_shape() {
                h.put(m as u64);
            }
            for pl in s.placements() {
                match *pl {
                    Placement::Replicate => h.put(10),
                    Placement::Partial => h.put(11),
                    Placement::Shard(d) => {
                        h.put(12);
                        h.put(d as u64)
                    }
                    Placement::StridedShard { dim, split_factor } => {
                        h.put(13);
                        h.put(dim as u64);
                        h.put(split_factor as u64)
                    }
                }
            }
        }
    }
    ((h.0 & ((1u64 << 52) - 1)) + 1) as f64
}

struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn put(&mut self, x: u64) {
        for b in x.to_le_bytes() {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}
