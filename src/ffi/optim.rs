//! The optimizer handle's C ABI: its config (`fo_optim_config*`), create and destroy,
//! parameter registration and the step. What a handle holds is in `optim_state`.
use std::ffi::c_char;

use super::args::{arg_flag, arg_mut, arg_ref, arg_slice, arg_slice_mut, arg_str};
use super::handle::{destroy, enter, Entered, Guarded, Handle};
use super::status::{fo_status, guard, guard_void};
use super::types::{fo_shard_spec, fo_tensor};
use crate::error::{Error, Result};
use crate::optim::{Algorithm, Arithmetic, OptimConfig, Optimizer, StateFormat};
use crate::tensor::TensorView;

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
    pub(super) fn to_config(self) -> Result<OptimConfig> {
        let bits = u32::try_from(self.master_weight_bits).map_err(|_| {
            Error::invalid(
                "master_weight_bits",
                format!("{} is negative", self.master_weight_bits),
            )
        })?;
        Ok(OptimConfig {
            algorithm: Algorithm::from_code(self.algorithm, "algorithm")?,
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
            state_format: StateFormat::from_code(self.state_format, "state_format")?,
            master_weight_bits: bits,
            check_numerics: arg_flag(self.check_numerics, "check_numerics")?,
            arithmetic: Arithmetic::from_code(self.arithmetic, "arithmetic")?,
        })
    }

    pub(super) fn from_config(c: &OptimConfig) -> fo_optim_config {
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

/// The calls an open overlapped step lets through (`enter_opt` refuses every other call
/// on the handle with FO_ERR_BUSY until `fo_optimizer_step_end` or `_abort`): its own five, and
/// those that read only the handle's tables.
const ALLOWED_WHILE_OPEN: &[&str] = &[
    "fo_optimizer_step_begin",
    "fo_optimizer_grads_ready",
    "fo_optimizer_grads_at_end",
    "fo_optimizer_step_end",
    "fo_optimizer_step_abort",
    "fo_optimizer_grads_changed",
    "fo_optimizer_num_params",
    "fo_optimizer_get_group_config",
    "fo_optimizer_param_groups_json",
];

/// The optimizer behind `p`, held for `call` (the exported function's name) until the
/// returned guard drops: FO_ERR_BUSY if another call holds it, or if an overlapped step
/// is open and `call` is not one it lets through (`ALLOWED_WHILE_OPEN`).
pub(super) unsafe fn enter_opt<'a>(
    p: *const fo_optimizer,
    call: &'static str,
) -> Result<Entered<'a, Optimizer>> {
    let opt = enter(p, call)?;
    if !ALLOWED_WHILE_OPEN.contains(&call) {
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
            let a = Algorithm::by_code(algorithm).unwrap_or(Algorithm::AdamW);
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
        let t = arg_ref(param, "param")?.to_view("param")?;
        let spec = match shard.as_ref() {
            Some(s) => Some(s.to_spec()?),
            None => None,
        };
        *out_index = opt.add_param(fqn, t, spec, index(group, "group")?)? as i32;
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
        let views = grads
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let given = !g.data.is_null();
                given
                    .then(|| g.to_view_named(|| format!("grads[{i}]")))
                    .transpose()
            })
            .collect::<Result<Vec<Option<TensorView>>>>()?;
        opt.step(&views)
    })
}
