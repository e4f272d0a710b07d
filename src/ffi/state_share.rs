//! The C ABI of lent state (`Optimizer::share_state`): a handle that keeps an f32 state
//! buffer alive and live for a caller that reads it in place, as torch's `state_dict()`
//! hands out references to its state tensors.
use std::ffi::c_char;

use super::args::{arg_mut, arg_str};
use super::handle::{destroy, Guarded, Handle};
use super::optim::{enter_opt, fo_optimizer, index};
use super::status::{fo_status, guard, guard_void};
use crate::optim::math::live::Share;

/// A hold on an optimizer's live float32 state buffer, from `fo_optimizer_share_state`;
/// freed by `fo_state_share_destroy`.
pub struct fo_state_share {
    inner: Handle<Share>,
}

impl Guarded for fo_state_share {
    type Inner = Share;
    const ARG: &'static str = "share";
    fn handle(&self) -> &Handle<Share> {
        &self.inner
    }
}

/// Lends the live float32 storage of state `key` (`exp_avg`, `exp_avg_sq` or
/// `momentum_buffer`) of host parameter `index`, without copying: `*out_data` points at
/// its `*out_numel` elements (the parameter's, row-major), valid until
/// `fo_state_share_destroy(*out)`, even after the optimizer is destroyed. While the state
/// keeps its format, every step, `fo_optimizer_set_state`, checkpoint load and
/// overlapped-step rollback writes its values there in place, and writes through the
/// pointer are writes to the state (as edits of torch's state tensors are); do neither
/// while a step runs on this optimizer. An async save started while a share is held copies
/// that parameter's state at its call. State that is not float32 on the host (quant8,
/// `param_dtype`, a CUDA parameter's) is FO_ERR_UNSUPPORTED naming its format: read it
/// with `fo_optimizer_get_state`. A parameter without state is FO_ERR_NOT_FOUND.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_share_state(
    opt: *const fo_optimizer,
    index: i32,
    key: *const c_char,
    out: *mut *mut fo_state_share,
    out_data: *mut *mut f32,
    out_numel: *mut i64,
) -> fo_status {
    guard(|| {
        let (opt, key) = (
            enter_opt(opt, "fo_optimizer_share_state")?,
            arg_str(key, "key")?,
        );
        let (out, data, numel) = (
            arg_mut(out, "out")?,
            arg_mut(out_data, "out_data")?,
            arg_mut(out_numel, "out_numel")?,
        );
        let share = opt.share_state(self::index(index, "index")?, key)?;
        (*data, *numel) = (share.as_ptr(), share.len() as i64);
        *out = Box::into_raw(Box::new(fo_state_share {
            inner: Handle::new("the state share", share),
        }));
        Ok(())
    })
}

/// Releases a hold from `fo_optimizer_share_state` (NULL is a no-op); the memory is freed
/// once neither the optimizer nor any share needs it.
#[no_mangle]
pub unsafe extern "C" fn fo_state_share_destroy(share: *mut fo_state_share) {
    guard_void(|| destroy(share, "fo_state_share_destroy"))
}
