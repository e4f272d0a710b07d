//! `ShardSpec`: one mesh coordinate's shard of a DTensor, validated at construction,
//! and what follows from it (runs per dim, local shape, offsets, boxes).
use super::placement::Placement;
use super::runs::Runs;
use crate::error::{Error, Result};
use crate::tensor::{checked_numel, contiguous_strides, MAX_DIMS};

/// The most contiguous boxes one shard may be cut into (the product over dims of the
/// runs each dim may hold). Boxes are materialized (`chunks`, checkpoint entries), so this
/// bounds memory and time; FSDP2 over TP needs a few per dim.
pub const MAX_BOXES: usize = 1 << 20;

/// An upper bound on the runs dim `d` of any coordinate holds: each `_StridedShard` on it
/// adds at most one run per non-empty piece, and at most `global_shape[d]` pieces are
/// non-empty whatever the split factor.
fn max_runs(global_shape: &[usize], placements: &[Placement], d: usize) -> usize {
    placements.iter().fold(1usize, |acc, p| match *p {
        Placement::StridedShard { dim, split_factor } if dim == d => {
            acc.saturating_add(split_factor.min(global_shape[d]))
        }
        _ => acc,
    })
}

/// Where one mesh coordinate's shard of a global tensor lies: the DTensor metadata
/// `(global_shape, mesh, coord, placements)`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardSpec {
    global_shape: Vec<usize>,
    mesh_shape: Vec<usize>,
    coord: Vec<usize>,
    placements: Vec<Placement>,
}

/// One contiguous box of a shard: where it sits in the local tensor and in the global one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub local_offset: Vec<usize>,
    pub global_offset: Vec<usize>,
    pub shape: Vec<usize>,
}

/// What `fo_wrap_uneven` reports (PyTorch 2.15 `compute_local_shape_and_global_offset`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardInfo {
    pub local_shape: Vec<usize>,
    pub global_offset: Vec<usize>,
    pub global_shape: Vec<usize>,
    pub global_stride: Vec<usize>,
    pub is_box: bool,
}

impl ShardSpec {
    /// Validates everything `fo_wrap_uneven` rejects: ranks of shape and mesh, coordinates
    /// inside the mesh, shard dims inside the tensor, split factors >= 1.
    pub fn new(
        global_shape: Vec<usize>,
        mesh_shape: Vec<usize>,
        coord: Vec<usize>,
        placements: Vec<Placement>,
    ) -> Result<ShardSpec> {
        if global_shape.len() > MAX_DIMS {
            return Err(Error::invalid(
                "ndim",
                format!(
                    "{} tensor dims given, at most {MAX_DIMS} supported",
                    global_shape.len()
                ),
            ));
        }
        if mesh_shape.is_empty() || mesh_shape.len() > MAX_DIMS {
            return Err(Error::invalid(
                "mesh_ndim",
                format!(
                    "{} mesh dims given, expected 1..={MAX_DIMS}",
                    mesh_shape.len()
                ),
            ));
        }
        if coord.len() != mesh_shape.len() || placements.len() != mesh_shape.len() {
            return Err(Error::invalid(
                "coord/placements",
                format!(
                    "mesh has {} dims but {} coords and {} placements were given",
                    mesh_shape.len(),
                    coord.len(),
                    placements.len()
                ),
            ));
        }
        for (i, (&m, &c)) in mesh_shape.iter().zip(&coord).enumerate() {
            if m == 0 {
                return Err(Error::invalid(
                    format!("mesh_shape[{i}]"),
                    "mesh dim of size 0",
                ));
            }
            if c >= m {
                return Err(Error::invalid(
                    format!("coord[{i}]"),
                    format!("{c} is outside mesh dim {i} of size {m}"),
                ));
            }
        }
        for (i, p) in placements.iter().enumerate() {
            if let Some(d) = p.shard_dim() {
                if d >= global_shape.len() {
                    return Err(Error::invalid(
                        format!("placements[{i}].dim"),
                        format!("{p} on a tensor with {} dims", global_shape.len()),
                    ));
                }
            }
            if let Placement::StridedShard {
                split_factor: 0, ..
            } = p
            {
                return Err(Error::invalid(
                    format!("placements[{i}].split_factor"),
                    "must be >= 1, got 0",
                ));
            }
        }
        checked_numel(&global_shape, "global_shape")
            .ok()
            .filter(|&n| n <= i64::MAX as usize)
            .ok_or_else(|| {
                Error::invalid(
                    "global_shape",
                    format!("{global_shape:?} has more than 2^63-1 elements"),
                )
            })?;
        let boxes = (0..global_shape.len()).try_fold(1usize, |acc, d| {
            acc.checked_mul(max_runs(&global_shape, &placements, d))
        });
        if boxes.is_none_or(|b| b > MAX_BOXES) {
            return Err(Error::invalid(
                "placements",
                format!("split factors that may cut a shard of {global_shape:?} into more than {MAX_BOXES} boxes"),
            ));
        }
        Ok(ShardSpec {
            global_shape,
            mesh_shape,
            coord,
            placements,
        })
    }

