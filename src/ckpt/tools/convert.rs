//! The offline converter: reshard a checkpoint onto another world size or mesh and/or change
//! its moments' format, through the reader and the streaming writer (one entry in memory).
//!
//! Every key with at least one dim is sharded over the new mesh with the given placements
//! (default `Shard(0)` on every mesh dim; a placement naming a dim a key lacks becomes
//! `Replicate` for that key, a dim no key has is refused); 0-dim keys (`step`) are saved
//! once, keys with no element are kept. quant8 moments saved in another sharding are
//! requantized in the new groups (`load/quant.rs` bounds the error) and reported. [`convert`]
//! writes into a staging directory beside DST and renames it (`output.rs`): DST appears
//! whole or not at all; the written checkpoint must hold exactly the expected keys.
use std::collections::BTreeSet;
use std::path::Path;

use crate::ckpt::format::naming::{
    codes_key, moment_signed, num_groups, scales_key, split_part, Part,
};
use crate::ckpt::load::quant::Quant8;
use crate::ckpt::load::reader::Checkpoint;
use crate::ckpt::save::pack::{placement_code, EntryMeta, Layout, PackOptions};
use crate::ckpt::save::writer::save_streaming;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shard::{rank_to_coord, Placement, ShardSpec};
use crate::tensor::Tensor;

/// The largest world size the converter writes (the in-process group's).
pub(crate) const MAX_RANKS: usize = crate::comm::MAX_LOCAL_WORLD;

/// The format of the moments in DST.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// f32 moments (`exp_avg`, `exp_avg_sq`, `momentum_buffer`): what torch loads.
    Portable,
    /// quant8 moments: int8/uint8 codes + fp16 scales per 32 elements.
    Compressed,
}

/// How callers spell the options in errors (`ranks` for C and Python, `--ranks` for the CLI).
#[derive(Debug, Clone, Copy)]
pub struct OptionNames {
    pub ranks: &'static str,
    pub mesh: &'static str,
    pub placements: &'static str,
}

impl Default for OptionNames {
    fn default() -> Self {
        OptionNames {
            ranks: "ranks",
            mesh: "mesh",
            placements: "placements",
        }
    }
}

/// What to write.
#[derive(Debug, Clone, Default)]
pub struct ConvertOptions {
    /// The moments' format in DST (None: as in SRC).
    pub to: Option<Format>,
    /// World size of DST, 1..=[`MAX_LOCAL_WORLD`](crate::comm::MAX_LOCAL_WORLD) (None:
    /// SRC's, or the product of `mesh`).
    pub ranks: Option<usize>,
    /// Mesh shape of DST (None: `[ranks]`); its product is
    /// 1..=[`MAX_LOCAL_WORLD`](crate::comm::MAX_LOCAL_WORLD).
    pub mesh: Option<Vec<usize>>,
    /// One placement per mesh dim (None: `Shard(0)` on every dim).
    pub placements: Option<Vec<Placement>>,
    /// Replace a non-empty DST.
    pub force: bool,
    pub names: OptionNames,
}

/// One key of DST.
struct Item {
    key: String,
    dtype: DType,
    shape: Vec<usize>,
    /// Written as quant8 codes + scales (`Some(signed)`) or as plain values.
    quant: Option<bool>,
    /// Read from SRC's compressed pair (dequantized when written plain).
    src_compressed: bool,
}

/// What [`write()`] will write: checked against SRC, before anything is created.
pub struct Plan {
    items: Vec<Item>,
    pub mesh: Vec<usize>,
    pub placements: Vec<Placement>,
    /// The raw keys DST must hold.
    pub keys: BTreeSet<String>,
    to: Option<Format>,
}

/// What was written.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    pub keys: usize,
    pub world: usize,
    pub mesh: Vec<usize>,
    pub placements: Vec<Placement>,
    /// `compressed` when any moment is written as quant8, else `portable`.
    pub mode: &'static str,
    /// Compressed keys requantized because DST's groups are not SRC's, by base name.
    pub requantized: Vec<String>,
}

