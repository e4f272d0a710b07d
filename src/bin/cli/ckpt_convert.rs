//! `fo ckpt convert SRC DST`: reshard a checkpoint offline onto another world size or
//! mesh, and/or change its format, through the library's reader (any saved sharding to
//! any destination shard, quant8 requantized in the destination's groups) and its
//! streaming writer (one entry of one rank in memory at a time). DST appears whole or
//! not at all: everything is written into a staging directory beside it, then renamed.
use std::path::{Path, PathBuf};

use clap::ValueEnum;
use fo::ckpt::pack::{num_groups, EntryMeta, Layout, PackOptions};
use fo::ckpt::{save_streaming, Checkpoint};
use fo::shard::{rank_to_coord, Placement, ShardSpec};
use fo::{DType, Tensor};

use super::args::Csv;
use super::progress;

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
key); 0-dim keys (step) are saved once. Moments keep their format unless --to says otherwise;
quant8 moments saved in another sharding are requantized in the new groups (error bound in
docs/checkpoints.md). DST must not exist or be empty, unless --force replaces it.

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
    /// World size of DST (default: SRC's, or the product of --mesh).
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Mesh shape of DST (default: [ranks]).
    #[arg(long, value_name = "M0,M1,..")]
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

pub fn run(a: &ConvertArgs) -> Result<(), String> {
    let ck = Checkpoint::open(&a.src).map_err(|e| e.to_string())?;
    let src_world = ck.meta.as_ref().map_or(ck.files.len(), |m| m.world_size);
    let mesh = match (&a.mesh, a.ranks) {
        (Some(m), Some(r)) if m.0.iter().product::<usize>() != r => {
            return Err(format!(
                "--mesh {:?} holds {} ranks, --ranks says {r}",
                m.0,
                m.0.iter().product::<usize>()
            ))
        }
        (Some(m), _) => m.0.clone(),
        (None, r) => vec![r.unwrap_or(src_world)],
    };
    let placements = a
        .placements
        .as_ref()
        .map_or_else(|| vec![Placement::Shard(0); mesh.len()], |p| p.0.clone());
    if mesh.is_empty() || mesh.contains(&0) || placements.len() != mesh.len() {
        return Err(format!(
            "--mesh {mesh:?} needs positive sizes and one placement per mesh dim (got {})",
            placements.len()
        ));
    }
    let world: usize = mesh.iter().product();
    let items = items(&ck, a.to)?;
    let stage = prepare_dst(&a.dst, a.force)?;
    let result = write(&ck, &items, &mesh, &placements, &stage, a.to);
    if let Err(e) = result.and_then(|_| {
        Checkpoint::open(&stage)
            .map(drop)
            .map_err(|e| e.to_string())
    }) {
        let _ = std::fs::remove_dir_all(&stage);
        return Err(e);
    }
    publish(&stage, &a.dst)?;
    let empty: Vec<&str> = items
        .iter()
        .filter(|i| !i.shape.is_empty() && i.shape.contains(&0))
        .map(|i| i.key.as_str())
        .collect();
    if !empty.is_empty() {
        // fo's format stores no chunk for a 0-element shard, so a key with no element at all
        // leaves no trace in the files.
        eprintln!(
            "note: {} key(s) with no elements are not stored: {}",
            empty.len(),
            empty.join(", ")
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
        items.len(),
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
) -> Result<(), String> {
    let world: usize = mesh.iter().product();
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
                        cache = Some((n, ck.read_quant8(&it.key, dest, signed)?));
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
    Ok(())
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

/// Refuses a non-empty `dst` without `force`; returns a fresh staging directory beside it.
fn prepare_dst(dst: &Path, force: bool) -> Result<PathBuf, String> {
    let non_empty = std::fs::read_dir(dst)
        .map(|mut d| d.next().is_some())
        .unwrap_or(false);
    if non_empty && !force {
        return Err(format!(
            "{} exists and is not empty (--force replaces it)",
            dst.display()
        ));
    }
    if dst.exists() && !dst.is_dir() {
        return Err(format!("{} exists and is not a directory", dst.display()));
    }
    let parent = dst
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = dst
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| format!("{}: no directory name", dst.display()))?;
    let stage = parent.join(format!(".{name}.convert-{}", std::process::id()));
    std::fs::create_dir_all(&stage)
        .map_err(|e| format!("cannot create {}: {e}", stage.display()))?;
    Ok(stage)
}

/// Moves the finished staging directory to `dst`; a replaced `dst` is removed only after
/// the new one is in place.
fn publish(stage: &Path, dst: &Path) -> Result<(), String> {
    let old = stage.with_extension("old");
    let had = dst.exists();
    if had {
        std::fs::rename(dst, &old)
            .map_err(|e| format!("cannot move {} aside: {e}", dst.display()))?;
    }
    if let Err(e) = std::fs::rename(stage, dst) {
        if had {
            let _ = std::fs::rename(&old, dst);
        }
        return Err(format!(
            "cannot rename {} to {}: {e}",
            stage.display(),
            dst.display()
        ));
    }
    if had {
        std::fs::remove_dir_all(&old)
            .map_err(|e| format!("cannot remove the replaced {}: {e}", old.display()))?;
    }
    Ok(())
}
