//! Locking without poisoning: fo's locks guard state that stays consistent when a holder
//! panics (every entry point catches panics, so a poisoned lock would otherwise fail each
//! later call on a handle that is still sound).

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, taking it over from a holder that panicked.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
