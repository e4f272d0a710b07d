//! `fo ckpt inspect|verify|consolidate DIR`: look into a checkpoint (fo's or PyTorch's
//! HuggingFace DCP files; sharded, consolidated, or one .safetensors file).
use std::path::{Path, PathBuf};

use super::{dst, progress};
use fo::ckpt::{consolidate, naming, verify, Checkpoint};

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
        /// The checkpoint: a directory (sharded or consolidated) or a .safetensors file.
        dir: PathBuf,
    },
    /// Every checksum, and every global element saved exactly once.
    #[command(
        after_help = "Examples:\n  fo ckpt verify ckpt/step-1000\n  fo -q ckpt verify ckpt/step-1000 && echo intact"
    )]
    Verify {
        /// The checkpoint: a directory (sharded or consolidated) or a .safetensors file.
        dir: PathBuf,
    },
    /// One full safetensors file + model.safetensors.index.json.
    #[command(
        after_help = "OUT must not exist or be empty, unless --force replaces it; it is never the checkpoint,
inside it, or a directory holding it. OUT appears whole or not at all. Compressed state saved
sharded is requantized in groups of the full tensor; the keys are named on stderr.

Examples:\n  fo ckpt consolidate ckpt/step-1000 ckpt/full   writes ckpt/full/model-00001-of-00001.safetensors"
    )]
    Consolidate {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The output directory.
        out: PathBuf,
        /// Replace a non-empty OUT.
        #[arg(long)]
        force: bool,
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
        CkptCommand::Consolidate { dir, out, force } => {
            // Opened first: a checkpoint that does not open leaves nothing behind.
            drop(Checkpoint::open(dir).map_err(|e| e.to_string())?);
            let stage = dst::prepare(dir, out, *force, "consolidate")?;
            let pb = progress::bytes("consolidate", 0);
            let c = consolidate(dir, &stage.dir, &mut progress::hook(&pb))
                .map_err(|e| e.to_string())?;
            pb.finish_and_clear();
            let written = Checkpoint::open(&stage.dir)
                .map_err(|e| format!("the consolidated checkpoint does not open: {e}"))?;
            if written.keys.len() != c.keys {
                return Err(format!(
                    "internal error: the consolidated file holds {} keys, {} were written; nothing written",
                    written.keys.len(),
                    c.keys
                ));
            }
            drop(written);
            stage.publish()?;
            if !c.requantized.is_empty() {
                eprintln!(
                    "note: {} compressed key(s) requantized, because the checkpoint saved them sharded and the consolidated layout has one scale per 32 elements of the full tensor (error bound in docs/checkpoints.md): {}",
                    c.requantized.len(),
                    c.requantized.join(", ")
                );
            }
            let name = |p: &Path| out.join(p.file_name().unwrap_or_default());
            println!(
                "wrote {} ({} keys, {}) and {}",
                name(&c.file).display(),
                c.keys,
                bytes(c.bytes),
                name(&c.index).display()
            );
            Ok(())
        }
    }
}

fn inspect(dir: &Path) -> Result<(), String> {
    let ck = Checkpoint::open(dir).map_err(|e| e.to_string())?;
    if ck.is_single_file() {
        println!(
            "consolidated checkpoint: one full safetensors file, {}",
            ck.files[0].display()
        );
    }
    match &ck.meta {
        Some(m) => println!(
            "fo checkpoint: {} files, mode {}, fo {}, save_id {:?}, {} param groups",
            ck.files.len(),
            m.mode,
            m.fo_version,
            m.save_id,
            m.param_groups.as_array().map_or(0, Vec::len)
        ),
        None if ck.is_single_file() => {}
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
            _ if ck.is_single_file() => "full tensor".to_string(),
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
    let compressed = ck
        .keys
        .keys()
        .any(|k| matches!(naming::split_part(k), Some((_, naming::Part::Codes))));
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

/// A byte count with a binary unit a person reads at a glance (4.00 MiB, not 0.00 GiB).
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["bytes", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} bytes")
    } else {
        format!("{x:.2} {}", UNITS[u])
    }
}
