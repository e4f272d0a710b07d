//! `clip_grad_norm`: the global gradient norm across ranks, FSDP2-safe, and the clip.
//!
//! Each local gradient is a shard (its `|g|^p` sums across ranks) or replicated/plain
//! (identical on every rank: counted once). Every rank issues the same collectives
//! whatever it holds (a rank with no gradients still takes part), so nobody hangs:
//! one agreement on local argument checks, one all-reduce max, one all-reduce sum.
use half::{bf16, f16};

use crate::comm::{agree, Comm, ReduceOp};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::gpu::backend::{read_tensor, write_tensor};
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
    /// -1: host memory. >= 0: contiguous memory of that CUDA device, read and written
    /// through host memory in order on the legacy default stream (the norm is then the
    /// host's, bit for bit, at the cost of copying the gradient down, and up when scaled).
    pub device: i32,
}

/// # Safety
/// The gradient's memory must be valid (the caller of clip_grad_norm promised it).
unsafe fn values(g: &ClipGrad) -> Result<Vec<f64>> {
    let b = read_tensor(&g.tensor, g.device, 0)?;
    Ok(match g.tensor.dtype() {
        DType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        DType::F64 => b
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        _ => unreachable!("dtype checked"),
    })
}

/// Per-rank partial results: (shard max |g|, shard sum |g|^p, replicated part, non-finite flag).
struct Partial {
    shard_max: f64,
    shard_sum: f64,
    replicated: f64,
    /// 2 when a NaN was seen, 1 when an infinity was (and no NaN), else 0.
    nonfinite: f64,
}

unsafe fn local_partial(grads: &[ClipGrad], max_norm: f64, p: f64) -> Result<Partial> {
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
            if !g.is_contiguous() {
                return Err(Error::invalid(
                    format!("grads[{i}]"),
                    format!(
                        "a device gradient must be contiguous (strides {:?} for shape {:?})",
                        g.strides(),
                        g.shape()
                    ),
                ));
            }
            crate::optim::gpu::open_device(c.device).map_err(|e| match e {
                Error::Unsupported(m) => Error::Unsupported(format!("grads[{i}].{m}")),
                e => e,
            })?;
        }
    }
    let mut part = Partial {
        shard_max: 0.0,
        shard_sum: 0.0,
        replicated: 0.0,
        nonfinite: 0.0,
    };
    for g in grads {
        let (mut mx, mut sum) = (0f64, 0f64);
        for v in values(g)? {
            let a = v.abs();
            if a.is_nan() {
                part.nonfinite = 2.0;
            } else if a.is_infinite() {
                part.nonfinite = part.nonfinite.max(1.0);
            }
            mx = if a > mx || a.is_nan() { a } else { mx };
            sum += if p == 2.0 {
                a * a
            } else if p == 1.0 {
                a
            } else {
                a.powf(p)
            };
        }
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
    let local = grads.and_then(|g| local_partial(&g, max_norm, norm_type).map(|p| (g, p)));
    let (grads, part) = agree(comm, local)?;
    let mut mx = [
        part.shard_max,
        if norm_type.is_infinite() {
            part.replicated
        } else {
            0.0
        },
        part.nonfinite,
    ];
    let mut rep = [if norm_type.is_infinite() {
        0.0
    } else {
        part.replicated
    }];
    comm.all_reduce_f64(&mut mx, ReduceOp::Max)?;
    let mut sum = [part.shard_sum];
    comm.all_reduce_f64(&mut sum, ReduceOp::Sum)?;
    // Replicated gradients are identical on every rank: counted once, made bit-identical.
    comm.all_reduce_f64(&mut rep, ReduceOp::Max)?;
    let total = if mx[2] >= 2.0 {
        f64::NAN
    } else if mx[2] >= 1.0 {
        f64::INFINITY
    } else if norm_type.is_infinite() {
        mx[0].max(mx[1])
    } else {
        let s = sum[0] + rep[0];
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
        for g in &grads {
            scale(g, coef)?;
        }
    }
    Ok(total)
}

