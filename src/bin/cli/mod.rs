//! Subcommand dispatch (clap derive). Each subcommand lives in its own file, next to the
//! clap `Args` struct its `run` takes.

// `println!` and `eprintln!` are shadowed for every command (macros defined before the
// modules below are in scope there): std's panic when stdout or stderr cannot be written
// (`fo shard ... > /dev/full`); these record the first stdout error, which `main` reports
// as a one-line error with exit status 1, and drop stderr errors (nowhere to report them).
macro_rules! println {
    ($($t:tt)*) => { $crate::cli::out::line(format_args!($($t)*)) };
}
macro_rules! eprintln {
    ($($t:tt)*) => { $crate::cli::out::err_line(format_args!($($t)*)) };
}

mod args;
mod bench_arith;
mod bench_broadcast;
mod bench_ckpt;
mod bench_ckpt_async;
mod bench_clip;
mod bench_dir;
mod bench_overlap;
mod bench_step;
mod bench_util;
mod ckpt;
mod ckpt_convert;
mod ckpt_diff;
pub mod cleanup;
mod demo;
mod dst;
mod mem;
pub mod out;
pub mod progress;
mod selftest;
mod selftest_cases;
#[cfg(feature = "cuda")]
mod selftest_gpu;
mod shard;

use clap::{CommandFactory, Parser, Subcommand};

const EXAMPLES: &str = "Examples:
  fo demo                                              train a small MLP through the whole library
  fo shard --shape 10,7 --mesh 2,3 --placements SS0:3,S0
  fo ckpt inspect tests/oracle/ckpt_fsdp_tp_2x2/sharded
  fo ckpt diff A B --rtol 1e-3                         compare two checkpoints, any shardings
  fo ckpt convert SRC DST --ranks 3                    reshard offline onto 3 ranks
  fo bench step --sizes 16M --threads 2
  fo selftest                                          GPU vs CPU bits (says so without a GPU)
  fo completions bash > ~/.local/share/bash-completion/completions/fo

Exit status: 0 success, 1 failure (or `fo ckpt diff` found a difference), 2 bad usage.";

/// fo: memory-efficient optimizer steps and distributed checkpoint state.
#[derive(Debug, Parser)]
#[command(name = "fo", version, about, after_help = EXAMPLES, propagate_version = true)]
pub struct Cli {
    /// No progress bars (they are hidden anyway when stderr is not a terminal).
    #[arg(short, long, global = true)]
    pub quiet: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print every mesh coordinate's local shape, global offset and index ranges.
    Shard(shard::ShardArgs),
    /// Train a small bf16 MLP on in-process ranks through the whole library, with checkpoint
    /// restarts (same and other rank counts) and a broadcast restore; checks its own results.
    Demo(demo::DemoArgs),
    /// Inspect, verify, consolidate, compare and convert checkpoints (fo's or PyTorch DCP's).
    Ckpt(ckpt::CkptArgs),
    /// Benchmarks, each against a baseline measured in the same run.
    Bench(BenchArgs),
    /// Step every rule x state format on the GPU and the CPU from the same inputs and count
    /// mismatching elements (must be 0), then GPU throughput vs a device-to-device copy.
    /// Without a GPU, says why and exits 0.
    Selftest(selftest::SelftestArgs),
    /// Print a shell completion script to stdout.
    #[command(after_help = "Examples:
  fo completions bash > ~/.local/share/bash-completion/completions/fo
  fo completions zsh > ~/.zfunc/_fo
  fo completions fish > ~/.config/fish/completions/fo.fish")]
    Completions {
        /// The shell to complete for.
        shell: clap_complete::Shell,
    },
}

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: BenchCommand,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Optimizer-step params/s and GB/s (fp32 AdamW, bf16+quant8+24-bit AdamW) vs a memory
    /// ceiling measured just before each case (best of the timed steps).
    Step(bench_step::StepArgs),
    /// Rank 0's state dict to an in-process group: scatter vs full broadcast, bytes and time.
    Broadcast(bench_broadcast::BroadcastArgs),
    /// Checkpoint save/load GB/s vs a plain sequential write/read (interleaved rounds, medians,
    /// cold reads); compressed vs portable size.
    Ckpt(bench_ckpt::BenchCkptArgs),
    /// fo_clip_grad_norm on host gradients (norm, norm + scale) vs a copy of the same bytes.
    Clip(bench_clip::ClipArgs),
    /// The overlapped step (step_begin / grads_ready / step_end) behind a synthetic backward:
    /// iteration times and the exposed step vs backward-then-step, with and without clipping.
    Overlap(bench_overlap::OverlapArgs),
}

/// Parses the command line. Every command takes negative numbers as values, so
/// `--steps -1` is refused for its value by the flag's range check ("-1 is not in
/// 12..=100000"), not taken for an unknown flag (no flag of fo is a dash and a digit).
pub fn parse() -> Cli {
    fn allow_negatives(c: clap::Command) -> clap::Command {
        let names: Vec<String> = c
            .get_subcommands()
            .map(|s| s.get_name().to_string())
            .collect();
        names
            .into_iter()
            .fold(c.allow_negative_numbers(true), |c, n| {
                c.mut_subcommand(n, allow_negatives)
            })
    }
    let matches = allow_negatives(Cli::command()).get_matches();
    <Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// The error of a command that already reported its outcome on stdout and only needs exit
/// status 1 (`fo ckpt diff` found a difference): `main` prints nothing more.
pub const REPORTED: &str = "";

pub fn run(cli: Cli) -> Result<(), String> {
    progress::set_quiet(cli.quiet);
    match cli.command {
        Command::Shard(a) => shard::run(&a),
        Command::Demo(a) => demo::run(&a),
        Command::Ckpt(a) => ckpt::run(&a),
        Command::Selftest(a) => selftest::run(&a),
        Command::Bench(b) => match b.command {
            BenchCommand::Step(a) => bench_step::run(&a),
            BenchCommand::Broadcast(a) => bench_broadcast::run(&a),
            BenchCommand::Ckpt(a) => bench_ckpt::run(&a),
            BenchCommand::Clip(a) => bench_clip::run(&a),
            BenchCommand::Overlap(a) => bench_overlap::run(&a),
        },
        Command::Completions { shell } => {
            // Generated into memory first: clap_complete panics on a write error, and a
            // closed pipe (`fo completions bash | head`) is not a failure worth a panic.
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "fo", &mut script);
            match std::io::Write::write_all(&mut std::io::stdout(), &script) {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    Err(format!("writing to stdout: {e}"))
                }
                _ => Ok(()),
            }
        }
    }
}
