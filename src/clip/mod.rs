//! `clip_grad_norm`: the global gradient norm across ranks, FSDP2-safe, and the clip.
//!
//! Each local gradient is a shard (its `|g|^p` sums across ranks) or replicated/plain
//! (identical on every rank: counted once). Every rank issues the same collectives
//! whatever it holds (a rank with no gradients still takes part), so nobody hangs:
//! one agreement on local argument checks, one all-reduce max, one all-reduce sum.
mod norms;

use crate::comm::{agree, Comm, ReduceOp};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::TensorView;

/// torch's `clip_grad_norm_` epsilon: `clip_coef = max_norm / (total_norm + 1e-6)`.
pub const EPS: f64 = 1e-6;

/// One local gradient for `clip_grad_norm_checked`.
#[derive(Clone)]
pub struct ClipGrad {
    /// In host memory, or contiguous memory of a CUDA device, summed and scaled by fo's
    /// kernels in order on the legacy default stream (for p = 1, 2, infinity; other p
    /// copy the gradient down to sum it), finished when the call returns. The norm is
    /// the host's, bit for bit.
    pub tensor: TensorView,
    /// This rank's shard of a sharded gradient (summed across ranks), else replicated
    /// or plain (identical on every rank: counted once).
    pub is_shard: bool,
}

/// Per-rank partial results: (shard max |g|, shard sum |g|^p, replicated part, non-finite flag).
struct Partial {
    shard_max: f64,
    shard_sum: f64,
    replicated: f64,
    /// 2 when a NaN was seen, 1 when an infinity was (and no NaN), else 0.
    nonfinite: f64,
}

/// `max_norm` >= 0 and `norm_type` > 0 (or infinity).
pub(crate) fn check_norm_args(max_norm: f64, p: f64) -> Result<()> {
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(Error::invalid(
            "max_norm",
            format!("must be >= 0, got {max_norm}"),
        ));
    }
    if p.is_nan() || p <= 0.0 {
        return Err(Error::invalid(
            "norm_type",
            format!("must be > 0 or infinity, got {p}"),
        ));
    }
    Ok(())
}

unsafe fn local_partial(
    grads: &[ClipGrad],
    max_norm: f64,
    p: f64,
    stream: usize,
) -> Result<Partial> {
    check_norm_args(max_norm, p)?;
    for (i, c) in grads.iter().enumerate() {
        let g = &c.tensor;
        if !matches!(
            g.dtype(),
            DType::F32 | DType::BF16 | DType::F16 | DType::F64
        ) {
            return Err(Error::Dtype(format!(
                "grads[{i}] is {}: gradients must be F32, BF16, F16 or F64",
                g.dtype()
            )));
        }
        if c.tensor.device().is_cuda() {
            let arg = format!("grads[{i}]");
            let a = crate::device::check::DeviceArg {
                arg: &arg,
                context: "",
                noun: "gradient",
                by_arg: true,
            };
            // SAFETY: the address is only looked up.
            unsafe { crate::device::check::check_tensor(g, &a) }?;
        }
    }
    let norms = norms::norms(grads, p, stream)?;
    Ok(fold(grads.iter().map(|g| g.is_shard).zip(norms), p))
}

/// Adds up per-gradient `(largest |g|, sum |g|^p)` in list order: shards into one sum,
/// replicated gradients into another (max for the infinity norm).
fn fold(per: impl Iterator<Item = (bool, (f64, f64))>, p: f64) -> Partial {
    let mut part = Partial {
        shard_max: 0.0,
        shard_sum: 0.0,
        replicated: 0.0,
        nonfinite: 0.0,
    };
    for (is_shard, (mx, sum)) in per {
        part.nonfinite = part.nonfinite.max(if mx.is_nan() {
            2.0
        } else if mx.is_infinite() {
            1.0
        } else {
            0.0
        });
        if is_shard {
            part.shard_max = part.shard_max.max(mx);
            part.shard_sum += sum;
        } else if p.is_infinite() {
            part.replicated = part.replicated.max(mx);
        } else {
            part.replicated += sum;
        }
    }
    part
}

/// The total `norm_type`-norm of all ranks' gradients (`f64::INFINITY`: the max norm);
/// when it exceeds `max_norm`, every gradient is scaled in place by
/// `max_norm / (total + 1e-6)` (computed in f32 for f32/bf16/f16 gradients, as torch does).
/// With `error_if_nonfinite`, a NaN or infinite total is an error on every rank and
/// nothing is scaled; without it, a non-finite total scales like torch (to NaN/0).
///
/// # Safety
/// Every gradient must point at valid, writable memory for the call.
pub unsafe fn clip_grad_norm(
    comm: &Comm,
    grads: &[(TensorView, bool)],
    max_norm: f64,
    norm_type: f64,
    error_if_nonfinite: bool,
) -> Result<f64> {
    let grads = grads
        .iter()
        .map(|(tensor, is_shard)| ClipGrad {
            tensor: tensor.clone(),
            is_shard: *is_shard,
        })
        .collect();
    clip_grad_norm_checked(comm, Ok(grads), max_norm, norm_type, error_if_nonfinite)
}

