//! The guard every opaque handle carries. A handle (`fo_optimizer`, `fo_comm`,
//! `fo_packed`) is a raw pointer a caller may hand to several threads; the core behind it
//! is not built for that. So every entry point *enters* the handle first: a try-lock that
//! records which call holds it. A second caller, on any thread, gets `Error::Busy` naming
//! both calls instead of a data race; nobody ever waits, so a misuse cannot hang. Destroy
//! is the one exception: it waits for the call in progress to return, then frees, so the
//! other thread never runs on freed memory.
//!
//! Background work does not hold the guard across calls: an async save's writer reads a
//! snapshot taken at the call (`ckpt::snapshot`, copy-on-write against later steps) and an
//! overlapped step's tasks own the state moved into them; while a step is open the core
//! refuses every call that would touch what they hold (`Optimizer::refuse_if_step_open`).
use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::ThreadId;

use crate::error::{Error, Result};

/// Who holds a handle: the exported call and its thread.
#[derive(Clone, Copy)]
struct Holder {
    call: &'static str,
    thread: ThreadId,
}

/// A value behind a try-lock that names its holder. `noun` names the handle in messages
/// ("the optimizer").
pub(crate) struct Handle<T> {
    noun: &'static str,
    holder: Mutex<Option<Holder>>,
    idle: Condvar,
    value: UnsafeCell<T>,
}

// The value is only reached through `Entered`, which exists for one holder at a time.
unsafe impl<T: Send> Sync for Handle<T> {}

/// Exclusive access to a handle's value for the length of one call; dropping it
/// releases the handle.
pub(crate) struct Entered<'a, T> {
    handle: &'a Handle<T>,
}

impl<T> Handle<T> {
    pub(crate) fn new(noun: &'static str, value: T) -> Self {
        Handle {
            noun,
            holder: Mutex::new(None),
            idle: Condvar::new(),
            value: UnsafeCell::new(value),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<Holder>> {
        // The mutex only guards the holder record; no code panics while holding it.
        self.holder.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn busy(&self, call: &str, h: Holder) -> Error {
        let whose = if h.thread == std::thread::current().id() {
            "on this thread (a call from inside another fo call on the same handle)"
        } else {
            "on another thread"
        };
        Error::Busy(format!(
            "{call}: {} is busy in {} {whose}; one call at a time per handle",
            self.noun, h.call
        ))
    }

    /// Takes the handle for `call`, or fails at once with `Error::Busy` if it is held.
    pub(crate) fn enter(&self, call: &'static str) -> Result<Entered<'_, T>> {
        let mut g = self.lock();
        if let Some(h) = *g {
            return Err(self.busy(call, h));
        }
        *g = Some(Holder {
            call,
            thread: std::thread::current().id(),
        });
        Ok(Entered { handle: self })
    }

    /// Waits until no call holds the handle, then keeps it held (for destroy: whoever
    /// tries to enter afterwards is told it is busy in `call` until it is freed). Fails
    /// with `Error::Busy` if the holder is this very thread, which would never return.
    pub(crate) fn wait_idle(&self, call: &'static str) -> Result<()> {
        let me = std::thread::current().id();
        let mut g = self.lock();
        while let Some(h) = *g {
            if h.thread == me {
                return Err(self.busy(call, h));
            }
            g = self.idle.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        *g = Some(Holder { call, thread: me });
        Ok(())
    }

    /// The name of the call holding the handle, if any (for tests and diagnostics).
    #[cfg(test)]
    pub(crate) fn holder(&self) -> Option<&'static str> {
        self.lock().map(|h| h.call)
    }
}

impl<T> Drop for Entered<'_, T> {
    fn drop(&mut self) {
        let mut g = self.handle.lock();
        *g = None;
        self.handle.idle.notify_all();
    }
}

impl<T> Deref for Entered<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        unsafe { &*self.handle.value.get() }
    }
}

impl<T> DerefMut for Entered<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        unsafe { &mut *self.handle.value.get() }
    }
}

