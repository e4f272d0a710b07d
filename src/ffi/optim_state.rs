//! The C ABI of what an optimizer holds: state by key (get, set, info, keys), param
//! groups (add, lr, config, `param_groups` JSON), counts and bytes; plus the offload plan and thread count.
use std::ffi::c_char;

use super::args::{arg_mut, arg_ref, arg_slice, arg_slice_mut, arg_str};
use super::optim::{enter_opt, fo_optim_config, fo_optimizer, index, write_string};
use super::status::{fo_status, guard};
use super::types::fo_tensor;
use crate::error::{Error, Result};
use crate::optim::plan_offload;
use crate::tensor::Tensor;

/// Reads state `key` of parameter `index` into `out` (caller memory; its shape must
/// equal the state's: see `fo_optimizer_state_info`). Keys: `step` (0-dim), `exp_avg`,
/// `exp_avg_sq`, `momentum_buffer` and `master` (the f32 master weight) decode to any
/// float dtype (F32 exact); raw keys `<name>::quantized` (I8/U8), `<name>::scales` (F16)
/// and `error_bits` (I8/I16) copy as stored, in their own dtype. Decodes straight into
/// `out`, in parallel on fo's threads (`fo_set_num_threads`); nothing is written when
/// the key, dtype or shape is wrong.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_get_state(
    opt: *const fo_optimizer,
    index: i32,
    key: *const c_char,
    out: *mut fo_tensor,
) -> fo_status {
    guard(|| {
        let (opt, key) = (
            enter_opt(opt, "fo_optimizer_get_state")?,
            arg_str(key, "key")?,
        );
        let dst = arg_ref(out, "out")?.to_host("out")?;
        opt.get_state_into(self::index(index, "index")?, key, &dst)
    })
}

/// The dtype and shape `fo_optimizer_get_state` gives for `key` as stored (`shape` has
/// room for FO_MAX_DIMS entries). Nothing is decoded.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_state_info(
    opt: *const fo_optimizer,
    index: i32,
    key: *const c_char,
    out_dtype: *mut i32,
    out_ndim: *mut i32,
    out_shape: *mut i64,
) -> fo_status {
    guard(|| {
        let (dtype, shape) = enter_opt(opt, "fo_optimizer_state_info")?
            .state_info(self::index(index, "index")?, arg_str(key, "key")?)?;
        let (dt, nd) = (
            arg_mut(out_dtype, "out_dtype")?,
            arg_mut(out_ndim, "out_ndim")?,
        );
        let out = arg_slice_mut(out_shape, super::FO_MAX_DIMS, "out_shape")?;
        (*dt, *nd) = (dtype.code(), shape.len() as i32);
        out.iter_mut()
            .zip(shape.iter().chain(std::iter::repeat(&0)))
            .for_each(|(o, &s)| *o = s as i64);
        Ok(())
    })
}

/// Loads `n` state entries (`keys[i]` from `values[i]`, host tensors) into parameter
/// `index`, creating its state if absent. Accepts portable keys (`exp_avg`, ... in any
/// float dtype; quantized on load for quant8 formats), raw keys (`<name>::quantized` with
/// `<name>::scales` as F16 or FlashOptim's BF16 view; `error_bits` as I8/I16 or
/// FlashOptim's BF16 form), `step`, and `master` (rounded into the parameter, error bits
/// split off). All entries are checked before anything changes.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_set_state(
    opt: *mut fo_optimizer,
    index: i32,
    keys: *const *const c_char,
    values: *const fo_tensor,
    n: usize,
) -> fo_status {
    guard(|| {
        let mut opt = enter_opt(opt, "fo_optimizer_set_state")?;
        let (keys, values) = (arg_slice(keys, n, "keys")?, arg_slice(values, n, "values")?);
        let entries = keys
            .iter()
            .zip(values)
            .enumerate()
            .map(|(i, (&k, v))| {
                Ok((arg_str(k, &format!("keys[{i}]"))?.to_string(), {
                    let what = format!("values[{i}]");
                    v.to_host(&what)?.try_to_tensor(&what)?
                }))
            })
            .collect::<Result<Vec<(String, Tensor)>>>()?;
        opt.set_states(self::index(index, "index")?, &entries)
    })
}

/// Adds a param group with its own hyper-parameters; `*out_group` is its index.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_add_param_group(
    opt: *mut fo_optimizer,
    cfg: *const fo_optim_config,
    out_group: *mut i32,
) -> fo_status {
    guard(|| {
        let (mut opt, out) = (
            enter_opt(opt, "fo_optimizer_add_param_group")?,
            arg_mut(out_group, "out_group")?,
        );
        *out = opt.add_param_group(arg_ref(cfg, "cfg")?.to_config()?)? as i32;
        Ok(())
    })
}

