//! Packing: a rank's local state entries become named chunks with global shape and
//! offsets, computed locally from each entry's `ShardSpec` (no collectives).
use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};

use serde_json::Value;

use crate::ckpt::format::header::FoKey;
use crate::ckpt::format::naming::num_groups;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shard::{mesh_coords, Placement, ShardSpec};
use crate::tensor::{contiguous_strides, Tensor};

/// How an entry's local tensor relates to its global tensor.
#[derive(Debug, Clone, PartialEq)]
pub enum Layout {
    /// Element `i` of the local tensor is a global element (params, states, codes, step).
    Elementwise,
    /// quant8 scales of the codes under key `of`: `ceil(local_numel / 32)` fp16 values
    /// of this rank's local groups. Saved as one 1-D global tensor concatenating the
    /// scales of every owning coordinate of `of`, in rank order, so every rank computes
    /// its offset locally from the spec of `of`.
    GroupScales { of: String },
}

/// What is known about an entry before its data is fetched.
#[derive(Debug, Clone)]
pub struct EntryMeta {
    pub key: String,
    pub dtype: DType,
    pub local_shape: Vec<usize>,
    /// `None`: not sharded (every rank holds all of it, like torch's plain `step`).
    pub spec: Option<ShardSpec>,
    pub layout: Layout,
}

/// One local state entry with its data.
#[derive(Debug, Clone)]
pub struct StateEntry {
    pub meta: EntryMeta,
    pub tensor: Tensor,
}

impl StateEntry {
    /// An element-wise entry (`spec` None: unsharded).
    pub fn new(key: impl Into<String>, tensor: Tensor, spec: Option<ShardSpec>) -> StateEntry {
        let meta = EntryMeta {
            key: key.into(),
            dtype: tensor.dtype,
            local_shape: tensor.shape.clone(),
            spec,
            layout: Layout::Elementwise,
        };
        StateEntry { meta, tensor }
    }

    /// quant8 scales (fp16, `[ceil(numel/32)]`) of the codes entry `of`.
    pub fn group_scales(
        key: impl Into<String>,
        tensor: Tensor,
        of: impl Into<String>,
    ) -> StateEntry {
        let meta = EntryMeta {
            key: key.into(),
            dtype: tensor.dtype,
            local_shape: tensor.shape.clone(),
            spec: None,
            layout: Layout::GroupScales { of: of.into() },
        };
        StateEntry { meta, tensor }
    }
}

/// Who writes what.
#[derive(Debug, Clone)]
pub struct PackOptions {
    /// This process's rank in the world (names the file).
    pub rank: usize,
    pub world_size: usize,
    /// Whether this rank writes unsharded entries (held identically by every rank).
    /// `None`: rank 0 does. A host whose ranks hold different unsharded params (pipeline
    /// stages) sets it on one rank per stage.
    pub write_unsharded: Option<bool>,
    /// `"compressed"`, `"portable"` or `"raw"`: recorded for readers.
    pub mode: String,
    /// torch-style `param_groups` (hyper-parameters), stored as JSON.
    pub param_groups: Value,
    /// Anything else the host wants to keep with the checkpoint.
    pub extra: Value,
    /// Identical on every rank of one save (a step number, a UUID); a directory whose
    /// files carry different ids is refused on load. Empty: no check.
    pub save_id: String,
    /// Keep keys whose global tensor holds no element: the coordinate at 0 writes one
    /// empty tensor for each (torch's DCP writes them too), so the key survives. Off by
    /// default: the optimizer drops empty params. `fo ckpt convert` sets it, so a
    /// converted checkpoint holds every key of its source.
    pub keep_empty_keys: bool,
}

impl PackOptions {
    pub fn new(rank: usize, world_size: usize) -> PackOptions {
        PackOptions {
            rank,
            world_size,
            write_unsharded: None,
            mode: "raw".into(),
            param_groups: Value::Array(vec![]),
            extra: Value::Null,
            save_id: String::new(),
            keep_empty_keys: false,
        }
    }
}

/// One chunk to write: a box of an entry's local tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkMeta {
    /// Tensor name in the file: always the key (torch's DCP reader knows no other name).
    pub name: String,
    /// Which of the rank's files holds it: box `j` of a strided shard goes to part `j`
    /// (`format::part_file_name`), so no file holds a key twice.
    pub part: usize,
    pub key: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub global_shape: Vec<usize>,
    pub global_offset: Vec<usize>,
    /// Index of the entry it comes from, and where the box starts in its local tensor.
    pub entry: usize,
    pub local_offset: Vec<usize>,
}

