//! The `fo` command line (`fo --help`). Exit status: 0 success, 1 failure, 2 bad usage.
use std::process::ExitCode;

use clap::Parser;

mod cli;

fn main() -> ExitCode {
    // clap prints usage errors itself and exits 2 (help and --version exit 0).
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fo: {e}");
            ExitCode::FAILURE
        }
    }
}
