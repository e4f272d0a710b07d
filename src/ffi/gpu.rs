//! The C ABI of the GPU half of the step (feature `cuda`).
use std::ffi::c_void;

use super::optim::{enter_opt, fo_optimizer, index};
use super::status::{fo_status, guard};
use super::types::fo_tensor;

/// Sets the CUDA stream (`cudaStream_t` / `CUstream`, of the parameters' device) that
/// `fo_optimizer_step` launches device parameters' kernels on; NULL (the default) is the
/// legacy default stream. fo never synchronizes the device: a step's kernels run after
/// the work queued on `stream` before the call, and work queued on it after the call
/// runs after them; `fo_optimizer_step` returns without waiting for them. Ordering with
/// other streams, and host reads of device parameters, are the caller's (events, stream
/// synchronize). Pointer rules: device parameters, gradients and fo's device state are
/// memory of the device the parameter was registered on; a gradient must stay valid
/// until the step's kernels have run (stream order), a parameter for the optimizer's
/// lifetime; `stream` must outlive every step launched on it. A CUDA error while
/// launching returns FO_ERR_INTERNAL and leaves device parameters' state undefined
/// (validation errors change nothing, as for host steps). Without the `cuda` build
/// feature, or when libcuda or NVRTC cannot be loaded, returns FO_ERR_UNSUPPORTED
/// naming what is missing.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_set_stream(
    opt: *mut fo_optimizer,
    stream: *mut c_void,
) -> fo_status {
    guard(|| enter_opt(opt, "fo_optimizer_set_stream")?.set_stream(stream as usize))
}

/// Gives host parameter `index` a device mirror: `mirror` is device memory (`device` >= 0)
/// of the parameter's dtype and shape, contiguous, valid until it is replaced or the
/// optimizer is destroyed. fo writes the parameter into it now and after every change:
/// each `fo_optimizer_step` that steps the parameter, and `fo_optimizer_set_state` or a
/// checkpoint load that writes it. Copies are ordered on the optimizer's stream (see
/// `fo_optimizer_set_stream`). With the mirror's gradient given on the device to
/// `fo_optimizer_step` (the offload case: state and master weights on the host, the
/// model on the GPU), the step brings each gradient down through a pinned buffer kept
/// per parameter while the CPU steps those already down, and writes each mirror back as
/// soon as its parameter is stepped. NULL `mirror` removes it. FO_ERR_UNSUPPORTED without
/// the `cuda` build feature or libcuda.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_set_mirror(
    opt: *mut fo_optimizer,
    index: i32,
    mirror: *const fo_tensor,
) -> fo_status {
    guard(|| {
        let mut opt = enter_opt(opt, "fo_optimizer_set_mirror")?;
        let i = self::index(index, "index")?;
        let m = match mirror.as_ref() {
            None => None,
            Some(t) => Some(t.to_view("mirror")?),
        };
        opt.set_mirror(i, m)
    })
}