/// Everything a rank will write, before any data is touched.
#[derive(Debug, Clone)]
pub struct Plan {
    pub chunks: Vec<ChunkMeta>,
    pub keys: BTreeMap<String, FoKey>,
}

/// True when the coordinate of `spec` writes its shard: it sits at 0 on every mesh dim
/// that does not split the tensor (Replicate, Partial), so each distinct shard is
/// written once. A DTensor on a sub-mesh is described on the world mesh with
/// `Replicate` on the other dims, which gives the same rule.
pub(crate) fn is_owner(spec: &ShardSpec) -> bool {
    spec.placements()
        .iter()
        .zip(spec.coord())
        .all(|(p, &c)| p.shard_dim().is_some() || c == 0)
}

/// The coordinates that own a shard, in rank order.
pub(crate) fn owner_coords(spec: &ShardSpec) -> Vec<ShardSpec> {
    mesh_coords(spec.mesh_shape())
        .into_iter()
        .map(|c| spec.at_coord(c).unwrap())
        .filter(is_owner)
        .collect()
}

/// Where the owner at `spec`'s coordinate puts its scales in the 1-D scales tensor, and
/// that tensor's length: prefix sums of every owner's group count, in rank order.
pub(crate) fn scales_offset(spec: &ShardSpec) -> (usize, usize) {
    let mut before = 0;
    let mut total = 0;
    for c in owner_coords(spec) {
        let g = num_groups(c.local_numel());
        if c.coord() < spec.coord() {
            before += g;
        }
        total += g;
    }
    (before, total)
}

/// The compact spelling `Placement::from_str` parses (`R`, `P`, `S0`, `SS0:2`).
pub(crate) fn placement_code(p: &Placement) -> String {
    match *p {
        Placement::Replicate => "R".into(),
        Placement::Partial => "P".into(),
        Placement::Shard(d) => format!("S{d}"),
        Placement::StridedShard { dim, split_factor } => format!("SS{dim}:{split_factor}"),
    }
}

fn placement_names(spec: &Option<ShardSpec>) -> (Vec<usize>, Vec<String>) {
    match spec {
        Some(s) => (
            s.mesh_shape().to_vec(),
            s.placements().iter().map(placement_code).collect(),
        ),
        None => (vec![1], vec!["R".into()]),
    }
}

