//! The `fo` command line (`fo --help`). Exit status: 0 success, 1 failure, 2 bad usage.
use std::process::ExitCode;

mod cli;

fn main() -> ExitCode {
    // Like other Unix tools, end quietly when the reader of stdout goes away
    // (`fo ckpt diff A B | head`) instead of panicking in println!.
    // SAFETY: restoring the default disposition of SIGPIPE before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // Before any thread exists: an interrupted command removes its partial output.
    cli::cleanup::install();
    // clap prints usage errors itself and exits 2 (help and --version exit 0).
    let args = cli::parse();
    // A panic is a bug, but still one line and exit 1, never an abort with a stack trace
    // (RUST_BACKTRACE=1 keeps the default report for debugging).
    if std::env::var_os("RUST_BACKTRACE").is_none() {
        std::panic::set_hook(Box::new(|info| {
            let msg = fo::error::panic_message(info.payload()).unwrap_or_default();
            let at = info
                .location()
                .map(|l| format!(" at {}:{}", l.file(), l.line()));
            eprintln!(
                "fo: internal error (a bug, please report it): {msg}{}",
                at.unwrap_or_default()
            );
        }));
    }
    let mut result =
        std::panic::catch_unwind(|| cli::run(args)).unwrap_or(Err(cli::REPORTED.into()));
    if let Some(e) = cli::out::finish() {
        if result.as_ref().is_ok() || result.as_ref().is_err_and(|r| r == cli::REPORTED) {
            result = Err(format!("writing to stdout: {e}"));
        }
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if e != cli::REPORTED {
                cli::out::err_line(format_args!("fo: {e}"));
            }
            ExitCode::FAILURE
        }
    }
}
