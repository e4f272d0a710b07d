//! `fo ckpt convert SRC DST`: reshard a checkpoint offline onto another world size or
//! mesh, and/or change its format, through the library's reader (any saved sharding to
//! any destination shard, quant8 requantized in the destination's groups) and its
//! streaming writer (one entry of one rank in memory at a time). DST appears whole or
//! not at all (`dst.rs`), and holds every key of SRC: the converter counts them.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::ValueEnum;
use fo::ckpt::naming::num_groups;
use fo::ckpt::pack::{EntryMeta, Layout, PackOptions};
use fo::ckpt::{save_streaming, Checkpoint};
use fo::shard::{rank_to_coord, Placement, ShardSpec};
use fo::{DType, Tensor};

use super::args::{Csv, MAX_RANKS};
use super::{dst, progress};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// f32 moments (`exp_avg`, `exp_avg_sq`, `momentum_buffer`): what torch loads.
    Portable,
    /// quant8 moments: int8/uint8 codes + fp16 scales per 32 elements.
    Compressed,
}

#[derive(Debug, clap::Args)]
#[command(
    after_help = "Every key with at least one dim is sharded over the new mesh with --placements (default
Shard(0) on every mesh dim; a placement naming a dim a key lacks becomes Replicate for that
key, a dim no key has is refused); 0-dim keys (step) are saved once, keys with no element
are kept. Moments keep their format unless --to says otherwise; quant8 moments saved in
another sharding are requantized in the new groups and named on stderr (error bound in
docs/checkpoints.md). SRC may be a sharded directory, a consolidated directory or one
.safetensors file. DST must not exist or be empty, unless --force replaces it; it is never
SRC, inside SRC, or a directory holding SRC. World sizes: 1..=1024 ranks.

