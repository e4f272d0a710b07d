//! `fo ckpt inspect|verify|consolidate DIR`: look into a checkpoint directory (fo's or
//! PyTorch's HuggingFace DCP files).
use std::path::{Path, PathBuf};

use super::progress;
use fo::ckpt::{consolidate, verify, Checkpoint};

#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:
  fo ckpt inspect tests/oracle/ckpt_fsdp_tp_2x2/sharded
  fo ckpt verify ckpt/step-1000
  fo ckpt consolidate ckpt/step-1000 ckpt/full")]
pub struct CkptArgs {
    #[command(subcommand)]
    pub command: CkptCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum CkptCommand {
    /// Keys, dtypes, global shapes, sharding, sizes; compressed or portable.
    #[command(after_help = "Examples:\n  fo ckpt inspect tests/oracle/ckpt_fsdp_tp_2x2/sharded")]
    Inspect {
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// Every checksum, and every global element saved exactly once.
    #[command(
        after_help = "Examples:\n  fo ckpt verify ckpt/step-1000\n  fo -q ckpt verify ckpt/step-1000 && echo intact"
    )]
    Verify {
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// One full safetensors file + model.safetensors.index.json.
    #[command(
        after_help = "Examples:\n  fo ckpt consolidate ckpt/step-1000 ckpt/full   writes ckpt/full/model-00001-of-00001.safetensors"
    )]
    Consolidate {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The output directory.
        out: PathBuf,
    },
    /// Per key max abs / max rel difference and elements out of tolerance, across shardings.
    Diff(super::ckpt_diff::DiffArgs),
    /// Reshard onto another world size or mesh, or change the format, offline.
    Convert(super::ckpt_convert::ConvertArgs),
}

pub fn run(a: &CkptArgs) -> Result<(), String> {
    match &a.command {
        CkptCommand::Inspect { dir } => inspect(dir),
        CkptCommand::Diff(d) => super::ckpt_diff::run(d),
        CkptCommand::Convert(c) => super::ckpt_convert::run(c),
        CkptCommand::Verify { dir } => {
            let pb = progress::bytes("verify", 0);
            let v = verify(dir, &mut progress::hook(&pb)).map_err(|e| e.to_string())?;
            pb.finish_and_clear();
            println!(
                "ok: {} files, {} keys, {} chunks, {} bytes; every element saved exactly once; {} of {} chunks checksummed and verified",
                v.files, v.keys, v.chunks, v.bytes, v.checksummed_chunks, v.chunks
            );
            Ok(())
        }
        CkptCommand::Consolidate { dir, out } => {
            let pb = progress::bytes("consolidate", 0);
            let c = consolidate(dir, out, &mut progress::hook(&pb)).map_err(|e| e.to_string())?;
            pb.finish_and_clear();
            println!(
                "wrote {} ({} keys, {} bytes) and {}",
                c.file.display(),
                c.keys,
                c.bytes,
                c.index.display()
            );
            Ok(())
        }
    }
}

fn inspect(dir: &Path) -> Result<(), String> {
    let ck = Checkpoint::open(dir).map_err(|e| e.to_string())?;
    match &ck.meta {
        Some(m) => println!(
            "fo checkpoint: {} files, mode {}, fo {}, save_id {:?}, {} param groups",
            ck.files.len(),
            m.mode,
            m.fo_version,
            m.save_id,
            m.param_groups.as_array().map_or(0, Vec::len)
        ),
        None => println!(
            "checkpoint without fo metadata (PyTorch DCP HuggingFace files): {} files",
            ck.files.len()
        ),
    }
    println!(
        "{:<48} {:<5} {:<14} {:<28} {:>7} {:>12}",
        "key", "dtype", "global shape", "sharding", "chunks", "bytes"
    );
    let mut total = 0usize;
    for (k, info) in &ck.keys {
        let bytes: usize = info.chunks.iter().map(|c| c.nbytes).sum();
        total += bytes;
        let sharding = match &info.fo {
            Some(f) if f.group_scales_of.is_some() => {
                format!("scales of [{}] groups", f.placements.join(","))
            }
            Some(f) => format!("mesh {:?} [{}]", f.mesh, f.placements.join(",")),
            None => "saved_offsets only".to_string(),
        };
        println!(
            "{:<48} {:<5} {:<14} {:<28} {:>7} {:>12}",
            k,
            info.dtype.to_string(),
            format!("{:?}", info.global_shape),
            sharding,
            info.chunks.len(),
            bytes
        );
    }
    let compressed = ck.keys.keys().any(|k| k.ends_with("::quantized"));
    println!(
        "{} keys, {total} bytes of tensor data; state is {}",
        ck.keys.len(),
        if compressed {
            "compressed (quant8)"
        } else {
            "portable"
        }
    );
    Ok(())
}
