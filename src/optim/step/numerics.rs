//! `check_numerics` (FlashOptim's option): before a step touches anything, refuse a
//! non-finite gradient, and refuse a learning rate too small to move the largest
//! parameter at its precision (FlashOptim's rule: `log2(lr) <
//! floor(log2(maxabs)) − (master_bits − 1 − exponent_bits + log2(0.49))`, with maxabs
//! measured on the current parameter values at every step rather than cached). After
//! the step, a non-finite parameter or moment (beta near 1, eps 0 on a zero gradient, an
//! overflow) puts the checked parameters back as they were (`Undo`).
use half::f16;
use rayon::prelude::*;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::host::CHUNK;
use crate::optim::math::config::OptimConfig;
use crate::optim::math::master_split::Half;
use crate::optim::math::quant8::GROUP;
use crate::optim::math::state::{Moment, ParamState};
use crate::optim::optimizer::{Optimizer, Param};
use crate::tensor::TensorView;

fn non_finite_at(bytes: &[u8], dtype: DType) -> Option<usize> {
    let bad = |i: usize| -> bool {
        match dtype {
            DType::F32 => {
                let b = u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
                b & 0x7f80_0000 == 0x7f80_0000
            }
            DType::BF16 => u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]) & 0x7f80 == 0x7f80,
            _ => u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]) & 0x7c00 == 0x7c00,
        }
    };
    let n = bytes.len() / dtype.size();
    let starts: Vec<usize> = (0..n).step_by(CHUNK).collect();
    let c = starts
        .par_iter()
        .position_first(|&s| (s..(s + CHUNK).min(n)).any(bad))?;
    (starts[c]..n).find(|&i| bad(i))
}

/// Largest |value| of a parameter (as f32), ignoring NaN.
unsafe fn max_abs(t: &TensorView) -> f32 {
    let n = t.numel();
    let b = t.contiguous_bytes().expect("parameters are contiguous");
    let f = |i: usize| -> f32 {
        match t.dtype() {
            DType::F32 => f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()),
            DType::BF16 => {
                f32::from_bits((u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32) << 16)
            }
            _ => half::f16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])).to_f32(),
        }
    };
    (0..n)
        .into_par_iter()
        .with_min_len(CHUNK)
        .map(|i| f(i).abs())
        .reduce(|| 0.0, f32::max)
}

/// log2 of the smallest step that still changes a value of magnitude `maxabs`.
pub fn log2_min_step(dtype: DType, maxabs: f64, master_weight_bits: u32) -> f64 {
    let (width, exp_bits) = match dtype {
        DType::F16 => (2, 5),
        DType::BF16 => (2, 8),
        _ => (4, 8),
    };
    let master_bits = (width * 8).max(master_weight_bits as i32) as f64;
    let mantissa = master_bits - 1.0 - exp_bits as f64 + 0.49f64.log2();
    maxabs.log2().floor() - mantissa
}

pub(super) unsafe fn check(
    opt: &Optimizer,
    grads: &[Option<TensorView>],
    bytes: &[Option<&[u8]>],
) -> Result<()> {
    for (i, p) in opt.entries().iter().enumerate() {
        if let (Some(b), Some(g)) = (bytes[i], &grads[i]) {
            check_param(p, opt.config(p.group()), b, g.dtype())?;
        }
    }
    Ok(())
}

/// `check` for one host parameter `p` of a group with config `cfg`, given its gradient's
/// contiguous bytes `b` of dtype `grad_dtype`.
///
/// # Safety
/// `p`'s memory must be valid for reads.
pub(in crate::optim) unsafe fn check_param(
    p: &Param,
    cfg: &OptimConfig,
    b: &[u8],
    grad_dtype: DType,
) -> Result<()> {
    if !cfg.check_numerics || p.tensor().numel() == 0 {
        return Ok(());
    }
    if let Some(j) = non_finite_at(b, grad_dtype) {
        return Err(Error::Numerics(format!(
            "gradient of {} holds a non-finite value at flat index {j}; nothing was updated",
            p.fqn()
        )));
    }
    if cfg.lr == 0.0 {
        return Ok(());
    }
    let maxabs = max_abs(p.tensor()) as f64;
    if maxabs <= 0.0 || !maxabs.is_finite() {
        return Ok(());
    }
    let needed = log2_min_step(p.tensor().dtype(), maxabs, cfg.master_weight_bits);
    if needed > cfg.lr.log2() {
        return Err(Error::Numerics(format!(
            "parameter {}: learning rate {:.3e} yields steps that may be too small to change its largest \
             value {maxabs:.4e} ({} with master_weight_bits {}; resolution {:.4e}); nothing was updated",
            p.fqn(),
            cfg.lr,
            p.tensor().dtype(),
            cfg.master_weight_bits,
            needed.exp2()
        )));
    }
    Ok(())
}