fn items(ck: &Checkpoint, to: Option<Format>) -> Vec<Item> {
    let mut out = Vec::new();
    for (k, info) in &ck.keys {
        match split_part(k).filter(|(b, _)| ck.is_compressed(b)) {
            Some((base, Part::Codes)) => out.push(Item {
                key: base.to_string(),
                dtype: DType::F32,
                shape: info.global_shape.clone(),
                quant: (to != Some(Format::Portable)).then_some(info.dtype == DType::I8),
                src_compressed: true,
            }),
            Some((_, Part::Scales)) => {}
            None => {
                let name = k.rsplit('.').next().unwrap_or(k);
                let quant = match moment_signed(name) {
                    Some(s) if to == Some(Format::Compressed) && info.dtype == DType::F32 => {
                        Some(s)
                    }
                    _ => None,
                };
                out.push(Item {
                    key: k.clone(),
                    dtype: info.dtype,
                    shape: info.global_shape.clone(),
                    quant,
                    src_compressed: false,
                });
            }
        }
    }
    out
}

/// `shape`'s shard at `coord` of the new mesh (None: 0-dim, saved once).
fn spec_for(
    shape: &[usize],
    mesh: &[usize],
    coord: &[usize],
    placements: &[Placement],
) -> Result<Option<ShardSpec>> {
    if shape.is_empty() {
        return Ok(None);
    }
    let fits = |d: usize| d < shape.len();
    let pl: Vec<Placement> = placements
        .iter()
        .map(|p| match p {
            Placement::Shard(d) | Placement::StridedShard { dim: d, .. } if !fits(*d) => {
                Placement::Replicate
            }
            p => *p,
        })
        .collect();
    ShardSpec::new(shape.to_vec(), mesh.to_vec(), coord.to_vec(), pl).map(Some)
}