/// Decides the chunks this rank writes. Entries with a repeated key are packed once;
/// entries with no elements, and shards another coordinate writes, produce no chunk.
pub(crate) fn plan(entries: &[EntryMeta], opts: &PackOptions) -> Result<Plan> {
    let write_unsharded = opts.write_unsharded.unwrap_or(opts.rank == 0);
    let by_key: BTreeMap<&str, &EntryMeta> =
        entries.iter().rev().map(|e| (e.key.as_str(), e)).collect();
    let mut seen = HashSet::new();
    let mut chunks = Vec::new();
    let mut keys = BTreeMap::new();
    for (i, e) in entries.iter().enumerate() {
        if !seen.insert(e.key.as_str()) {
            continue;
        }
        let expect = e.spec.as_ref().map(ShardSpec::local_shape);
        if let Some(s) = &expect {
            if *s != e.local_shape {
                return Err(Error::Shape(format!(
                    "key {}: local tensor has shape {:?} but its shard spec gives local shape {s:?}",
                    e.key, e.local_shape
                )));
            }
        }
        let mut fo_key = FoKey {
            mesh: vec![1],
            placements: vec!["R".into()],
            group_scales_of: None,
        };
        match &e.layout {
            Layout::Elementwise => {
                (fo_key.mesh, fo_key.placements) = placement_names(&e.spec);
                let (owner, global_shape, boxes) = match &e.spec {
                    Some(s) if opts.keep_empty_keys && s.global_shape().contains(&0) => (
                        s.coord().iter().all(|&c| c == 0),
                        s.global_shape().to_vec(),
                        vec![empty_box(s.global_shape())],
                    ),
                    Some(s) => (is_owner(s), s.global_shape().to_vec(), s.chunks()),
                    None if opts.keep_empty_keys && e.local_shape.contains(&0) => (
                        write_unsharded,
                        e.local_shape.clone(),
                        vec![empty_box(&e.local_shape)],
                    ),
                    None => {
                        let whole = crate::shard::Chunk {
                            local_offset: vec![0; e.local_shape.len()],
                            global_offset: vec![0; e.local_shape.len()],
                            shape: e.local_shape.clone(),
                        };
                        let boxes = if e.local_shape.iter().product::<usize>() == 0 {
                            vec![]
                        } else {
                            vec![whole]
                        };
                        (write_unsharded, e.local_shape.clone(), boxes)
                    }
                };
                if !owner {
                    continue;
                }
                for (j, b) in boxes.into_iter().enumerate() {
                    chunks.push(ChunkMeta {
                        name: e.key.clone(),
                        part: j,
                        key: e.key.clone(),
                        dtype: e.dtype,
                        shape: b.shape,
                        global_shape: global_shape.clone(),
                        global_offset: b.global_offset,
                        entry: i,
                        local_offset: b.local_offset,
                    });
                }
            }
            Layout::GroupScales { of } => {
                let codes = by_key.get(of.as_str()).ok_or_else(|| {
                    Error::invalid(
                        "entries",
                        format!(
                            "scales {} refer to codes key {of} which is not packed",
                            e.key
                        ),
                    )
                })?;
                let spec = match &codes.spec {
                    Some(s) => s.clone(),
                    None => ShardSpec::unsharded(codes.local_shape.clone())?,
                };
                let g = num_groups(codes.local_shape.iter().product());
                if e.local_shape != [g] {
                    return Err(Error::Shape(format!(
                        "key {}: {g} quant8 groups expected for the {:?} codes of {of}, got scales of shape {:?}",
                        e.key, codes.local_shape, e.local_shape
                    )));
                }
                (fo_key.mesh, fo_key.placements) = placement_names(&codes.spec);
                fo_key.group_scales_of = Some(of.clone());
                let owner = if codes.spec.is_some() {
                    is_owner(&spec)
                } else {
                    write_unsharded
                };
                let (offset, total) = scales_offset(&spec);
                let keep =
                    opts.keep_empty_keys && total == 0 && spec.coord().iter().all(|&c| c == 0);
                if owner && (g > 0 || keep) {
                    chunks.push(ChunkMeta {
                        name: e.key.clone(),
                        part: 0,
                        key: e.key.clone(),
                        dtype: e.dtype,
                        shape: vec![g],
                        global_shape: vec![total],
                        global_offset: vec![offset],
                        entry: i,
                        local_offset: vec![0],
                    });
                }
            }
        }
        keys.insert(e.key.clone(), fo_key);
    }
    Ok(Plan { chunks, keys })
}

/// The one box of a key with no element: its whole (empty) global shape at offset 0.
fn empty_box(shape: &[usize]) -> crate::shard::Chunk {
    crate::shard::Chunk {
        local_offset: vec![0; shape.len()],
        global_offset: vec![0; shape.len()],
        shape: shape.to_vec(),
    }
}