/// What in stepped host parameter `p` is non-finite, if anything: its memory, or a
/// moment of its state (named for `Undo::check_result`'s message).
///
/// # Safety
/// `p`'s memory must be valid for reads.
pub(in crate::optim) unsafe fn result_non_finite(p: &Param) -> Option<String> {
    let b = p
        .tensor()
        .contiguous_bytes()
        .expect("parameters are contiguous");
    if let Some(j) = non_finite_at(b, p.tensor().dtype()) {
        return Some(format!("parameter {} at flat index {j}", p.fqn()));
    }
    let st = p.state.as_ref()?;
    [("exp_avg", &st.m), ("exp_avg_sq", &st.v)]
        .into_iter()
        .find_map(|(name, m)| {
            let j = moment_non_finite_at(m.as_ref()?)?;
            Some(format!("state {name} of {} at flat index {j}", p.fqn()))
        })
}

/// The message of a step that made `what` non-finite.
pub(in crate::optim) fn non_finite_result(what: &str) -> Error {
    Error::Numerics(format!(
        "the step made {what} non-finite (check the hyper-parameters and the loss \
         scale); nothing was updated"
    ))
}

/// What a step with `check_numerics` on may have to put back: the bytes and state of
/// every host parameter it steps under the check, taken before the step. Empty (and
/// free) when no stepped parameter's group checks numerics, so the fast path copies
/// nothing.
pub(super) struct Undo {
    saved: Vec<(usize, Vec<u8>, Option<ParamState>)>,
}

impl Undo {
    /// Records host parameters with a gradient whose group has `check_numerics` on.
    pub(super) unsafe fn capture(opt: &Optimizer, grads: &[Option<&[u8]>]) -> Result<Undo> {
        let mut saved = Vec::new();
        for (i, p) in opt.entries().iter().enumerate() {
            if grads[i].is_none() || p.device().is_cuda() || !opt.config(p.group()).check_numerics {
                continue;
            }
            let bytes = p
                .tensor()
                .contiguous_bytes()
                .expect("parameters are contiguous");
            let mut copy = crate::tensor::try_with_capacity(bytes.len(), "check_numerics undo")?;
            copy.extend_from_slice(bytes);
            saved.push((i, copy, p.state.clone()));
        }
        Ok(Undo { saved })
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.saved.is_empty()
    }

    /// After the step: if a recorded parameter, or its state, holds a non-finite value,
    /// puts every recorded parameter back and fails with `Error::Numerics` naming it.
    pub(super) unsafe fn check_result(self, opt: &mut Optimizer) -> Result<()> {
        let bad = (self.saved.iter()).find_map(|&(i, _, _)| result_non_finite(opt.entry(i)));
        let Some(what) = bad else {
            return Ok(());
        };
        for (i, bytes, state) in self.saved {
            let p = opt.entry_mut(i);
            p.tensor()
                .contiguous_bytes_mut()
                .expect("parameters are contiguous")
                .copy_from_slice(&bytes);
            ParamState::replace_in(&mut p.state, state);
        }
        Err(non_finite_result(&what))
    }
}

/// The first non-finite entry of a moment (f32 values or 16-bit patterns; for quant8,
/// the group whose fp16 scale is non-finite, as its first element's index).
fn moment_non_finite_at(m: &Moment) -> Option<usize> {
    let f16_bad = |s: &[f16]| s.iter().position(|x| !x.is_finite()).map(|g| g * GROUP);
    match m {
        Moment::F32(v) => v.iter().position(|x| !x.is_finite()),
        Moment::Half(h, v) => {
            let mask = match h {
                Half::BF16 => 0x7f80,
                Half::F16 => 0x7c00,
            };
            v.iter().position(|&x| x & mask == mask)
        }
        Moment::Signed { scales, .. } | Moment::Unsigned { scales, .. } => f16_bad(scales),
    }
}
