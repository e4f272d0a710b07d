//! The optimizer's C ABI (`fo_optimizer_*`, `fo_optim_config*`, `fo_offload_plan`,
//! thread count). Thin: check arguments, call `crate::optim`, write outputs.
use std::ffi::c_char;

use super::args::{arg_flag, arg_mut, arg_ref, arg_slice, arg_slice_mut, arg_str};
use super::handle::{destroy, enter, Entered, Guarded, Handle};
use super::status::{fo_status, guard, guard_void};
use super::types::{fo_shard_spec, fo_tensor};
use crate::error::{Error, Result};
use crate::optim::{plan_offload, Algorithm, Arithmetic, OptimConfig, Optimizer, StateFormat};
use crate::tensor::{HostTensor, Tensor};

/// An optimizer: param groups, registered parameters (borrowed, updated in place) and
/// their state. Created by `fo_optimizer_create`, freed by `fo_optimizer_destroy`. One
/// call at a time per handle (a step itself runs on fo's own thread pool): a call made
/// while another thread is inside a call on the same handle returns FO_ERR_BUSY at once,
/// naming the call in progress, and changes nothing.
pub struct fo_optimizer {
    inner: Handle<Optimizer>,
}

impl Guarded for fo_optimizer {
    type Inner = Optimizer;
    const ARG: &'static str = "opt";
    fn handle(&self) -> &Handle<Optimizer> {
        &self.inner
    }
}

/// One param group's hyper-parameters (doubles, as host frameworks hold them).
/// `algorithm`: `FO_ALGORITHM_ADAMW`, `_ADAM` (L2 decay), `_SGD` (L2 decay), `_SGDW`
/// (decoupled), `_LION`. `state_format`: `FO_STATE_FORMAT_FP32` (torch.optim's
/// arithmetic), `_PARAM_DTYPE`, `_QUANT8` (FlashOptim 0.1.4's format and arithmetic,
/// bit-exact), `_QUANT8_WIDE` (fo's opt-in variant: variance stored by its fourth root,
/// same 8 bits + fp16 scale per 32; stays on the fp32 trajectory where quant8's 255:1
/// variance range makes FlashOptim diverge).
/// `master_weight_bits`: 0, 24 (int8 error bits) or 32 (int16) for bf16/f16 params.
/// `decouple_lr`: decay by `wd·lr/initial_lr` (AdamW, SGDW, Lion). SGD dampening follows
/// torch: the first step copies the gradient undampened (FlashOptim dampens it).
/// `check_numerics`: a non-finite gradient, or a learning rate too small to move the
/// largest weight at its precision, fails the step with FO_ERR_NUMERICS, changing nothing.
/// `arithmetic`: `FO_ARITHMETIC_EXACT` (FlashOptim's bits), `FO_ARITHMETIC_FAST`
/// (reformulated, within a stated bound of exact per step); only non-fp32 state formats
/// differ. Last, so older layouts keep their offsets.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fo_optim_config {
    pub algorithm: i32,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: i32,
    pub decouple_lr: i32,
    pub initial_lr: f64,
    pub state_format: i32,
    pub master_weight_bits: i32,
    pub check_numerics: i32,
    pub arithmetic: i32,
}

impl fo_optim_config {
    fn to_config(self) -> Result<OptimConfig> {
        let bits = u32::try_from(self.master_weight_bits).map_err(|_| {
            Error::invalid(
                "master_weight_bits",
                format!("{} is negative", self.master_weight_bits),
            )
        })?;
        Ok(OptimConfig {
            algorithm: Algorithm::from_code(self.algorithm)?,
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            momentum: self.momentum,
            dampening: self.dampening,
            nesterov: arg_flag(self.nesterov, "nesterov")?,
            decouple_lr: arg_flag(self.decouple_lr, "decouple_lr")?,
            initial_lr: self.initial_lr,
            state_format: StateFormat::from_code(self.state_format)?,
            master_weight_bits: bits,
            check_numerics: arg_flag(self.check_numerics, "check_numerics")?,
            arithmetic: Arithmetic::from_code(self.arithmetic)?,
        })
    }

    fn from_config(c: &OptimConfig) -> fo_optim_config {
        fo_optim_config {
            algorithm: c.algorithm.code(),
            lr: c.lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
            momentum: c.momentum,
            dampening: c.dampening,
            nesterov: c.nesterov as i32,
            decouple_lr: c.decouple_lr as i32,
            initial_lr: c.initial_lr,
            state_format: c.state_format.code(),
            master_weight_bits: c.master_weight_bits as i32,
            check_numerics: c.check_numerics as i32,
            arithmetic: c.arithmetic.code(),
        }
    }
}