/// An exported opaque struct that wraps a `Handle`: `ARG` is its argument name in
/// messages ("opt", "comm", "packed").
pub(crate) trait Guarded {
    type Inner;
    const ARG: &'static str;
    fn handle(&self) -> &Handle<Self::Inner>;
}

/// Enters the handle behind `p` for `call`; NULL is FO_ERR_INVALID_ARGUMENT naming it.
pub(crate) unsafe fn enter<'a, H: Guarded + 'a>(
    p: *const H,
    call: &'static str,
) -> Result<Entered<'a, H::Inner>> {
    super::args::arg_ref(p, H::ARG)?.handle().enter(call)
}

/// Frees a boxed handle once no call holds it (NULL is a no-op). Called from inside a
/// call on the same handle, it frees nothing and returns `Error::Busy`.
pub(crate) unsafe fn destroy<H: Guarded>(p: *mut H, call: &'static str) -> Result<()> {
    if let Some(h) = p.as_ref() {
        h.handle().wait_idle(call)?;
        drop(Box::from_raw(p));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    struct Boxed(Handle<u8>);
    impl Guarded for Boxed {
        type Inner = u8;
        const ARG: &'static str = "comm";
        fn handle(&self) -> &Handle<u8> {
            &self.0
        }
    }

    #[test]
    fn a_second_caller_is_told_which_call_holds_the_handle() {
        let h = Handle::new("the optimizer", 5u32);
        let held = h.enter("fo_optimizer_step").unwrap();
        assert_eq!(*held, 5);
        let e = std::thread::scope(|s| {
            s.spawn(|| h.enter("fo_optimizer_add_param").err().unwrap())
                .join()
                .unwrap()
        });
        assert!(matches!(e, Error::Busy(_)));
        assert_eq!(
            e.to_string(),
            "handle busy: fo_optimizer_add_param: the optimizer is busy in \
             fo_optimizer_step on another thread; one call at a time per handle"
        );
        let same = h.enter("fo_optimizer_get_state").err().unwrap().to_string();
        assert!(same.contains("on this thread"), "{same}");
        drop(held);
        assert!(h.holder().is_none());
        *h.enter("fo_optimizer_set_state").unwrap() += 1;
        assert_eq!(*h.enter("x").unwrap(), 6);
    }

    #[test]
    fn threads_hammering_one_handle_never_overlap() {
        let h = Arc::new(Handle::new("the optimizer", Vec::<u64>::new()));
        let inside = Arc::new(AtomicBool::new(false));
        let (mut ok, mut busy) = (0, 0);
        let counts: Vec<(u32, u32)> = (0..4)
            .map(|_| {
                let (h, inside) = (h.clone(), inside.clone());
                std::thread::spawn(move || {
                    let (mut ok, mut busy) = (0, 0);
                    for i in 0..2000u64 {
                        match h.enter("call") {
                            Ok(mut v) => {
                                assert!(!inside.swap(true, Ordering::SeqCst), "two holders");
                                v.push(i);
                                inside.store(false, Ordering::SeqCst);
                                ok += 1;
                            }
                            Err(Error::Busy(_)) => busy += 1,
                            Err(e) => panic!("{e}"),
                        }
                    }
                    (ok, busy)
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        for (o, b) in counts {
            ok += o;
            busy += b;
        }
        assert_eq!(ok + busy, 8000);
        assert_eq!(h.enter("len").unwrap().len(), ok as usize);
    }

    #[test]
    fn destroy_waits_for_the_call_in_progress_and_refuses_from_inside_it() {
        let p = Box::into_raw(Box::new(Boxed(Handle::new("the comm", 1u8))));
        let addr = p as usize;
        let held = unsafe { enter(p, "fo_clip_grad_norm") }.unwrap();
        let e = unsafe { destroy(p, "fo_comm_destroy") }.unwrap_err();
        assert!(e.to_string().contains("on this thread"), "{e}");
        let t =
            std::thread::spawn(move || unsafe { destroy(addr as *mut Boxed, "fo_comm_destroy") });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!t.is_finished(), "destroy must wait for the holder");
        drop(held);
        t.join().unwrap().unwrap();
        unsafe { destroy::<Boxed>(std::ptr::null_mut(), "x") }.unwrap();
    }
}
