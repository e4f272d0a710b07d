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
use crate::tensor::HostTensor;

/// torch's `clip_grad_norm_` epsilon: `clip_coef = max_norm / (total_norm + 1e-6)`.
pub const EPS: f64 = 1e-6;

/// One local gradient for `clip_grad_norm_checked`.
#[derive(Clone)]
pub struct ClipGrad {
    pub tensor: HostTensor,
    /// This rank's shard of a sharded gradient (summed across ranks), else replicated
    /// or plain (identical on every rank: counted once).
    pub is_shard: bool,
    /// -1: host memory. >= 0: contiguous memory of that CUDA device, summed and scaled
    /// by fo's kernels in order on the legacy default stream (for p = 1, 2, infinity;
    /// other p copy the gradient down to sum it), finished when the call returns. The
    /// norm is the host's, bit for bit.
    pub device: i32,
}

/// Per-rank partial results: (shard max |g|, shard sum |g|^p, replicated part, non-finite flag).
struct Partial {
    shard_max: f64,
    shard_sum: f64,
    replicated: f64,
    /// 2 when a NaN was seen, 1 when an infinity was (and no NaN), else 0.
    nonfinite: f64,
}

unsafe fn local_partial(
    grads: &[ClipGrad],
    max_norm: f64,
    p: f64,
    stream: usize,
) -> Result<Partial> {
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
        if c.device >= 0 {
            let arg = format!("grads[{i}]");
            let a = crate::device::check::DeviceArg {
                arg: &arg,
                context: "",
                noun: "gradient",
                by_arg: true,
            };
            // SAFETY: the address is only looked up.
            unsafe { crate::device::check::check_tensor(g, c.device, &a) }?;
        }
    }
    let mut part = Partial {
        shard_max: 0.0,
        shard_sum: 0.0,
        replicated: 0.0,
        nonfinite: 0.0,
    };
    for (g, (mx, sum)) in grads.iter().zip(norms::norms(grads, p, stream)?) {
        part.nonfinite = part.nonfinite.max(if mx.is_nan() {
            2.0
        } else if mx.is_infinite() {
            1.0
        } else {
            0.0
        });
        if g.is_shard {
            part.shard_max = part.shard_max.max(mx);
            part.shard_sum += sum;
        } else if p.is_infinite() {
            part.replicated = part.replicated.max(mx);
        } else {
            part.replicated += sum;
        }
    }
    Ok(part)
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
    grads: &[(HostTensor, bool)],
    max_norm: f64,
    norm_type: f64,
    error_if_nonfinite: bool,
) -> Result<f64> {
    let grads = grads
        .iter()
        .map(|(tensor, is_shard)| ClipGrad {
            tensor: tensor.clone(),
            is_shard: *is_shard,
            device: -1,
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
    let (grads, part) = agree(comm, local)?;
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
    let coef = max_norm / (total + EPS);
    if coef < 1.0 || coef.is_nan() {
        norms::scale_all(&grads, coef, comm.stream())?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests;