fn csv(v: &[usize]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The mesh and placements of DST, checked against the options (errors name them).
fn layout(
    o: &ConvertOptions,
    src_world: usize,
    max_ndim: usize,
) -> Result<(Vec<usize>, Vec<Placement>)> {
    let n = o.names;
    let bad = |name: &str, m: String| Err(Error::invalid(name, m));
    let mesh = match (&o.mesh, o.ranks) {
        (Some(m), Some(r)) if m.iter().product::<usize>() != r => {
            return bad(
                n.mesh,
                format!(
                    "{} {} holds {} ranks, not {} {r}",
                    n.mesh,
                    csv(m),
                    m.iter().product::<usize>(),
                    n.ranks
                ),
            )
        }
        (Some(m), _) => m.clone(),
        (None, r) => vec![r.unwrap_or(src_world)],
    };
    if mesh.is_empty()
        || mesh.contains(&0)
        || mesh
            .iter()
            .try_fold(1usize, |k, &d| k.checked_mul(d))
            .is_none_or(|k| k > MAX_RANKS)
    {
        return match (&o.mesh, o.ranks) {
            (Some(m), _) => bad(
                n.mesh,
                format!(
                    "{} {}: every size must be >= 1 and their product 1..={MAX_RANKS}",
                    n.mesh,
                    csv(m)
                ),
            ),
            (None, Some(r)) => bad(n.ranks, format!("{} {r}: must be 1..={MAX_RANKS}", n.ranks)),
            (None, None) => bad(
                n.ranks,
                format!(
                    "SRC was saved by {src_world} ranks, more than the {MAX_RANKS} fo writes: give {}",
                    n.ranks
                ),
            ),
        };
    }
    let placements = o
        .placements
        .clone()
        .unwrap_or_else(|| vec![Placement::Shard(0); mesh.len()]);
    if placements.len() != mesh.len() {
        let spelled = match &o.mesh {
            Some(m) => format!("{} {}", n.mesh, csv(m)),
            None => format!("{} {}", n.ranks, mesh[0]),
        };
        return bad(
            n.placements,
            format!(
                "{} {}: {} placement(s) for a mesh of {} dim(s) ({spelled}); give one per mesh dim",
                n.placements,
                placements
                    .iter()
                    .map(placement_code)
                    .collect::<Vec<_>>()
                    .join(","),
                placements.len(),
                mesh.len(),
            ),
        );
    }
    for p in &placements {
        if let Placement::Shard(d) | Placement::StridedShard { dim: d, .. } = p {
            if *d >= max_ndim {
                return bad(
                    n.placements,
                    format!(
                        "{} {}: no key of SRC has dim {d} (its keys have at most {max_ndim} dim(s))",
                        n.placements,
                        placement_code(p)
                    ),
                );
            }
        }
    }
    Ok((mesh, placements))
}

/// Checks the options against SRC and lists what DST will hold.
pub fn plan(ck: &Checkpoint, o: &ConvertOptions) -> Result<Plan> {
    let src_world = ck.meta.as_ref().map_or(ck.files.len(), |m| m.world_size);
    let max_ndim = ck
        .keys
        .values()
        .map(|k| k.global_shape.len())
        .max()
        .unwrap_or(0);
    let (mesh, placements) = layout(o, src_world, max_ndim.max(1))?;
    let items = items(ck, o.to);
    let mut keys = BTreeSet::new();
    for it in &items {
        if it.quant.is_some() {
            keys.insert(codes_key(&it.key));
            keys.insert(scales_key(&it.key));
        } else {
            keys.insert(it.key.clone());
        }
    }
    Ok(Plan {
        items,
        mesh,
        placements,
        keys,
        to: o.to,
    })
}

/// Fails unless the written checkpoint `stage` opens and holds exactly `want`'s keys.
fn check_written(stage: &Path, want: &BTreeSet<String>) -> Result<()> {
    let ck = Checkpoint::open(stage)?;
    let got: BTreeSet<String> = ck.keys.keys().cloned().collect();
    if &got != want {
        let missing: Vec<&String> = want.difference(&got).collect();
        let extra: Vec<&String> = got.difference(want).collect();
        return Err(Error::Internal(format!(
            "the converted checkpoint holds {} keys, {} expected (missing {missing:?}, unexpected {extra:?}); nothing written",
            got.len(),
            want.len()
        )));
    }
    Ok(())
}

/// Writes `plan` of `ck` into the empty directory `stage` and checks what it wrote.
/// `progress(done_bytes, total_bytes)` is called after each entry.
pub fn write(
    ck: &Checkpoint,
    plan: &Plan,
    stage: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ConvertReport> {
    let (items, mesh, placements) = (&plan.items, &plan.mesh, &plan.placements);
    let world: usize = mesh.iter().product();
    let mut requantized = BTreeSet::new();
    let total: u64 = items
        .iter()
        .map(|i| (i.shape.iter().product::<usize>() * i.dtype.size()) as u64)
        .sum();
    let mut done = 0u64;
    let meta = ck.meta.as_ref();
    // Every rank of the converted checkpoint belongs to one save: the source's id plus
    // "+convert", or (torch's files carry none) one made from the clock, once.
    let save_id = match meta {
        Some(m) => format!("{}+convert", m.save_id),
        None => {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            format!("convert-{}", t.as_nanos())
        }
    };
    let quant = items.iter().any(|i| i.quant.is_some());
    let mode = match (plan.to, meta) {
        (None, Some(m)) if m.mode == "raw" => "raw",
        _ if quant => "compressed",
        _ => "portable",
    };
    for rank in 0..world {
        let coord = rank_to_coord(rank, mesh);
        let mut metas = Vec::new();
        // (item, part): part 0 = values or codes, 1 = scales.
        let mut parts = Vec::new();
        let mut dests = Vec::new();
        for (n, it) in items.iter().enumerate() {
            let spec = spec_for(&it.shape, mesh, &coord, placements)
                .map_err(|e| Error::invalid("placements", format!("key {}: {e}", it.key)))?;
            let dest = match &spec {
                Some(s) => s.clone(),
                None => ShardSpec::unsharded(it.shape.clone())?,
            };
            let local_shape = dest.local_shape();
            let meta_of = |key, dtype, local_shape, spec, layout| EntryMeta {
                key,
                dtype,
                local_shape,
                spec,
                layout,
            };
            match it.quant {
                None => {
                    let dtype = if it.src_compressed {
                        DType::F32
                    } else {
                        it.dtype
                    };
                    let m = meta_of(
                        it.key.clone(),
                        dtype,
                        local_shape,
                        spec,
                        Layout::Elementwise,
                    );
                    metas.push(m);
                    parts.push((n, 0));
                }
                Some(signed) => {
                    let codes = codes_key(&it.key);
                    let groups = num_groups(dest.local_numel());
                    let d = if signed { DType::I8 } else { DType::U8 };
                    metas.push(meta_of(
                        codes.clone(),
                        d,
                        local_shape,
                        spec,
                        Layout::Elementwise,
                    ));
                    metas.push(meta_of(
                        scales_key(&it.key),
                        DType::F16,
                        vec![groups],
                        None,
                        Layout::GroupScales { of: codes },
                    ));
                    parts.extend([(n, 0), (n, 1)]);
                }
            }
            dests.push(dest);
        }
        let mut opts = PackOptions::new(rank, world);
        opts.mode = mode.to_string();
        if let Some(m) = meta {
            opts.param_groups = m.param_groups.clone();
            opts.extra = m.extra.clone();
        }
        opts.save_id = save_id.clone();
        opts.keep_empty_keys = true;
        // Codes and scales of one key come from one requantization: keep the last.
        let mut cache: Option<(usize, Quant8)> = None;
        let mut fetch = |e: usize| -> Result<Tensor> {
            let (n, part) = parts[e];
            let (it, dest) = (&items[n], &dests[n]);
            let t = match it.quant {
                None if it.src_compressed => {
                    Tensor::from_f32(dest.local_shape(), &ck.read_f32(&it.key, dest)?)?
                }
                None if it.shape.is_empty() => ck.read_full(&it.key)?,
                None => ck.read(&it.key, dest)?,
                Some(signed) => {
                    if cache.as_ref().map(|c| c.0) != Some(n) {
                        let q = ck.read_quant8(&it.key, dest, signed)?;
                        if !q.exact && it.src_compressed {
                            requantized.insert(it.key.clone());
                        }
                        cache = Some((n, q));
                    }
                    let q = &cache.as_ref().unwrap().1;
                    if part == 0 {
                        q.codes.clone()
                    } else {
                        q.scales.clone()
                    }
                }
            };
            if part == 0 {
                done += (t.numel() * it.dtype.size()) as u64;
                progress(done, total);
            }
            Ok(t)
        };
        save_streaming(stage, &metas, &opts, &mut fetch)?;
    }
    check_written(stage, &plan.keys)?;
    Ok(ConvertReport {
        keys: plan.keys.len(),
        world,
        mesh: mesh.clone(),
        placements: placements.clone(),
        mode: if quant { "compressed" } else { "portable" },
        requantized: requantized.into_iter().collect(),
    })
}

/// Converts checkpoint `src` (fo's or torch DCP's, sharded or consolidated) into `dst`,
/// which must not exist or be empty (or `o.force`), and is never SRC, inside SRC or a
/// directory holding SRC. On any error nothing is left at `dst` (a replaced DST stays).
pub fn convert(
    src: &Path,
    dst: &Path,
    o: &ConvertOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ConvertReport> {
    let ck = Checkpoint::open(src)?;
    let plan = plan(&ck, o)?;
    let stage = super::output::stage(src, dst, o.force, "convert")?;
    let report = write(&ck, &plan, &stage.dir, progress)?;
    stage.publish()?;
    Ok(report)
}