/// The bytes of one chunk: borrowed when it is the whole local tensor, else gathered.
pub(crate) fn chunk_bytes<'a>(c: &ChunkMeta, local: &'a Tensor) -> Cow<'a, [u8]> {
    if c.shape == local.shape {
        return Cow::Borrowed(&local.data);
    }
    let es = local.dtype.size();
    let strides = contiguous_strides(&local.shape);
    let nd = c.shape.len();
    let row = c.shape[nd - 1] * es;
    let rows: usize = c.shape[..nd - 1].iter().product();
    let mut out = Vec::with_capacity(rows * row);
    let mut idx = vec![0usize; nd - 1];
    for _ in 0..rows {
        let mut at = c.local_offset[nd - 1];
        for d in 0..nd - 1 {
            at += (c.local_offset[d] + idx[d]) * strides[d];
        }
        out.extend_from_slice(&local.data[at * es..at * es + row]);
        for d in (0..nd - 1).rev() {
            idx[d] += 1;
            if idx[d] < c.shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Cow::Owned(out)
}

/// A rank's packed state, data included: what `fo_state_pack` hands to a host.
#[derive(Debug, Clone)]
pub struct Packed {
    pub opts: PackOptions,
    pub plan: Plan,
    pub entries: Vec<Tensor>,
    /// Chunk bytes gathered at pack time for chunks that are not a whole local tensor.
    gathered: Vec<Option<Vec<u8>>>,
}

impl Packed {
    pub fn new(entries: Vec<StateEntry>, opts: PackOptions) -> Result<Packed> {
        let metas: Vec<EntryMeta> = entries.iter().map(|e| e.meta.clone()).collect();
        let plan = plan(&metas, &opts)?;
        let tensors: Vec<Tensor> = entries.into_iter().map(|e| e.tensor).collect();
        let gathered = plan
            .chunks
            .iter()
            .map(|c| match chunk_bytes(c, &tensors[c.entry]) {
                Cow::Borrowed(_) => None,
                Cow::Owned(v) => Some(v),
            })
            .collect();
        Ok(Packed {
            opts,
            plan,
            entries: tensors,
            gathered,
        })
    }

    /// What fo stores with this state besides the tensors (the `fo` metadata, without
    /// per-tensor checksums): a host writing the chunks itself keeps this with them.
    pub fn metadata_json(&self) -> Value {
        serde_json::json!({
            "fo_version": crate::VERSION, "rank": self.opts.rank, "world_size": self.opts.world_size,
            "mode": self.opts.mode, "save_id": self.opts.save_id, "param_groups": self.opts.param_groups,
            "keys": self.plan.keys,
        })
    }

    /// Chunk `i`'s bytes; an `i` past the chunks is an error naming `index`.
    pub fn chunk_data(&self, i: usize) -> Result<&[u8]> {
        let n = self.plan.chunks.len();
        if i >= n {
            let why = format!("{i} is out of range ({n} entries)");
            return Err(Error::invalid("index", why));
        }
        Ok(match &self.gathered[i] {
            Some(v) => v,
            None => &self.entries[self.plan.chunks[i].entry].data,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Placement::*;

    fn spec(shape: &[usize], mesh: &[usize], coord: &[usize], pl: &[Placement]) -> ShardSpec {
        ShardSpec::new(shape.to_vec(), mesh.to_vec(), coord.to_vec(), pl.to_vec()).unwrap()
    }

    #[test]
    fn replicated_shards_are_written_by_one_coordinate() {
        let pl = [Shard(0), Replicate];
        assert!(is_owner(&spec(&[4], &[2, 2], &[1, 0], &pl)));
        assert!(!is_owner(&spec(&[4], &[2, 2], &[1, 1], &pl)));
    }

    #[test]
    fn scales_offsets_are_prefix_sums_over_owners() {
        let s = spec(&[10, 33], &[3], &[2], &[Shard(0)]);
        // local rows 4,4,2 -> 132,132,66 elements -> 5,5,3 groups
        assert_eq!(scales_offset(&s), (10, 13));
    }

    #[test]
    fn strided_shard_packs_one_chunk_per_box_each_in_its_own_part() {
        let s = spec(
            &[10, 2],
            &[2],
            &[1],
            &[StridedShard {
                dim: 0,
                split_factor: 2,
            }],
        );
        let t = Tensor::from_f32(vec![4, 2], &[3., 3., 4., 4., 8., 8., 9., 9.]).unwrap();
        let p = Packed::new(
            vec![StateEntry::new("w", t, Some(s))],
            PackOptions::new(1, 2),
        )
        .unwrap();
        let names: Vec<(&str, usize)> = p
            .plan
            .chunks
            .iter()
            .map(|c| (c.name.as_str(), c.part))
            .collect();
        assert_eq!(names, vec![("w", 0), ("w", 1)]);
        assert_eq!(p.plan.chunks[1].global_offset, vec![8, 0]);
        let e = p.chunk_data(2).unwrap_err().to_string();
        assert_eq!(e, "invalid argument `index`: 2 is out of range (2 entries)");
        let second: Vec<f32> = p
            .chunk_data(1)
            .unwrap()
            .chunks(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(second, vec![8., 8., 9., 9.]);
    }

    #[test]
    fn duplicate_keys_and_empty_entries_produce_no_extra_chunk() {
        let t = Tensor::from_f32(vec![2], &[1., 2.]).unwrap();
        let e = Tensor::zeros(DType::F32, vec![0, 4]);
        let entries = vec![
            StateEntry::new("a", t.clone(), None),
            StateEntry::new("a", t, None),
            StateEntry::new("empty", e, None),
        ];
        let p = Packed::new(entries, PackOptions::new(0, 1)).unwrap();
        assert_eq!(p.plan.chunks.len(), 1);
    }

    #[test]
    fn keep_empty_keys_writes_one_empty_tensor_from_coordinate_zero() {
        let e = Tensor::zeros(DType::F32, vec![0, 4]);
        for rank in 0..2 {
            let s = spec(&[0, 4], &[2], &[rank], &[Shard(0)]);
            let mut o = PackOptions::new(rank, 2);
            o.keep_empty_keys = true;
            let p = Packed::new(vec![StateEntry::new("empty", e.clone(), Some(s))], o).unwrap();
            assert_eq!(p.plan.chunks.len(), usize::from(rank == 0), "rank {rank}");
            if rank == 0 {
                assert_eq!(p.plan.chunks[0].shape, vec![0, 4]);
            }
        }
    }
}
