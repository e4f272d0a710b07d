//! Output that never panics (see the `println!`/`eprintln!` macros in `mod.rs`).
use std::io::Write;
use std::sync::OnceLock;

static STDOUT_ERROR: OnceLock<String> = OnceLock::new();

/// One line on stdout; after a failed write, nothing more is written.
pub fn line(args: std::fmt::Arguments) {
    if STDOUT_ERROR.get().is_some() {
        return;
    }
    let mut o = std::io::stdout().lock();
    if let Err(e) = o.write_fmt(args).and_then(|_| o.write_all(b"\n")) {
        let _ = STDOUT_ERROR.set(e.to_string());
    }
}

/// One line on stderr (an error writing it has nowhere to be reported).
pub fn err_line(args: std::fmt::Arguments) {
    let mut e = std::io::stderr().lock();
    let _ = e.write_fmt(args).and_then(|_| e.write_all(b"\n"));
}

/// Flushes stdout; the first error any write met, if one did.
pub fn finish() -> Option<String> {
    if let Err(e) = std::io::stdout().flush() {
        let _ = STDOUT_ERROR.set(e.to_string());
    }
    STDOUT_ERROR.get().cloned()
}
