//! `fo ckpt convert SRC DST`: argument parsing and printing around the library's converter
//! (`fo::ckpt::convert`, also `fo_checkpoint_convert`). The CLI stages DST itself
//! (`dst.rs`), so an interrupted run removes its partial output (`cleanup.rs`).
use std::path::PathBuf;

use clap::ValueEnum;
use fo::ckpt::Checkpoint;
use fo::ckpt::{plan_convert, write_convert, ConvertFormat, ConvertOptions, OptionNames};
use fo::shard::Placement;
use fo::Error;

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

impl From<Format> for ConvertFormat {
    fn from(f: Format) -> Self {
        match f {
            Format::Portable => ConvertFormat::Portable,
            Format::Compressed => ConvertFormat::Compressed,
        }
    }
}

/// The library's error as the CLI words it: a bad option by its reason alone (it names
/// the flag), anything else whole.
fn message(e: Error) -> String {
    match e {
        Error::InvalidArgument { reason, .. } => reason,
        e => e.to_string(),
    }
}

pub fn run(a: &ConvertArgs) -> Result<(), String> {
    let o = ConvertOptions {
        to: a.to.map(Into::into),
        ranks: a.ranks.map(usize::from),
        mesh: a.mesh.as_ref().map(|m| m.0.clone()),
        placements: a.placements.as_ref().map(|p| p.0.clone()),
        force: a.force,
        names: OptionNames {
            ranks: "--ranks",
            mesh: "--mesh",
            placements: "--placements",
        },
    };
    let ck = Checkpoint::open(&a.src).map_err(|e| e.to_string())?;
    let plan = plan_convert(&ck, &o).map_err(message)?;
    let stage = dst::prepare(&a.src, &a.dst, a.force, "convert")?;
    let pb = progress::bytes("convert", 0);
    let r = write_convert(&ck, &plan, &stage.dir, &mut progress::hook(&pb)).map_err(message)?;
    pb.finish_and_clear();
    stage.publish()?;
    if !r.requantized.is_empty() {
        eprintln!(
            "note: {} compressed key(s) requantized, because DST's groups of 32 elements are not the groups SRC saved them in (error bound in docs/checkpoints.md): {}",
            r.requantized.len(),
            r.requantized.join(", ")
        );
    }
    println!(
        "wrote {} ({} keys, {} ranks, mesh {:?}, placements [{}], {})",
        a.dst.display(),
        r.keys,
        r.world,
        r.mesh,
        r.placements
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        r.mode
    );
    Ok(())
}