unsafe fn scale(g: &ClipGrad, coef: f64) -> Result<()> {
    let c = coef as f32;
    let mut b = read_tensor(&g.tensor, g.device, 0)?;
    match g.tensor.dtype() {
        DType::F32 => b.chunks_exact_mut(4).for_each(|x| {
            let v = f32::from_le_bytes((&*x).try_into().unwrap()) * c;
            x.copy_from_slice(&v.to_le_bytes())
        }),
        DType::F64 => b.chunks_exact_mut(8).for_each(|x| {
            let v = f64::from_le_bytes((&*x).try_into().unwrap()) * coef;
            x.copy_from_slice(&v.to_le_bytes())
        }),
        DType::BF16 => b.chunks_exact_mut(2).for_each(|x| {
            let v = bf16::from_f32(bf16::from_le_bytes([x[0], x[1]]).to_f32() * c);
            x.copy_from_slice(&v.to_le_bytes())
        }),
        DType::F16 => b.chunks_exact_mut(2).for_each(|x| {
            let v = f16::from_f32(f16::from_le_bytes([x[0], x[1]]).to_f32() * c);
            x.copy_from_slice(&v.to_le_bytes())
        }),
        _ => unreachable!("dtype checked"),
    }
    write_tensor(&g.tensor, g.device, &b, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Comm;
    use crate::optim::gpu::emulated::{self, EMULATED};

    fn grad(b: &mut [u8], dtype: DType, n: usize) -> HostTensor {
        unsafe { HostTensor::new(b.as_mut_ptr(), dtype, &[n as i64], None, "g").unwrap() }
    }

    /// Device gradients (on the emulated device) give the host norm and clip, bit for bit.
    #[test]
    fn device_gradients_clip_as_host_ones() {
        if emulated::skip() {
            return;
        }
        let vals: Vec<f32> = (0..77).map(|i| (i as f32 - 30.0) * 0.731).collect();
        let f32s: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let src = crate::cast::cast(f32s.clone(), DType::F32, dtype, "g").unwrap();
            for p in [2.0, 1.0, 3.0, f64::INFINITY] {
                let comm = Comm::local_group(1).pop().unwrap();
                let (mut h0, mut h1, mut d0, mut d1) =
                    (src.clone(), src.clone(), src.clone(), src.clone());
                let host = vec![
                    (grad(&mut h0, dtype, 77), true),
                    (grad(&mut h1, dtype, 77), false),
                ];
                let want = unsafe { clip_grad_norm(&comm, &host, 1.5, p, true) }.unwrap();
                let dev = vec![
                    ClipGrad {
                        tensor: grad(&mut d0, dtype, 77),
                        is_shard: true,
                        device: EMULATED,
                    },
                    ClipGrad {
                        tensor: grad(&mut d1, dtype, 77),
                        is_shard: false,
                        device: -1,
                    },
                ];
                let got = unsafe { clip_grad_norm_checked(&comm, Ok(dev), 1.5, p, true) }.unwrap();
                assert_eq!(got.to_bits(), want.to_bits(), "{dtype} p={p}");
                assert_eq!((&d0, &d1), (&h0, &h1), "{dtype} p={p}");
                assert_ne!(d0, src, "clipped");
            }
        }
        let comm = Comm::local_group(1).pop().unwrap();
        let mut b = vec![0u8; 8 * 4];
        let strided =
            unsafe { HostTensor::new(b.as_mut_ptr(), DType::F32, &[4], Some(&[2]), "g").unwrap() };
        let e = unsafe {
            clip_grad_norm_checked(
                &comm,
                Ok(vec![ClipGrad {
                    tensor: strided,
                    is_shard: true,
                    device: EMULATED,
                }]),
                1.0,
                2.0,
                false,
            )
        }
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("grads[0]") && e.contains("a device gradient must be contiguous"),
            "{e}"
        );
    }
}
