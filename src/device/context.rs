//! The one rule for CUDA contexts: fo works in a device's primary context (the one the
//! CUDA runtime, hence torch, uses), made current for the duration of a call and popped
//! on return, so the caller's current context is what it was. Every CUDA call of fo's
//! (launches, copies, events, pointer queries, NCCL staging) goes through `Current`.
//!
//! The guard is generic over the thread's context stack: the CUDA driver's (`Cuda`,
//! feature `cuda`) and the emulated devices' (`Emulated`, unit tests), so the tests check
//! on the host that every fo call touching a device leaves the caller's context current.
use std::marker::PhantomData;

/// A per-thread stack of current contexts (`cuCtxPushCurrent` / `cuCtxPopCurrent`).
pub trait Stack {
    type Ctx: Copy;
    type Error;
    /// Makes `ctx` current on this thread, above the caller's.
    ///
    /// # Safety
    /// `ctx` must be a live context.
    unsafe fn push(ctx: Self::Ctx) -> Result<(), Self::Error>;
    /// Restores the context that was current before the matching `push`.
    ///
    /// # Safety
    /// Only after a successful `push` on this thread.
    unsafe fn pop();
}

/// Makes a context current for the lifetime of the guard, then restores the caller's
/// (on every return path, errors and panics included).
pub struct Guard<S: Stack>(PhantomData<*const S>);

impl<S: Stack> Guard<S> {
    /// Pushes `ctx` on this thread's context stack.
    ///
    /// # Safety
    /// `ctx` must be a live context (a retained primary context).
    pub unsafe fn push(ctx: S::Ctx) -> Result<Guard<S>, S::Error> {
        S::push(ctx)?;
        Ok(Guard(PhantomData))
    }
}

impl<S: Stack> Drop for Guard<S> {
    fn drop(&mut self) {
        // SAFETY: pops the context `push` made current on this thread (the guard is not
        // Send: `*const S` keeps it on its thread).
        unsafe { S::pop() }
    }
}

/// The CUDA driver's context stack.
#[cfg(feature = "cuda")]
pub struct Cuda;

#[cfg(feature = "cuda")]
impl Stack for Cuda {
    type Ctx = cudarc::driver::sys::CUcontext;
    type Error = cudarc::driver::result::DriverError;

    unsafe fn push(ctx: Self::Ctx) -> Result<(), Self::Error> {
        cudarc::driver::sys::cuCtxPushCurrent_v2(ctx).result()
    }

    unsafe fn pop() {
        let mut popped: cudarc::driver::sys::CUcontext = std::ptr::null_mut();
        let _ = cudarc::driver::sys::cuCtxPopCurrent_v2(&mut popped);
    }
}

/// The guard every CUDA call of fo's runs under.
#[cfg(feature = "cuda")]
pub type Current = Guard<Cuda>;

/// The emulated devices' context stack: a thread-local list of context handles.
#[cfg(test)]
pub struct Emulated;

#[cfg(test)]
thread_local! {
    static STACK: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(test)]
impl Emulated {
    /// The context current on this thread (0: none).
    pub fn current() -> usize {
        STACK.with(|s| s.borrow().last().copied().unwrap_or(0))
    }

    /// How many contexts are pushed on this thread.
    pub fn depth() -> usize {
        STACK.with(|s| s.borrow().len())
    }
}

#[cfg(test)]
impl Stack for Emulated {
    type Ctx = usize;
    type Error = std::convert::Infallible;

    unsafe fn push(ctx: usize) -> Result<(), Self::Error> {
        STACK.with(|s| s.borrow_mut().push(ctx));
        Ok(())
    }

    unsafe fn pop() {
        STACK.with(|s| s.borrow_mut().pop());
    }
}

#[cfg(test)]
#[path = "context_tests.rs"]
mod tests;