/// `clip_grad_norm` for callers whose arguments may have failed to convert on this rank
/// (the C ABI): the failure becomes every rank's error instead of a hang.
///
/// # Safety
/// As `clip_grad_norm`.
pub unsafe fn clip_grad_norm_checked(
    comm: &Comm,
    grads: Result<Vec<ClipGrad>>,
    max_norm: f64,
    norm_type: f64,
    error_if_nonfinite: bool,
) -> Result<f64> {
    let local =
        grads.and_then(|g| local_partial(&g, max_norm, norm_type, comm.stream()).map(|p| (g, p)));
    let (grads, part) = match local {
        Ok((g, p)) => (g, Ok(p)),
        Err(e) => (Vec::new(), Err(e)),
    };
    let total = reduce_total(comm, part, max_norm, norm_type, error_if_nonfinite)?;
    let coef = clip_coef(max_norm, total);
    if needs_scaling(coef) {
        norms::scale_all(&grads, coef, comm.stream())?;
    }
    Ok(total)
}

/// The collective half of `clip_grad_norm`: every rank's partial results (or its local
/// error, which then fails every rank alike) combined into the total norm, with the
/// checks that every rank passed the same arguments and `error_if_nonfinite`'s refusal.
/// The overlapped step (`optim::overlap`) combines its per-gradient partials here too,
/// so its total has `clip_grad_norm`'s bits.
fn reduce_total(
    comm: &Comm,
    local: Result<Partial>,
    max_norm: f64,
    norm_type: f64,
    error_if_nonfinite: bool,
) -> Result<f64> {
    let part = agree(comm, local)?;
    // Replicated gradients are identical on every rank: counted once, and made
    // bit-identical by the max (their |g|^p sum for finite p, their max for infinity).
    // The same all-reduce checks that every rank passed the same norm_type, max_norm and
    // error_if_nonfinite (their max and, negated, min): partial sums of different norms
    // cannot be added, and a disagreement fails every rank alike before anything scales.
    let flag = error_if_nonfinite as u8 as f64;
    let mut mx = [
        part.shard_max,
        part.replicated,
        part.nonfinite,
        norm_type,
        -norm_type,
        max_norm,
        -max_norm,
        flag,
        -flag,
    ];
    comm.all_reduce_f64(&mut mx, ReduceOp::Max)?;
    for (name, hi, lo) in [
        ("norm_type", mx[3], -mx[4]),
        ("max_norm", mx[5], -mx[6]),
        ("error_if_nonfinite", mx[7], -mx[8]),
    ] {
        if hi != lo {
            return Err(Error::invalid(
                name,
                format!(
                    "ranks disagree: values from {lo} to {hi} across the group; every rank \
                     must pass the same {name}"
                ),
            ));
        }
    }
    let mut sum = [part.shard_sum];
    comm.all_reduce_f64(&mut sum, ReduceOp::Sum)?;
    let total = if mx[2] >= 2.0 {
        f64::NAN
    } else if mx[2] >= 1.0 {
        f64::INFINITY
    } else if norm_type.is_infinite() {
        mx[0].max(mx[1])
    } else {
        let s = sum[0] + mx[1];
        if norm_type == 2.0 {
            s.sqrt()
        } else if norm_type == 1.0 {
            s
        } else {
            s.powf(1.0 / norm_type)
        }
    };
    if error_if_nonfinite && !total.is_finite() {
        return Err(Error::Numerics(format!(
            "the total {norm_type}-norm of the gradients is {total}; nothing was scaled"
        )));
    }
    Ok(total)
}

/// `clip_grad_norm`'s total from per-gradient `(is_shard, (largest |g|, sum |g|^p))` in
/// list order (each from `grad_norms`), or this rank's local error; collective as
/// `clip_grad_norm`.
pub(crate) fn total_from_partials(
    comm: &Comm,
    local: Result<Vec<(bool, (f64, f64))>>,
    max_norm: f64,
    norm_type: f64,
    error_if_nonfinite: bool,
) -> Result<f64> {
    let local = local.and_then(|per| {
        check_norm_args(max_norm, norm_type)?;
        Ok(fold(per.into_iter(), norm_type))
    });
    reduce_total(comm, local, max_norm, norm_type, error_if_nonfinite)
}

/// torch's clip coefficient `max_norm / (total + 1e-6)` (used unclamped: it scales only
/// when `needs_scaling`, which is torch's `clamp(max=1)` without a multiply by 1).
pub(crate) fn clip_coef(max_norm: f64, total: f64) -> f64 {
    max_norm / (total + EPS)
}

/// Whether `clip_grad_norm` scales the gradients for clip coefficient `coef`.
pub(crate) fn needs_scaling(coef: f64) -> bool {
    coef < 1.0 || coef.is_nan()
}

/// Each gradient's `(largest |g|, sum of |g|^p)`, as `clip_grad_norm` computes it.
///
/// # Safety
/// As `clip_grad_norm`; the gradients are F32, BF16 or F16 (on a device: contiguous).
pub(crate) unsafe fn grad_norms(
    grads: &[ClipGrad],
    p: f64,
    stream: usize,
) -> Result<Vec<(f64, f64)>> {
    norms::norms(grads, p, stream)
}

/// Scales every gradient by `coef` as `clip_grad_norm` does.
///
/// # Safety
/// As `clip_grad_norm`.
pub(crate) unsafe fn scale_grads(grads: &[ClipGrad], coef: f64, stream: usize) -> Result<()> {
    norms::scale_all(grads, coef, stream)
}

#[cfg(test)]
mod tests;
