//! The one rule for CUDA contexts (feature `cuda`): fo works in a device's primary context
//! (the one the CUDA runtime, hence torch, uses), made current for the duration of a call
//! and popped on return, so the caller's current context is what it was. Every CUDA
//! call of fo's (launches, copies, NCCL staging) goes through `Current`.
use cudarc::driver::{result as cu, sys as cusys};

/// Makes a context current for the lifetime of the guard, then restores the caller's.
pub struct Current(());

impl Current {
    /// Pushes `ctx` on this thread's context stack.
    ///
    /// # Safety
    /// `ctx` must be a live context (a retained primary context).
    pub unsafe fn push(ctx: cusys::CUcontext) -> Result<Current, cu::DriverError> {
        cusys::cuCtxPushCurrent_v2(ctx).result()?;
        Ok(Current(()))
    }
}

impl Drop for Current {
    fn drop(&mut self) {
        let mut popped: cusys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context `push` made current on this thread.
        let _ = unsafe { cusys::cuCtxPopCurrent_v2(&mut popped) };
    }
}
