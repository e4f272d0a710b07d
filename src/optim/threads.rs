//! fo's own rayon pool for optimizer steps (the host's global rayon pool, if any, is
//! left alone). Size: `fo_set_num_threads`, else `FO_NUM_THREADS`, else the available cores.
//! Setting a count only records it: threads start at the first step that needs them, so
//! a bad count costs nothing and a huge one is refused before any thread exists.
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// The most threads fo's pool may have. Steps are memory-bound; past a few hundred
/// threads a step only pays for scheduling, and each thread reserves a stack.
pub const MAX_THREADS: usize = 1024;

struct Pool {
    /// The count asked for (0: the default); the pool below is built lazily from it.
    requested: usize,
    pool: Option<Arc<rayon::ThreadPool>>,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    requested: 0,
    pool: None,
});

fn default_threads() -> usize {
    std::env::var("FO_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .min(MAX_THREADS)
}

fn resolve(requested: usize) -> usize {
    if requested == 0 {
        default_threads()
    } else {
        requested
    }
}

fn build(n: usize) -> Result<Arc<rayon::ThreadPool>> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("fo-optim-{i}"))
        .build()
        .map(Arc::new)
        .map_err(|e| Error::Internal(format!("cannot start {n} optimizer threads: {e}")))
}

/// The pool steps run on (its threads start on first use).
pub fn pool() -> Result<Arc<rayon::ThreadPool>> {
    let mut g = POOL.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = g.pool.as_ref() {
        return Ok(p.clone());
    }
    let p = build(resolve(g.requested))?;
    g.pool = Some(p.clone());
    Ok(p)
}

/// Sets the number of threads used by later steps (`1..=MAX_THREADS`); 0 restores the
/// default (`FO_NUM_THREADS` or the available cores, capped at `MAX_THREADS`). No thread
/// starts here; the current pool is dropped once running steps release it.
pub fn set_num_threads(n: usize) -> Result<()> {
    if n > MAX_THREADS {
        return Err(Error::invalid(
            "n",
            format!("{n} threads requested, at most {MAX_THREADS} (0: the default)"),
        ));
    }
    let mut g = POOL.lock().unwrap_or_else(|e| e.into_inner());
    if g.pool
        .as_ref()
        .is_some_and(|p| p.current_num_threads() != resolve(n))
    {
        g.pool = None;
    }
    g.requested = n;
    Ok(())
}

/// Threads the next step will use (starts none).
pub fn num_threads() -> Result<usize> {
    let g = POOL.lock().unwrap_or_else(|e| e.into_inner());
    Ok(g.pool
        .as_ref()
        .map_or_else(|| resolve(g.requested), |p| p.current_num_threads()))
}

/// Whether the pool's threads are running (they start at the first step).
pub fn started() -> bool {
    POOL.lock()
        .unwrap_or_else(|e| e.into_inner())
        .pool
        .is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_above_the_cap_are_refused_and_setting_starts_no_thread() {
        let e = set_num_threads(100_000).unwrap_err();
        assert!(e.to_string().contains("at most 1024"), "{e}");
        // Other tests share the pool, so only what no concurrent step can change is checked
        // here; tests/bounds.rs checks in its own process that setting starts no thread.
        set_num_threads(0).unwrap();
        assert!(num_threads().unwrap() >= 1 && num_threads().unwrap() <= MAX_THREADS);
    }
}
