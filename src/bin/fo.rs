//! The `fo` command line (`fo --help`). Exit status: 0 success, 1 failure, 2 bad usage.
use std::process::ExitCode;

use clap::Parser;

mod cli;

fn main() -> ExitCode {
    // Like other Unix tools, end quietly when the reader of stdout goes away
    // (`fo ckpt diff A B | head`) instead of panicking in println!.
    // SAFETY: restoring the default disposition of SIGPIPE before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
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