/// Sets group `group`'s learning rate for the following steps (LR schedules).
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_set_group_lr(
    opt: *mut fo_optimizer,
    group: i32,
    lr: f64,
) -> fo_status {
    guard(|| enter_opt(opt, "fo_optimizer_set_group_lr")?.set_group_lr(index(group, "group")?, lr))
}

/// Replaces group `group`'s hyper-parameters (algorithm, state format and master weight
/// bits must stay as they are, and SGD's momentum cannot be turned on once a parameter of
/// the group was stepped without it: FO_ERR_INVALID_ARGUMENT names it).
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_set_group_config(
    opt: *mut fo_optimizer,
    group: i32,
    cfg: *const fo_optim_config,
) -> fo_status {
    guard(|| {
        enter_opt(opt, "fo_optimizer_set_group_config")?
            .set_group_config(index(group, "group")?, arg_ref(cfg, "cfg")?.to_config()?)
    })
}

/// Reads group `group`'s hyper-parameters.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_get_group_config(
    opt: *const fo_optimizer,
    group: i32,
    out: *mut fo_optim_config,
) -> fo_status {
    guard(|| {
        let (opt, g) = (
            enter_opt(opt, "fo_optimizer_get_group_config")?,
            index(group, "group")?,
        );
        let cfg = fo_optim_config::from_config(opt.group_config(g)?);
        *arg_mut(out, "out")? = cfg;
        Ok(())
    })
}

/// The number of registered parameters.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_num_params(
    opt: *const fo_optimizer,
    out: *mut i32,
) -> fo_status {
    guard(|| {
        *arg_mut(out, "out")? = enter_opt(opt, "fo_optimizer_num_params")?.num_params() as i32;
        Ok(())
    })
}

/// Bytes of optimizer state held for parameter `index` (moments, quantization scales,
/// error bits; not the step counter), or for all parameters when `index` is -1.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_state_bytes(
    opt: *const fo_optimizer,
    index: i32,
    out: *mut u64,
) -> fo_status {
    guard(|| {
        let opt = enter_opt(opt, "fo_optimizer_state_bytes")?;
        let out = arg_mut(out, "out")?;
        *out = if index == -1 {
            opt.total_state_bytes()
        } else {
            opt.state_bytes(self::index(index, "index")?)?
        } as u64;
        Ok(())
    })
}

/// The native state keys of parameter `index`, newline-separated, NUL-terminated, into
/// `buf` (`capacity` bytes); empty before its first step. `*out_len` is always the size
/// needed; when it exceeds `capacity` nothing is written (FO_ERR_INVALID_ARGUMENT).
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_state_keys(
    opt: *const fo_optimizer,
    index: i32,
    buf: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> fo_status {
    guard(|| {
        let opt = enter_opt(opt, "fo_optimizer_state_keys")?;
        let keys = opt.state_keys(self::index(index, "index")?)?;
        write_string(&keys.join("\n"), buf, capacity, out_len)
    })
}

/// torch-like `param_groups` (hyper-parameters, FQNs under "params") as JSON, into
/// `buf` like `fo_optimizer_state_keys`.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_param_groups_json(
    opt: *const fo_optimizer,
    buf: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> fo_status {
    guard(|| {
        write_string(
            &enter_opt(opt, "fo_optimizer_param_groups_json")?
                .param_groups_json()
                .to_string(),
            buf,
            capacity,
            out_len,
        )
    })
}

/// Megatron's offload plan: visiting the `n` parameter sizes in order, `out[i]` = 1 while
/// the offloaded numel is below `fraction × total` (the parameter crossing it included).
#[no_mangle]
pub unsafe extern "C" fn fo_offload_plan(
    numels: *const i64,
    n: usize,
    fraction: f64,
    out: *mut i32,
) -> fo_status {
    guard(|| {
        let sizes = super::args::arg_dims(arg_slice(numels, n, "numels")?, "numels")?;
        let plan = plan_offload(&sizes, fraction)?;
        arg_slice_mut(out, n, "out")?
            .iter_mut()
            .zip(plan)
            .for_each(|(o, p)| *o = p as i32);
        Ok(())
    })
}

/// Threads used by optimizer steps (fo's own pool). 0 restores the default:
/// `FO_NUM_THREADS` if set, else the available cores (capped at 1024). More than 1024
/// (`FO_MAX_THREADS`) is FO_ERR_INVALID_ARGUMENT. Threads start at the next step, not here.
#[no_mangle]
pub unsafe extern "C" fn fo_set_num_threads(n: i32) -> fo_status {
    guard(|| {
        crate::optim::set_num_threads(
            usize::try_from(n)
                .map_err(|_| Error::invalid("n", format!("negative thread count {n}")))?,
        )
    })
}

/// The number of threads the next step will use.
#[no_mangle]
pub unsafe extern "C" fn fo_get_num_threads(out: *mut i32) -> fo_status {
    guard(|| {
        *arg_mut(out, "out")? = crate::optim::num_threads()? as i32;
        Ok(())
    })
}
