//! How fo waits for a NCCL collective: never a plain stream synchronize, which hangs for
//! ever on a dead rank, takes an aborted communicator's garbage as success, and a
//! non-blocking communicator's "in progress" as done. Instead it polls the stream and
//! `ncclCommGetAsyncError` until the work is done, NCCL reports an error, or the timeout
//! passes; on an error or the timeout the communicator is aborted (so the other ranks'
//! waits fail too instead of hanging) and the error carries NCCL's message. The loop is
//! written over `Pending` so it is tested without a GPU.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// The timeout when `FO_NCCL_TIMEOUT_S` is not set: torch's default for NCCL process groups.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// `FO_NCCL_TIMEOUT_S` (seconds, > 0) or `DEFAULT_TIMEOUT`.
pub(crate) fn timeout() -> Result<Duration> {
    match std::env::var("FO_NCCL_TIMEOUT_S") {
        Err(_) => Ok(DEFAULT_TIMEOUT),
        Ok(s) => match s.trim().parse::<f64>() {
            Ok(v) if v > 0.0 && v.is_finite() => Ok(Duration::from_secs_f64(v)),
            _ => Err(Error::invalid(
                "FO_NCCL_TIMEOUT_S",
                format!("{s:?} is not a positive number of seconds"),
            )),
        },
    }
}

/// One collective in flight.
pub(crate) trait Pending {
    /// Whether every piece of work queued on the stream has finished.
    fn done(&self) -> Result<bool>;
    /// NCCL's asynchronous error in its words, or None (none yet, or "in progress").
    fn failure(&self) -> Option<String>;
    /// Aborts the communicator.
    fn abort(&self);
}

/// Waits for `p` (see the module doc); `what` names the collective in errors.
pub(crate) fn wait(p: &impl Pending, timeout: Duration, what: &str) -> Result<()> {
    let start = Instant::now();
    let mut nap = Duration::from_micros(2);
    loop {
        let done = p.done();
        // Checked after `done`: an aborted communicator's kernels finish too.
        if let Some(e) = p.failure() {
            p.abort();
            return Err(Error::Comm(format!(
                "{what}: {e}; fo aborted the NCCL communicator"
            )));
        }
        if done? {
            return Ok(());
        }
        if start.elapsed() >= timeout {
            p.abort();
            return Err(Error::Comm(format!(
                "{what}: not finished after {:.1} s (a rank that never joined, or a hung \
                 peer?); fo aborted the NCCL communicator (FO_NCCL_TIMEOUT_S sets the limit)",
                timeout.as_secs_f64()
            )));
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// Done after `done_after` polls; fails (NCCL-style) from poll `fail_at`.
    #[derive(Default)]
    struct Fake {
        polls: Cell<u32>,
        done_after: Option<u32>,
        fail_at: Option<u32>,
        aborted: Cell<u32>,
    }

    impl Pending for Fake {
        fn done(&self) -> Result<bool> {
            self.polls.set(self.polls.get() + 1);
            Ok(self.done_after.is_some_and(|n| self.polls.get() >= n))
        }
        fn failure(&self) -> Option<String> {
            self.fail_at
                .filter(|&n| self.polls.get() >= n)
                .map(|_| "NCCL error 6 (remote process exited or there was a network error)".into())
        }
        fn abort(&self) {
            self.aborted.set(self.aborted.get() + 1);
        }
    }

    const LONG: Duration = Duration::from_secs(30);

    #[test]
    fn finishes_when_the_stream_does_and_aborts_nothing() {
        let f = Fake {
            done_after: Some(5),
            ..Fake::default()
        };
        wait(&f, LONG, "broadcast").unwrap();
        assert_eq!((f.polls.get(), f.aborted.get()), (5, 0));
    }

    #[test]
    fn an_async_error_aborts_and_carries_nccls_words_even_when_the_stream_is_done() {
        let f = Fake {
            done_after: Some(3),
            fail_at: Some(3),
            ..Fake::default()
        };
        let e = wait(&f, LONG, "all_reduce_f64").unwrap_err();
        assert!(matches!(e, Error::Comm(_)), "{e:?}");
        let m = e.to_string();
        assert!(
            m.contains("all_reduce_f64: NCCL error 6 (remote process"),
            "{m}"
        );
        assert!(m.contains("aborted"), "{m}");
        assert_eq!(f.aborted.get(), 1);
    }

    #[test]
    fn a_rank_that_never_comes_times_out_and_aborts() {
        let f = Fake::default();
        let t0 = Instant::now();
        let e = wait(&f, Duration::from_millis(30), "scatter")
            .unwrap_err()
            .to_string();
        assert!(t0.elapsed() >= Duration::from_millis(30));
        assert!(e.contains("scatter: not finished after 0.0 s"), "{e}");
        assert!(e.contains("FO_NCCL_TIMEOUT_S"), "{e}");
        assert_eq!(f.aborted.get(), 1);
        assert!(f.polls.get() > 3, "it polled, it did not block");
    }
}