Examples:
  fo ckpt convert ckpt/step-1000 ckpt/step-1000-3r --ranks 3
  fo ckpt convert ckpt/step-1000 ckpt/step-1000-tp --mesh 2,2 --placements S0,S1
  fo ckpt convert ckpt/step-1000 ckpt/portable --to portable
  fo ckpt convert tests/oracle/ckpt_fsdp2_4ranks/sharded /tmp/fo-2r --ranks 2"
)]
pub struct ConvertArgs {
    /// The checkpoint to read (fo's or a PyTorch DCP HuggingFace directory).
    pub src: PathBuf,
    /// The directory to write.
    pub dst: PathBuf,
    /// The format of the moments in DST (default: as in SRC).
    #[arg(long, value_enum)]
    pub to: Option<Format>,
    /// World size of DST, 1..=1024 (default: SRC's, or the product of --mesh).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=MAX_RANKS as i64))]
    pub ranks: Option<u16>,
    /// Mesh shape of DST (default: [ranks]); its product is 1..=1024.
    #[arg(long, value_name = "M0,M1,..", value_parser = super::args::non_empty_csv::<usize>)]
    pub mesh: Option<Csv<usize>>,
    /// Placements of DST, one per mesh dim: R, P, S<dim>, SS<dim>:<sf>.
    #[arg(long, value_name = "P0,P1,..")]
    pub placements: Option<Csv<Placement>>,
    /// Replace a non-empty DST.
    #[arg(long)]
    pub force: bool,
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

fn moment_signed(key: &str) -> Option<bool> {
    match key.rsplit('.').next() {
        Some("exp_avg" | "momentum_buffer") => Some(true),
        Some("exp_avg_sq") => Some(false),
        _ => None,
    }
}

fn items(ck: &Checkpoint, to: Option<Format>) -> Result<Vec<Item>, String> {
    let mut out = Vec::new();
    for (k, info) in &ck.keys {
        if let Some(base) = k
            .strip_suffix("::quantized")
            .filter(|b| ck.is_compressed(b))
        {
            let signed = info.dtype == DType::I8;
            out.push(Item {
                key: base.to_string(),
                dtype: DType::F32,
                shape: info.global_shape.clone(),
                quant: (to != Some(Format::Portable)).then_some(signed),
                src_compressed: true,
            });
        } else if k
            .strip_suffix("::scales")
            .is_some_and(|b| ck.is_compressed(b))
        {
            continue;
        } else {
            let quant = match moment_signed(k) {
                Some(s) if to == Some(Format::Compressed) && info.dtype == DType::F32 => Some(s),
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
    Ok(out)
}

/// `key`'s shard at `coord` of the new mesh (None: 0-dim, saved once).
fn spec_for(
    shape: &[usize],
    mesh: &[usize],
    coord: &[usize],
    placements: &[Placement],
) -> Result<Option<ShardSpec>, String> {
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
    ShardSpec::new(shape.to_vec(), mesh.to_vec(), coord.to_vec(), pl)
        .map(Some)
        .map_err(|e| e.to_string())
}

/// The mesh and placements of DST, checked against the user's flags (errors name them).
fn layout(
    a: &ConvertArgs,
    src_world: usize,
    max_ndim: usize,
) -> Result<(Vec<usize>, Vec<Placement>), String> {
    let mesh = match (&a.mesh, a.ranks.map(usize::from)) {
        (Some(m), Some(r)) if m.0.iter().product::<usize>() != r => {
            return Err(format!(
                "--mesh {} holds {} ranks, not --ranks {r}",
                csv(&m.0),
                m.0.iter().product::<usize>()
            ))
        }
        (Some(m), _) => m.0.clone(),
        (None, r) => vec![r.unwrap_or(src_world)],
    };
    let spelled = || a.mesh.as_ref().map(|m| csv(&m.0));
    if mesh.contains(&0)
        || mesh
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .is_none_or(|n| n > MAX_RANKS)
    {
        return Err(match spelled() {
            Some(m) => format!("--mesh {m}: every size must be >= 1 and their product 1..={MAX_RANKS}"),
            None => format!(
                "SRC was saved by {src_world} ranks, more than the {MAX_RANKS} fo writes: give --ranks"
            ),
        });
    }
    let placements = a
        .placements
        .as_ref()
        .map_or_else(|| vec![Placement::Shard(0); mesh.len()], |p| p.0.clone());
    if placements.len() != mesh.len() {
        return Err(format!(
            "--placements {}: {} placement(s) for a mesh of {} dim(s) ({}); give one per mesh dim",
            placements
                .iter()
                .map(fo::ckpt::pack::placement_code)
                .collect::<Vec<_>>()
                .join(","),
            placements.len(),
            mesh.len(),
            spelled().map_or_else(|| format!("--ranks {}", mesh[0]), |m| format!("--mesh {m}"))
        ));
    }
    for p in &placements {
        if let Placement::Shard(d) | Placement::StridedShard { dim: d, .. } = p {
            if *d >= max_ndim {
                return Err(format!(
                    "--placements {}: no key of SRC has dim {d} (its keys have at most {max_ndim} dim(s))",
                    fo::ckpt::pack::placement_code(p)
                ));
            }
        }
    }
    Ok((mesh, placements))
}

fn csv(v: &[usize]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The raw keys DST must hold for `items`.
fn expected_keys(items: &[Item]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for it in items {
        if it.quant.is_some() {
            out.insert(format!("{}::quantized", it.key));
            out.insert(format!("{}::scales", it.key));
        } else {
            out.insert(it.key.clone());
        }
    }
    out
}

/// Fails unless the written checkpoint `stage` opens and holds exactly `want`'s keys.
fn check_written(stage: &Path, want: &BTreeSet<String>) -> Result<(), String> {
    let ck = Checkpoint::open(stage)
        .map_err(|e| format!("the converted checkpoint does not open: {e}"))?;
    let got: BTreeSet<String> = ck.keys.keys().cloned().collect();
    if &got != want {
        let missing: Vec<&String> = want.difference(&got).collect();
        let extra: Vec<&String> = got.difference(want).collect();
        return Err(format!(
            "internal error: the converted checkpoint holds {} keys, {} expected (missing {missing:?}, unexpected {extra:?}); nothing written",
            got.len(),
            want.len()
        ));
    }
    Ok(())
}

pub fn run(a: &ConvertArgs) -> Result<(), String> {
    let ck = Checkpoint::open(&a.src).map_err(|e| e.to_string())?;
    let src_world = ck.meta.as_ref().map_or(ck.files.len(), |m| m.world_size);
    let max_ndim = ck
        .keys
        .values()
        .map(|k| k.global_shape.len())
        .max()
        .unwrap_or(0);
    let (mesh, placements) = layout(a, src_world, max_ndim.max(1))?;
    let world: usize = mesh.iter().product();
    let items = items(&ck, a.to)?;
    let want = expected_keys(&items);
    let stage = dst::prepare(&a.src, &a.dst, a.force, "convert")?;
    let requantized = write(&ck, &items, &mesh, &placements, &stage.dir, a.to)?;
    check_written(&stage.dir, &want)?;
    stage.publish()?;
    if !requantized.is_empty() {
        eprintln!(
            "note: {} compressed key(s) requantized, because DST's groups of 32 elements are not the groups SRC saved them in (error bound in docs/checkpoints.md): {}",
            requantized.len(),
            requantized.join(", ")
        );
    }
    let mode = if items.iter().any(|i| i.quant.is_some()) {
        "compressed"
    } else {
        "portable"
    };
    println!(
        "wrote {} ({} keys, {world} ranks, mesh {mesh:?}, placements [{}], {mode})",
        a.dst.display(),
        want.len(),
        placements
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

fn write(
    ck: &Checkpoint,
    items: &[Item],
    mesh: &[usize],
    placements: &[Placement],
    stage: &Path,
    to: Option<Format>,
) -> Result<Vec<String>, String> {
    let world: usize = mesh.iter().product();
    let mut requantized = BTreeSet::new();
    let total: u64 = items
        .iter()
        .map(|i| (i.shape.iter().product::<usize>() * i.dtype.size()) as u64)
        .sum();
    let pb = progress::bytes("convert", total);
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
    let mode = match (to, meta) {
        (None, Some(m)) if m.mode == "raw" => "raw".to_string(),
        _ if quant => "compressed".to_string(),
        _ => "portable".to_string(),
    };
    for rank in 0..world {
        let coord = rank_to_coord(rank, mesh);
        let mut metas = Vec::new();
        // (item, part): part 0 = values or codes, 1 = scales.
        let mut parts = Vec::new();
        let mut dests = Vec::new();
        for (n, it) in items.iter().enumerate() {
            let spec = spec_for(&it.shape, mesh, &coord, placements)
                .map_err(|e| format!("key {}: {e}", it.key))?;
            let dest = match &spec {
                Some(s) => s.clone(),
                None => ShardSpec::unsharded(it.shape.clone()).map_err(|e| e.to_string())?,
            };
            let local = dest.local_shape();
            match it.quant {
                None => {
                    let dtype = if it.src_compressed {
                        DType::F32
                    } else {
                        it.dtype
                    };
                    metas.push(meta_of(
                        it.key.clone(),
                        dtype,
                        local,
                        spec,
                        Layout::Elementwise,
                    ));
                    parts.push((n, 0));
                }
                Some(signed) => {
                    let codes = format!("{}::quantized", it.key);
                    let groups = num_groups(dest.local_numel());
                    let d = if signed { DType::I8 } else { DType::U8 };
                    metas.push(meta_of(codes.clone(), d, local, spec, Layout::Elementwise));
                    metas.push(meta_of(
                        format!("{}::scales", it.key),
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
        opts.mode = mode.clone();
        if let Some(m) = meta {
            opts.param_groups = m.param_groups.clone();
            opts.extra = m.extra.clone();
        }
        opts.save_id = save_id.clone();
        opts.keep_empty_keys = true;
        // Codes and scales of one key come from one requantization: keep the last.
        let mut cache: Option<(usize, fo::ckpt::Quant8)> = None;
        let mut fetch = |e: usize| -> fo::Result<Tensor> {
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
                pb.inc((t.numel() * it.dtype.size()) as u64);
            }
            Ok(t)
        };
        save_streaming(stage, &metas, &opts, &mut fetch).map_err(|e| e.to_string())?;
    }
    pb.finish_and_clear();
    Ok(requantized.into_iter().collect())
}

fn meta_of(
    key: String,
    dtype: DType,
    local_shape: Vec<usize>,
    spec: Option<ShardSpec>,
    layout: Layout,
) -> EntryMeta {
    EntryMeta {
        key,
        dtype,
        local_shape,
        spec,
        layout,
    }
}