    /// A tensor that is not sharded: one coordinate holding everything.
    pub fn unsharded(global_shape: Vec<usize>) -> Result<ShardSpec> {
        ShardSpec::new(global_shape, vec![1], vec![0], vec![Placement::Replicate])
    }

    /// The same tensor and placements at another mesh coordinate.
    pub fn at_coord(&self, coord: Vec<usize>) -> Result<ShardSpec> {
        ShardSpec::new(
            self.global_shape.clone(),
            self.mesh_shape.clone(),
            coord,
            self.placements.clone(),
        )
    }

    /// The grouped-weight form: the same placements applied to `num_gemms` stacked copies,
    /// so `Shard(d)` becomes `Shard(d+1)` and the global shape gains a leading dim.
    pub fn grouped(&self, num_gemms: usize) -> Result<ShardSpec> {
        let mut shape = vec![num_gemms];
        shape.extend_from_slice(&self.global_shape);
        let placements = super::placement::grouped_placements(&self.placements)?;
        ShardSpec::new(
            shape,
            self.mesh_shape.clone(),
            self.coord.clone(),
            placements,
        )
    }

    pub fn global_shape(&self) -> &[usize] {
        &self.global_shape
    }
    pub fn mesh_shape(&self) -> &[usize] {
        &self.mesh_shape
    }
    pub fn coord(&self) -> &[usize] {
        &self.coord
    }
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }

    /// Whether any placement splits tensor dim `dim`.
    pub fn is_sharded_dim(&self, dim: usize) -> bool {
        self.placements.iter().any(|p| p.shard_dim() == Some(dim))
    }

    /// The global indices held along `dim`, in local storage order, as runs.
    /// Mesh dims apply in order, each splitting what the previous ones left. A `dim`
    /// outside the tensor is an error naming `dim`.
    pub fn runs(&self, dim: usize) -> Result<Runs> {
        if dim >= self.global_shape.len() {
            return Err(Error::invalid(
                "dim",
                format!(
                    "{dim} is outside a tensor with {} dims",
                    self.global_shape.len()
                ),
            ));
        }
        Ok(self.dim_runs(dim))
    }

    /// `runs` for the loops over `0..ndim` here and in the crate (unchecked).
    pub(crate) fn dim_runs(&self, dim: usize) -> Runs {
        let mut runs = Runs::full(self.global_shape[dim]);
        for ((p, &n), &c) in self
            .placements
            .iter()
            .zip(&self.mesh_shape)
            .zip(&self.coord)
        {
            runs = match *p {
                Placement::Shard(d) if d == dim => runs.shard(n, c),
                Placement::StridedShard {
                    dim: d,
                    split_factor,
                } if d == dim => runs.strided_shard(split_factor, n, c),
                _ => runs,
            };
        }
        runs
    }

    /// How many global indices are held along `dim`, without listing them.
    pub fn count(&self, dim: usize) -> usize {
        self.dim_runs(dim).len()
    }

    /// The global indices held along `dim`, ascending.
    pub fn indices(&self, dim: usize) -> Vec<usize> {
        self.dim_runs(dim).to_vec()
    }

    pub fn local_shape(&self) -> Vec<usize> {
        (0..self.global_shape.len())
            .map(|d| self.dim_runs(d).len())
            .collect()
    }

    pub fn local_numel(&self) -> usize {
        self.local_shape().iter().product()
    }

    /// PyTorch 2.15's global offset: the first global index held; for a coordinate that
    /// holds nothing along a sharded dim, the sentinel `global_shape[d]`.
    pub fn global_offset(&self) -> Vec<usize> {
        (0..self.global_shape.len())
            .map(|d| match self.dim_runs(d).first() {
                Some(i) => i,
                None if self.is_sharded_dim(d) => self.global_shape[d],
                None => 0,
            })
            .collect()
    }

    /// True when the shard is one contiguous box of the global tensor (every dim one run).
    pub fn is_box(&self) -> bool {
        (0..self.global_shape.len()).all(|d| self.dim_runs(d).0.len() <= 1)
    }

    pub fn info(&self) -> ShardInfo {
        ShardInfo {
            local_shape: self.local_shape(),
            global_offset: self.global_offset(),
            global_shape: self.global_shape.clone(),
            global_stride: contiguous_strides(&self.global_shape),
            is_box: self.is_box(),
        }
    }

    /// The shard as contiguous boxes (the Cartesian product of each dim's runs), in local
    /// row-major order. A box shard gives one chunk; an empty shard gives none.
    pub fn chunks(&self) -> Vec<Chunk> {
        let per_dim: Vec<Vec<(usize, std::ops::Range<usize>)>> = (0..self.global_shape.len())
            .map(|d| {
                let mut local = 0;
                self.dim_runs(d)
                    .0
                    .into_iter()
                    .map(|r| {
                        let at = local;
                        local += r.len();
                        (at, r)
                    })
                    .collect()
            })
            .collect();
        if per_dim.iter().any(|v| v.is_empty()) {
            return vec![];
        }
        let mut out = Vec::new();
        let mut pick = vec![0usize; per_dim.len()];
        loop {
            let parts: Vec<&(usize, std::ops::Range<usize>)> =
                pick.iter().zip(&per_dim).map(|(&i, v)| &v[i]).collect();
            out.push(Chunk {
                local_offset: parts.iter().map(|p| p.0).collect(),
                global_offset: parts.iter().map(|p| p.1.start).collect(),
                shape: parts.iter().map(|p| p.1.len()).collect(),
            });
            let mut d = per_dim.len();
            loop {
                if d == 0 {
                    return out;
                }
                d -= 1;
                pick[d] += 1;
                if pick[d] < per_dim[d].len() {
                    break;
                }
                pick[d] = 0;
            }
        }
    }
}