/// The optimizer behind `p`, held for `call` (the exported function's name) until the
/// returned guard drops: FO_ERR_BUSY if another call holds it, or if an overlapped step
/// is open and `call` is not one it lets through (`overlap::ALLOWED_WHILE_OPEN`).
pub(super) unsafe fn enter_opt<'a>(
    p: *const fo_optimizer,
    call: &'static str,
) -> Result<Entered<'a, Optimizer>> {
    let opt = enter(p, call)?;
    if !super::overlap::ALLOWED_WHILE_OPEN.contains(&call) {
        opt.refuse_if_step_open(call)?;
    }
    Ok(opt)
}

pub(super) fn index(i: i32, what: &str) -> Result<usize> {
    usize::try_from(i).map_err(|_| Error::invalid(what, format!("negative index {i}")))
}

/// Writes `s` plus a NUL into `buf` (`capacity` bytes); `*out_len` is always the size
/// needed (NUL included). Too small a buffer: nothing written, FO_ERR_INVALID_ARGUMENT.
pub(super) unsafe fn write_string(
    s: &str,
    buf: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> Result<()> {
    *arg_mut(out_len, "out_len")? = s.len() + 1;
    if capacity < s.len() + 1 {
        return Err(Error::invalid(
            "capacity",
            format!("{capacity} bytes is too small; {} needed", s.len() + 1),
        ));
    }
    let dst = arg_slice_mut(buf as *mut u8, s.len() + 1, "buf")?;
    dst[..s.len()].copy_from_slice(s.as_bytes());
    dst[s.len()] = 0;
    Ok(())
}

/// Fills `out` with FlashOptim 0.1.4's defaults for `algorithm` (quant8 state, 24-bit
/// master weights; AdamW lr 1e-3, betas 0.9/0.999, eps 1e-8, wd 1e-2; Adam the same with
/// wd 0; SGD/SGDW lr 1e-3, no momentum; Lion lr 1e-3, betas 0.9/0.99). An unknown
/// algorithm gives AdamW's defaults with `algorithm` left as given (create then fails).
#[no_mangle]
pub unsafe extern "C" fn fo_optim_config_default(algorithm: i32, out: *mut fo_optim_config) {
    guard_void(|| {
        if let Some(o) = out.as_mut() {
            let a = Algorithm::from_code(algorithm).unwrap_or(Algorithm::AdamW);
            *o = fo_optim_config::from_config(&OptimConfig::default_for(a));
            o.algorithm = algorithm;
        }
        Ok(())
    })
}

/// Creates an optimizer whose param group 0 is `cfg` (validated as FlashOptim does).
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_create(
    cfg: *const fo_optim_config,
    out: *mut *mut fo_optimizer,
) -> fo_status {
    guard(|| {
        let out = arg_mut(out, "out")?;
        let inner = Optimizer::new(arg_ref(cfg, "cfg")?.to_config()?)?;
        *out = Box::into_raw(Box::new(fo_optimizer {
            inner: Handle::new("the optimizer", inner),
        }));
        Ok(())
    })
}

/// Frees an optimizer and its state (NULL is a no-op). Parameters are the caller's. If
/// another thread is inside a call on `opt`, waits for that call to return, then frees
/// (a call started after destroy is the caller's use-after-free). Called from inside a
/// call on `opt` (a callback), frees nothing and records FO_ERR_BUSY's message.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_destroy(opt: *mut fo_optimizer) {
    guard_void(|| destroy(opt, "fo_optimizer_destroy"))
}

/// Registers a parameter in group 0; see `fo_optimizer_add_param_to_group`.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_add_param(
    opt: *mut fo_optimizer,
    fqn: *const c_char,
    param: *const fo_tensor,
    shard: *const fo_shard_spec,
    out_index: *mut i32,
) -> fo_status {
    fo_optimizer_add_param_to_group(opt, fqn, param, shard, 0, out_index)
}

