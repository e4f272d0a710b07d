//! Progress bars on stderr for long work (indicatif): bytes done, bytes/s and time left.
//! indicatif's stderr target draws nothing when stderr is not a terminal, so logs and
//! pipes stay clean; `--quiet` hides them on a terminal too.
use std::sync::atomic::{AtomicBool, Ordering};

use indicatif::{ProgressBar, ProgressStyle};

static QUIET: AtomicBool = AtomicBool::new(false);

pub fn set_quiet(q: bool) {
    QUIET.store(q, Ordering::Relaxed);
}

pub fn quiet() -> bool {
    QUIET.load(Ordering::Relaxed)
}

/// A bar over `total` bytes labelled `what`.
pub fn bytes(what: &str, total: u64) -> ProgressBar {
    if quiet() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template(
            "{msg:>12} [{bar:32}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

/// A callback for the library's `progress(done_bytes, total_bytes)` hooks, drawing `pb`.
pub fn hook(pb: &ProgressBar) -> impl FnMut(u64, u64) + '_ {
    move |done, total| {
        if pb.length() != Some(total) {
            pb.set_length(total);
        }
        pb.set_position(done);
    }
}