/// Every coordinate of a mesh, in row-major (rank) order.
pub fn mesh_coords(mesh_shape: &[usize]) -> Vec<Vec<usize>> {
    let world: usize = mesh_shape.iter().product();
    (0..world).map(|r| rank_to_coord(r, mesh_shape)).collect()
}

/// The coordinate of `rank` in a row-major mesh (`arange(world).view(mesh_shape)`).
pub fn rank_to_coord(rank: usize, mesh_shape: &[usize]) -> Vec<usize> {
    let mut c = vec![0; mesh_shape.len()];
    let mut r = rank;
    for d in (0..mesh_shape.len()).rev() {
        c[d] = r % mesh_shape[d];
        r /= mesh_shape[d];
    }
    c
}

/// The rank of a coordinate in a row-major mesh.
pub fn coord_to_rank(coord: &[usize], mesh_shape: &[usize]) -> usize {
    coord
        .iter()
        .zip(mesh_shape)
        .fold(0, |acc, (&c, &m)| acc * m + c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Placement::*;

    fn spec(shape: &[usize], mesh: &[usize], coord: &[usize], pl: &[Placement]) -> ShardSpec {
        ShardSpec::new(shape.to_vec(), mesh.to_vec(), coord.to_vec(), pl.to_vec()).unwrap()
    }

    #[test]
    fn empty_shard_reports_the_torch_sentinel_offset() {
        // (6,) over 4 ranks: rank 3 holds nothing, offset 6.
        let s = spec(&[6], &[4], &[3], &[Shard(0)]);
        assert_eq!(s.local_shape(), vec![0]);
        assert_eq!(s.global_offset(), vec![6]);
        assert!(s.chunks().is_empty());
    }

    #[test]
    fn strided_shard_is_not_a_box_and_splits_into_chunks() {
        let s = spec(
            &[10, 7],
            &[2],
            &[1],
            &[StridedShard {
                dim: 0,
                split_factor: 2,
            }],
        );
        assert!(!s.is_box());
        let chunks = s.chunks();
        assert_eq!(chunks.len(), 2);
        assert_eq!(
            chunks[1],
            Chunk {
                local_offset: vec![2, 0],
                global_offset: vec![8, 0],
                shape: vec![2, 7]
            }
        );
    }

    #[test]
    fn fsdp_over_tp_rows_are_contiguous() {
        // [StridedShard(0, sf=2), Shard(0)] on a (2,2) mesh: each rank's rows form one box.
        let pl = [
            StridedShard {
                dim: 0,
                split_factor: 2,
            },
            Shard(0),
        ];
        for c in mesh_coords(&[2, 2]) {
            assert!(spec(&[10, 6], &[2, 2], &c, &pl).is_box(), "{c:?}");
        }
    }

    #[test]
    fn grouped_weight_moves_the_shard_dim() {
        let g = spec(&[10, 6], &[3], &[1], &[Shard(0)]).grouped(4).unwrap();
        assert_eq!(g.global_shape(), &[4, 10, 6]);
        assert_eq!(g.local_shape(), vec![4, 4, 6]);
        assert_eq!(g.global_offset(), vec![0, 4, 0]);
    }

    #[test]
    fn rank_and_coord_round_trip() {
        for r in 0..24 {
            assert_eq!(coord_to_rank(&rank_to_coord(r, &[2, 3, 4]), &[2, 3, 4]), r);
        }
        assert_eq!(rank_to_coord(5, &[2, 3]), vec![1, 2]);
    }

    #[test]
    fn invalid_specs_name_the_bad_field() {
        let e = ShardSpec::new(vec![4], vec![2], vec![2], vec![Shard(0)]).unwrap_err();
        assert!(e.to_string().contains("coord[0]"), "{e}");
        let e = ShardSpec::new(vec![4], vec![0], vec![0], vec![Shard(0)]).unwrap_err();
        assert!(e.to_string().contains("mesh_shape[0]"), "{e}");
        let e = ShardSpec::new(vec![4], vec![2], vec![0], vec![Shard(1)]).unwrap_err();
        assert!(e.to_string().contains("placements[0].dim"), "{e}");
        let e = ShardSpec::new(
            vec![4],
            vec![2],
            vec![0],
            vec![StridedShard {
                dim: 0,
                split_factor: 0,
            }],
        )
        .unwrap_err();
        assert!(e.to_string().contains("split_factor"), "{e}");
        let e = ShardSpec::new(vec![1; 9], vec![1], vec![0], vec![Replicate]).unwrap_err();
        assert!(e.to_string().contains("at most 8"), "{e}");
        let e =
            ShardSpec::new(vec![usize::MAX / 2, 4], vec![1], vec![0], vec![Replicate]).unwrap_err();
        assert!(e.to_string().contains("2^63-1 elements"), "{e}");
        let e = spec(&[4, 2], &[2], &[0], &[Shard(0)]).runs(2).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid argument `dim`: 2 is outside a tensor with 2 dims"
        );
    }

    #[test]
    fn huge_split_factors_cost_the_dim_not_the_factor() {
        let sf = i32::MAX as usize;
        let s = spec(
            &[5, 3],
            &[2],
            &[1],
            &[StridedShard {
                dim: 0,
                split_factor: sf,
            }],
        );
        assert_eq!(s.local_shape(), vec![0, 3]);
        let s = spec(
            &[5, 3],
            &[2],
            &[0],
            &[StridedShard {
                dim: 0,
                split_factor: sf,
            }],
        );
        assert_eq!(s.indices(0), vec![0, 1, 2, 3, 4]);
        // A long dim with a huge factor would be cut into ~2^31 boxes: refused.
        let e = ShardSpec::new(
            vec![1 << 40],
            vec![2],
            vec![0],
            vec![StridedShard {
                dim: 0,
                split_factor: sf,
            }],
        )
        .unwrap_err();
        assert!(e.to_string().contains("boxes"), "{e}");
        let s = spec(&[1 << 62, 1], &[1], &[0], &[Shard(0)]);
        assert_eq!(s.count(0), 1 << 62);
    }
}