/// Registers a parameter: contiguous memory of dtype F32, BF16 or F16, updated in place
/// by every step and borrowed until `fo_optimizer_destroy`; host memory (`device` -1),
/// or with a `cuda` build device memory (`device` >= 0: its state lives on that device,
/// and state get/set, state keys and checkpoints stage it through host memory, waiting
/// for the work queued on the optimizer's stream; see `fo_optimizer_set_stream`).
/// `shard` (NULL: not sharded) is where this local tensor lies in its DTensor; its local
/// shape must equal the tensor's. `fqn` must be unique. `*out_index` is the index grads and state use.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_add_param_to_group(
    opt: *mut fo_optimizer,
    fqn: *const c_char,
    param: *const fo_tensor,
    shard: *const fo_shard_spec,
    group: i32,
    out_index: *mut i32,
) -> fo_status {
    guard(|| {
        let mut opt = enter_opt(opt, "fo_optimizer_add_param_to_group")?;
        let (fqn, out_index) = (arg_str(fqn, "fqn")?, arg_mut(out_index, "out_index")?);
        let (t, device) = arg_ref(param, "param")?.to_view("param")?;
        let spec = match shard.as_ref() {
            Some(s) => Some(s.to_spec()?),
            None => None,
        };
        *out_index = opt.add_param_on(fqn, t, spec, index(group, "group")?, device)? as i32;
        Ok(())
    })
}

/// One step over all registered parameters: `grads[i]` (n == number of parameters) is
/// parameter i's gradient, F32/BF16/F16, any strides (contiguous on a device), on its
/// parameter's device, or on a device for a host parameter (the offload case: see
/// `fo_optimizer_set_mirror`); `data == NULL` means no gradient (the parameter is skipped
/// and gets no state). Device parameters step on their GPU while host ones step on the CPU.
/// Everything is validated first: on any error no parameter and no state has changed.
#[no_mangle]
pub unsafe extern "C" fn fo_optimizer_step(
    opt: *mut fo_optimizer,
    grads: *const fo_tensor,
    n: usize,
) -> fo_status {
    guard(|| {
        let mut opt = enter_opt(opt, "fo_optimizer_step")?;
        let grads = arg_slice(grads, n, "grads")?;
        let mut devices = vec![-1; grads.len()];
        let views = grads
            .iter()
            .enumerate()
            .map(|(i, g)| {
                if g.data.is_null() {
                    return Ok(None);
                }
                let (t, d) = g.to_view(&format!("grads[{i}]"))?;
                devices[i] = d;
                Ok(Some(t))
            })
            .collect::<Result<Vec<Option<HostTensor>>>>()?;
        opt.step_on(&views, &devices)
    })
}

/// Reads state `key` of parameter `index` into `out` (caller memory; its shape must
/// equal the state's: see `fo_optimizer_state_info`). Keys: `step` (0-dim), `exp_avg`,
/// `exp_avg_sq`, `momentum_buffer` and `master` (the f32 master weight) decode to any
/// float dtype (F32 exact); raw keys `<name>::quantized` (I8/U8), `<name>::scales` (F16)
/// and `error_bits` (I8/I16) copy as stored, in their own dtype.
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
        let t = opt.get_state_as(self::index(index, "index")?, key, dst.dtype())?;
        if t.shape != dst.shape() {
            return Err(Error::Shape(format!(
                "state {key} has shape {:?}; out has shape {:?}",
                t.shape,
                dst.shape()
            )));
        }
        dst.write_bytes(&t.data)
    })
}

/// The dtype and shape `fo_optimizer_get_state` gives for `key` as stored (`shape` has
/// room for FO_MAX_DIMS entries).
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
        let t = enter_opt(opt, "fo_optimizer_state_info")?
            .get_state(self::index(index, "index")?, arg_str(key, "key")?)?;
        let (dt, nd) = (
            arg_mut(out_dtype, "out_dtype")?,
            arg_mut(out_ndim, "out_ndim")?,
        );
        let shape = arg_slice_mut(out_shape, super::FO_MAX_DIMS, "out_shape")?;
        (*dt, *nd) = (t.dtype.code(), t.shape.len() as i32);
        shape
            .iter_mut()
            .zip(t.shape.iter().chain(std::iter::repeat(&0)))
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
/// bits must stay as they are).
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
        if g >= opt.num_groups() {
            return Err(Error::invalid(
                "group",
                format!("{g} is out of range ({} groups)", opt.num_groups()),
            ));
        }
        *arg_mut(out, "out")? = fo_optim_config::from_config(opt.group_config(g));
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
            let i = self::index(index, "index")?;
            opt.check_index(i)?;
            opt.state_bytes(i)
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
        let i = self::index(index, "index")?;
        opt.check_index(i)?;
        write_string(&opt.state_keys(i).join("\n"), buf, capacity, out_len)
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
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::invalid(
                "fraction",
                format!("{fraction} is outside [0, 1]"),
            ));
        }
        let plan = plan_offload(&sizes, fraction);
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
