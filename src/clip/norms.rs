//! Each local gradient's share of the norm, and its scaling, wherever it lives. For
//! p = 1, 2 and infinity, device gradients are summed and scaled by the device kernels
//! (one launch per device, only per-chunk partials come back) and host gradients by the
//! host's copy of the same order (`norm_table::HostNorm`), so a gradient gives the
//! same bits on either side. Other p use `powf`, which the GPU does not round as the host
//! does: those device gradients are copied down and summed on the host.
use std::collections::BTreeMap;

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};

use super::ClipGrad;
use crate::device::open::{backend, read_tensor, write_tensor};
use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::norm_table::{HostNorm, NormTable, CHUNK};
use crate::tensor::Device;

/// Which sum the kernels do for norm type `p` (1: |x|, 2: x*x), None where they cannot.
fn power(p: f64) -> Option<u32> {
    if p == 2.0 {
        Some(2)
    } else if p == 1.0 || p.is_infinite() {
        Some(1)
    } else {
        None
    }
}

/// The indices of `grads` on each device, in order.
fn by_device(grads: &[ClipGrad]) -> BTreeMap<Device, Vec<usize>> {
    let mut m: BTreeMap<Device, Vec<usize>> = BTreeMap::new();
    for (i, g) in grads.iter().enumerate() {
        let d = g.tensor.device();
        if d.is_cuda() {
            m.entry(d).or_default().push(i);
        }
    }
    m
}

fn table(grads: &[ClipGrad], idx: &[usize]) -> Result<NormTable> {
    let rows: Vec<(u64, usize, DType)> = idx
        .iter()
        .map(|&i| {
            let t = &grads[i].tensor;
            (t.as_ptr() as u64, t.numel(), t.dtype())
        })
        .collect();
    NormTable::new(&rows)
}

/// Each gradient's (largest |g|, sum of |g|^p), in order, device gradients read after
/// the work queued on `stream` (the communicator's: `Comm::stream`). The largest is NaN when the
/// gradient holds a NaN, else infinite when it holds an infinity.
///
/// # Safety
/// Every gradient's memory must be valid for reads (checked: dtype, device, contiguity).
pub(super) unsafe fn norms(grads: &[ClipGrad], p: f64, stream: usize) -> Result<Vec<(f64, f64)>> {
    let mut out = vec![(0.0, 0.0); grads.len()];
    let power = power(p);
    if let Some(power) = power {
        for (device, idx) in by_device(grads) {
            let t = table(grads, &idx)?;
            let chunks = backend(device)?.norm_chunks(&t, power, stream)?;
            for (&i, (sum, max)) in idx.iter().zip(t.fold(&chunks)) {
                out[i] = (max, sum);
            }
        }
    }
    for (i, g) in grads.iter().enumerate() {
        if g.tensor.device().is_host() || power.is_none() {
            out[i] = host_norm(g, p, power, stream)?;
        }
    }
    Ok(out)
}

/// Multiplies every gradient by `coef` (in f32 for f32/bf16/f16 gradients, as torch
/// does): device gradients by the scale kernel, host ones in place.
///
/// # Safety
/// Every gradient's memory must be valid for writes.
pub(super) unsafe fn scale_all(grads: &[ClipGrad], coef: f64, stream: usize) -> Result<()> {
    for (device, idx) in by_device(grads) {
        backend(device)?.scale(&table(grads, &idx)?, coef, stream)?;
    }
    for g in grads.iter().filter(|g| g.tensor.device().is_host()) {
        scale_host(g, coef)?;
    }
    Ok(())
}

/// One gradient's (largest |g|, sum of |g|^p) on the host, read in place when it is a
/// contiguous host tensor (copied otherwise) and decoded one chunk at a time, so no
/// f64 copy of the gradient is made.
///
/// # Safety
/// The gradient's memory must be valid (the caller of clip_grad_norm promised it).
unsafe fn host_norm(g: &ClipGrad, p: f64, power: Option<u32>, stream: usize) -> Result<(f64, f64)> {
    let copied;
    let bytes = match g
        .tensor
        .device()
        .is_host()
        .then(|| g.tensor.contiguous_bytes())
        .flatten()
    {
        Some(b) => b,
        None => {
            copied = read_tensor(&g.tensor, stream)?;
            &copied[..]
        }
    };
    let dtype = g.tensor.dtype();
    let mut buf = Decoded::new(CHUNK.min(g.tensor.numel()));
    let (mut acc, mut mx, mut sum) = (HostNorm::default(), 0f64, 0f64);
    for c in bytes.chunks(CHUNK * dtype.size()) {
        let vals = buf.decode(c, dtype);
        match power {
            Some(power) => acc.chunk(vals, power),
            None => {
                for x in vals.iter() {
                    let a = x.abs();
                    mx = if a > mx || a.is_nan() { a } else { mx };
                    sum += a.powf(p);
                }
            }
        }
    }
    Ok(match power {
        Some(_) => (acc.max, acc.sum),
        None => (mx, sum),
    })
}

/// One chunk of a gradient as f64, with the f16 path's scratch kept across chunks.
struct Decoded {
    out: Vec<f64>,
    bits: Vec<u16>,
    f32s: Vec<f32>,
}

impl Decoded {
    fn new(n: usize) -> Decoded {
        Decoded {
            out: vec![0.0; n],
            bits: Vec::new(),
            f32s: Vec::new(),
        }
    }

    /// `b` (whole elements of `dtype`, at most `n` of them) as f64.
    fn decode(&mut self, b: &[u8], dtype: DType) -> &[f64] {
        let out = &mut self.out[..b.len() / dtype.size()];
        match dtype {
            DType::F32 => (out.iter_mut().zip(b.chunks_exact(4)))
                .for_each(|(o, c)| *o = f32::from_le_bytes(c.try_into().unwrap()) as f64),
            DType::F64 => (out.iter_mut().zip(b.chunks_exact(8)))
                .for_each(|(o, c)| *o = f64::from_le_bytes(c.try_into().unwrap())),
            // bf16 is the top half of an f32: exact, and vectorizes (NaN payloads may
            // differ from `half`'s, which nothing here can see: a NaN makes the total NaN).
            DType::BF16 => (out.iter_mut().zip(b.chunks_exact(2))).for_each(|(o, c)| {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16) as f64
            }),
            // `half`'s slice conversion uses the CPU's F16C instructions where it has them.
            DType::F16 => {
                self.bits.clear();
                (self.bits).extend(b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])));
                self.f32s.resize(self.bits.len(), 0.0);
                let bits: &[f16] = self.bits.reinterpret_cast();
                bits.convert_to_f32_slice(&mut self.f32s);
                out.iter_mut()
                    .zip(&self.f32s)
                    .for_each(|(o, &x)| *o = x as f64);
            }
            _ => unreachable!("dtype checked"),
        }
        out
    }
}

/// Scales a host gradient in place (through a copy when it is strided).
///
/// # Safety
/// The gradient's memory must be valid for writes and not used by anyone else.
unsafe fn scale_host(g: &ClipGrad, coef: f64) -> Result<()> {
    if let Some(b) = g.tensor.contiguous_bytes_mut() {
        scale_bytes(b, g.tensor.dtype(), coef);
        return Ok(());
    }
    let mut b = read_tensor(&g.tensor, 0)?;
    scale_bytes(&mut b, g.tensor.dtype(), coef);
    write_tensor(&g.tensor, &b, 0)
}

fn scale_bytes(b: &mut [u8], dtype: DType, coef: f64) {
    let c = coef as f32;
    match dtype {
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
}
