//! The C ABI of the GPU half of the step (feature `cuda`).
use std::ffi::c_void;

use super::optim::{enter_opt, fo_optimizer, index};
use super::status::{fo_status, guard};
use super::types::fo_tensor;

/// Sets the CUDA stream (`cudaStream_t` / `CUstream`, of the parameters' device) that
/// `fo_optimizer_step` launches device parameters' kernels on, and that mirror, state and
/// offloaded-gradient copies are ordered on; NULL (the default) is the legacy default
/// stream. A step does not wait for its kernels: they run after the work queued on
/// `stream` before the call, work queued on it after the call runs after them, and
/// `fo_optimizer_step` returns once they are queued (each param group's launch table
/// stays in device memory; a table that changed, because a pointer did, goes through a
/// pinned ring of 4 slots per device, so a launch may wait for the table copy of the
/// launch 4 before it, never for its own kernels). Calls that bring data to or from
/// the host do wait for the stream: reading device state (get_state, pack, save),
/// writing a mirror or device state, and bringing offloaded gradients down (the offload
/// step waits for each gradient piece it steps, and returns with the last mirror writes
/// queued, not done: work queued on `stream` after the step sees the new mirrors). Ordering
/// with other streams, and host reads of device parameters, are the caller's (events,
/// stream synchronize). A stream belongs to one device: every device parameter, mirror
/// and device gradient must be on the stream's device (this call, fo_optimizer_add_param,
/// fo_optimizer_set_mirror and fo_optimizer_step refuse anything else with
/// FO_ERR_INVALID_ARGUMENT before queuing anything; parameters on several devices use
/// NULL, each device's legacy stream, or one optimizer per device). Changing the stream
/// orders the new one after the old: an event recorded on the old stream on each device
/// in use is waited for on the new one, so step N on the old stream comes before step
/// N+1 on the new one (the old stream must still be valid at this call). Pointer rules:
/// device parameters, gradients, mirrors and fo's device state are memory of the device
/// the parameter was registered on (fo_optimizer_add_param, fo_optimizer_set_mirror and
/// fo_optimizer_step ask the driver, cuPointerGetAttribute, and refuse host memory or
/// another device's with FO_ERR_INVALID_ARGUMENT naming the argument; a step asks only
/// about gradients outside the allocations the optimizer already validated, taking an
/// allocation once validated to stay that device's memory: a gradient in memory the
/// caller freed and that became host or another device's memory is not detected); a
/// gradient must stay valid until the step's kernels
/// have run (stream order), a parameter for the optimizer's lifetime; `stream` must
/// outlive every step launched on it. A CUDA error while launching returns
/// FO_ERR_INTERNAL and leaves device parameters' state undefined (validation errors
/// change nothing, as for host steps). Without the `cuda` build feature, or when libcuda
/// or NVRTC cannot be loaded, returns FO_ERR_UNSUPPORTED naming what is missing.
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
/// model on the GPU), the step is a pipeline: gradients come down in pieces of at most
/// 4 MiB on a stream of fo's own (after the work queued on the optimizer's stream), each
/// piece is stepped on every core of fo's pool straight from pinned memory, and its
/// updated bytes go up into the mirror on a second stream of fo's own while the next
/// pieces come down and step (both copy directions at once; fo's pinned memory for this
/// is 32 MiB per device, made at the first such step and reused). The step returns once
/// the last piece is stepped and its copy queued; the optimizer's stream waits for the
/// mirror copies, so work queued there afterwards sees the new mirrors (another stream,
/// or the host, must order itself after the optimizer's stream). With `check_numerics`
/// every gradient comes down first, through a 16 MiB pinned ring, so the check precedes
/// any change. NULL `mirror` removes it. FO_ERR_UNSUPPORTED without
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
