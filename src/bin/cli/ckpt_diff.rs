//! `fo ckpt diff A B`: argument parsing and printing; the comparison itself is the
//! library's (`fo::ckpt::diff`, the same report as `fo_checkpoint_diff_json`).
use std::path::PathBuf;

use fo::ckpt::LogicalKey;
use fo::ckpt::SLAB_ELEMS;
use fo::ckpt::{diff, DiffOptions, KeyDiff};

use super::args::non_negative_f64;
use super::progress;

#[derive(Debug, clap::Args)]
#[command(
    after_help = "An element is within tolerance when |a - b| <= atol + rtol * |b| (torch.allclose; NaN equals
NaN). A and B may be sharded checkpoint directories (any world size, mesh or placements), a
consolidated directory, or one .safetensors file. Compressed (quant8) state is compared as
its dequantized values. The report (table and summary line, or --json) goes to stdout, and
nothing to stderr unless a checkpoint cannot be read. Exit status: 0 every key within
tolerance, 1 a key differs or is missing on one side (or a checkpoint cannot be read), 2 bad
usage.

Examples:
  fo ckpt diff ckpt/step-1000 ckpt/step-1000-on-3-ranks
  fo ckpt diff tests/oracle/ckpt_fsdp2_4ranks/sharded tests/oracle/ckpt_fsdp2_4ranks/full.safetensors
  fo ckpt diff A B --atol 1e-2 --json | jq '.keys[] | select(.status != \"equal\")'"
)]
pub struct DiffArgs {
    /// The first checkpoint (directory or .safetensors file).
    pub a: PathBuf,
    /// The second checkpoint, the reference of the relative difference.
    pub b: PathBuf,
    /// Relative tolerance (>= 0).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = non_negative_f64)]
    pub rtol: f64,
    /// Absolute tolerance (>= 0).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = non_negative_f64)]
    pub atol: f64,
    /// One JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Elements read per slab and side (bounds memory; tests make it tiny).
    #[arg(long, default_value_t = SLAB_ELEMS, hide = true,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=SLAB_ELEMS as u64))]
    pub slab_elems: usize,
}

pub fn run(a: &DiffArgs) -> Result<(), String> {
    let o = DiffOptions {
        rtol: a.rtol,
        atol: a.atol,
        slab_elems: a.slab_elems,
    };
    let pb = progress::bytes("diff", 0);
    let report = diff(&a.a, &a.b, &o, &mut progress::hook(&pb)).map_err(|e| e.to_string())?;
    pb.finish_and_clear();
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report.to_json()).unwrap()
        );
    } else {
        print_table(&report.rows);
        println!("{}", report.summary());
    }
    if report.differing() > 0 {
        // Reported on stdout: exit 1 with nothing more to say.
        return Err(super::REPORTED.into());
    }
    Ok(())
}

fn print_table(rows: &[(String, LogicalKey, KeyDiff)]) {
    println!(
        "{:<48} {:<9} {:<14} {:>11} {:>11} {:>14}",
        "key", "status", "global shape", "max abs", "max rel", "out of tol"
    );
    for (k, lk, d) in rows {
        if let Some(m) = &d.mismatch {
            println!(
                "{:<48} {:<9} {:<14} {m}",
                k,
                d.status(),
                format!("{:?}", lk.shape)
            );
            continue;
        }
        println!(
            "{:<48} {:<9} {:<14} {:>11.3e} {:>11.3e} {:>14}",
            k,
            d.status(),
            format!("{:?}", lk.shape),
            d.max_abs,
            d.max_rel,
            format!("{}/{}", d.out_of_tol, d.numel)
        );
    }
}
