//! One state entry written into memory, decoded or raw, converted to the dtype asked for,
//! straight into the destination: no f32 vector, no byte vector copied once more, no copy
//! of the moment to get a chunk view of it. Entries larger than one chunk are written in
//! group-aligned chunks in parallel on fo's pool when the caller asks: that is
//! `fo_optimizer_get_state`, through which `state_dict()`, `opt.state[p]` and DCP saves
//! of fo.torch read all state, so a read runs at memory speed rather than at one core's
//! decode speed. The values are those of the kernels' own decoder (`MomentView::load`),
//! element for element, whatever the chunking.
use half::f16;
use rayon::prelude::*;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::math::master_split::{bf16_bits_rne, reconstruct_one, Half};
use crate::optim::math::quant8;
use crate::optim::math::state::{ErrorBits, Moment};
use crate::optim::threads;
use crate::tensor::Tensor;

/// The fewest elements per task: a multiple of the quant8 group (32, so a chunk never
/// splits a group's scale), 256 KiB of f32 out, which dwarfs rayon's per-task cost.
const CHUNK: usize = 1 << 16;
/// Elements converted at a time through a stack buffer (L1-resident) when the output is
/// not aligned f32 that values can be decoded into in place.
const SUB: usize = 1024;

/// Where an entry's values come from (see `Optimizer::source`).
pub(crate) enum Source<'s> {
    /// The f32 master weight: the parameter's stored elements, completed by its error
    /// bits when it is 16-bit and has them.
    Master {
        param: &'s Tensor,
        err: Option<&'s ErrorBits>,
    },
    /// The step counter (a 0-dim f32, as torch keeps it).
    Step(f32),
    /// A moment decoded to f32.
    Decoded(&'s Moment),
    /// Stored elements copied as they are (codes, scales, error bits).
    I8(&'s [i8]),
    U8(&'s [u8]),
    I16(&'s [i16]),
    F16(&'s [f16]),
}

impl Source<'_> {
    /// The dtype the entry is read as by default (f32 for decoded values).
    pub(crate) fn dtype(&self) -> DType {
        match self {
            Source::Master { .. } | Source::Step(_) | Source::Decoded(_) => DType::F32,
            Source::I8(_) => DType::I8,
            Source::U8(_) => DType::U8,
            Source::I16(_) => DType::I16,
            Source::F16(_) => DType::F16,
        }
    }

    fn numel(&self) -> usize {
        match self {
            Source::Master { param, .. } => param.numel(),
            Source::Step(_) => 1,
            Source::Decoded(m) => m.numel(),
            Source::I8(v) => v.len(),
            Source::U8(v) => v.len(),
            Source::I16(v) => v.len(),
            Source::F16(v) => v.len(),
        }
    }

    /// Elements `lo..lo + out.len()` as f32 (`lo` group-aligned).
    fn values(&self, lo: usize, out: &mut [f32]) {
        let hi = lo + out.len();
        match self {
            Source::Step(s) => out.fill(*s),
            Source::Decoded(m) => m.view(lo, hi).load(out, false),
            Source::Master { param, err } => {
                let es = param.dtype.size();
                let bytes = &param.data[lo * es..hi * es];
                let bits = || {
                    bytes
                        .chunks_exact(2)
                        .map(|c| u16::from_le_bytes([c[0], c[1]]))
                };
                match (Half::from_dtype(param.dtype), err) {
                    (Ok(h), Some(ErrorBits::I8(e))) => {
                        for ((o, b), &c) in out.iter_mut().zip(bits()).zip(&e[lo..hi]) {
                            *o = reconstruct_one(h, b, c);
                        }
                    }
                    (Ok(h), Some(ErrorBits::I16(e))) => {
                        for ((o, b), &c) in out.iter_mut().zip(bits()).zip(&e[lo..hi]) {
                            *o = reconstruct_one(h, b, c);
                        }
                    }
                    _ => to_f32(param.dtype, bytes, out),
                }
            }
            Source::I8(_) | Source::U8(_) | Source::I16(_) | Source::F16(_) => {
                unreachable!("raw entries are copied, not decoded")
            }
        }
    }

    /// Elements from `lo` as `dtype` into `out` (a whole number of elements).
    fn write(&self, lo: usize, dtype: DType, out: &mut [u8]) {
        let n = out.len() / dtype.size();
        match self {
            Source::U8(v) => out.copy_from_slice(&v[lo..lo + n]),
            Source::I8(v) => le(&v[lo..lo + n], out, i8::to_le_bytes),
            Source::I16(v) => le(&v[lo..lo + n], out, i16::to_le_bytes),
            Source::F16(v) => le(&v[lo..lo + n], out, |x| x.to_le_bytes()),
            _ => self.write_f32(lo, dtype, out),
        }
    }

    fn write_f32(&self, lo: usize, dtype: DType, out: &mut [u8]) {
        if dtype == DType::F32 {
            if let Some(dst) = as_f32_mut(out) {
                return self.values(lo, dst);
            }
        }
        let es = dtype.size();
        let mut buf = [0f32; SUB];
        for (k, o) in out.chunks_mut(SUB * es).enumerate() {
            let b = &mut buf[..o.len() / es];
            self.values(lo + k * SUB, b);
            match dtype {
                DType::F32 => le(b, o, f32::to_le_bytes),
                DType::F64 => le(b, o, |x| (x as f64).to_le_bytes()),
                DType::BF16 => le(b, o, |x| bf16_bits_rne(x).to_le_bytes()),
                DType::F16 => le(b, o, |x| f16::from_f32(x).to_bits().to_le_bytes()),
                d => unreachable!("{d} is not a float dtype (checked by the caller)"),
            }
        }
    }

    /// An error if the values cannot be produced (a master over a non-float parameter).
    fn check(&self) -> Result<()> {
        match self {
            Source::Master { param, .. } if !is_float(param.dtype) => Err(Error::Dtype(format!(
                "cannot read {} values as f32",
                param.dtype
            ))),
            _ => Ok(()),
        }
    }
}

pub(super) fn is_float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
}

/// Writes every element of `src` as `dtype` into `out`, which must hold exactly that
/// many bytes; `dtype` must be the source's own or, for f32 sources, any float dtype.
/// `parallel`: chunks on fo's pool (the caller's thread otherwise: a checkpoint writer
/// that must not compete with steps for the pool).
pub(super) fn fill(src: &Source, dtype: DType, out: &mut [u8], parallel: bool) -> Result<()> {
    src.check()?;
    let es = dtype.size();
    let convertible = dtype == src.dtype() || (src.dtype() == DType::F32 && is_float(dtype));
    if !convertible || out.len() != src.numel() * es {
        return Err(Error::Internal(format!(
            "state read of {} {} elements into {} bytes of {dtype}",
            src.numel(),
            src.dtype(),
            out.len()
        )));
    }
    if parallel && src.numel() > CHUNK {
        let pool = threads::pool()?;
        let chunk = chunk_len(src.numel(), pool.current_num_threads());
        let task = |(k, o): (usize, &mut [u8])| src.write(k * chunk, dtype, o);
        pool.install(|| out.par_chunks_mut(chunk * es).enumerate().for_each(task));
    } else {
        let chunk = chunk_len(src.numel(), 1);
        out.chunks_mut(chunk * es)
            .enumerate()
            .for_each(|(k, o)| src.write(k * chunk, dtype, o));
    }
    Ok(())
}

/// Elements per task for `n` elements on `threads` threads: about four tasks per thread (to
/// balance threads slowed by others), at least `CHUNK`, a multiple of the group. Large
/// pieces matter for f32 out, which is one memcpy per piece: libc copies a piece larger
/// than its non-temporal threshold (a few MiB) with streaming stores, which do not read
/// the destination first (scripts/bench_state_dict.py, fp32 state, 1 thread: 1.24x a
/// clone of the same bytes with 256 KiB pieces, 1.07x with these).
fn chunk_len(n: usize, threads: usize) -> usize {
    n.div_ceil(4 * threads.max(1))
        .next_multiple_of(quant8::GROUP)
        .max(CHUNK)
}

/// `v` as little-endian bytes into `out` (the same number of elements).
#[inline(always)]
fn le<T: Copy, const N: usize>(v: &[T], out: &mut [u8], f: impl Fn(T) -> [u8; N]) {
    for (o, &x) in out.chunks_exact_mut(N).zip(v) {
        o.copy_from_slice(&f(x));
    }
}

/// Stored elements of a float dtype as f32 (as `Tensor::to_f32` converts them).
fn to_f32(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    let es = dtype.size();
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(es)) {
        *o = match dtype {
            DType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            DType::F64 => f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32,
            DType::BF16 => half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32(),
            _ => f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32(),
        };
    }
}

/// `out` as f32s, when it is aligned for them and the target is little-endian (an f32's
/// bytes in memory are then its little-endian bytes), so values decode in place.
fn as_f32_mut(out: &mut [u8]) -> Option<&mut [f32]> {
    if cfg!(target_endian = "big") {
        return None;
    }
    // SAFETY: every bit pattern is a valid f32, and `align_to_mut` hands out only the
    // part of `out` that is aligned for f32 (`pre`/`post` hold the rest).
    let (pre, mid, post) = unsafe { out.align_to_mut::<f32>() };
    (pre.is_empty() && post.is_empty()).then_some(mid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::math::state::Root;

    fn serial_reference(m: &Moment) -> Vec<f32> {
        let mut out = vec![0f32; m.numel()];
        m.view(0, m.numel()).load(&mut out, false);
        out
    }

    fn bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn parallel_chunked_decode_equals_one_serial_decode() {
        let n = 3 * CHUNK + 45;
        let codes: Vec<u8> = (0..n).map(|i| (i * 37 % 256) as u8).collect();
        let scales: Vec<f16> = (0..n.div_ceil(32))
            .map(|g| f16::from_f32(0.01 + g as f32 * 1e-4))
            .collect();
        let moments = [
            Moment::F32((0..n).map(|i| (i as f32).sin()).collect()),
            Moment::Unsigned {
                codes: codes.clone(),
                scales: scales.clone(),
                root: Root::Fourth,
            },
            Moment::Signed {
                codes: codes.iter().map(|&c| c as i8).collect(),
                scales,
            },
        ];
        for m in &moments {
            let want = bytes(&serial_reference(m));
            // One byte in: the f32 output is unaligned and goes through the stack buffer.
            let mut buf = vec![0u8; want.len() + 1];
            for (off, parallel) in [(0, true), (1, true), (0, false), (1, false)] {
                let out = &mut buf[off..off + want.len()];
                out.fill(0xAA);
                fill(&Source::Decoded(m), DType::F32, out, parallel).unwrap();
                assert!(out == want.as_slice(), "offset {off}, parallel {parallel}");
            }
        }
    }

    #[test]
    fn chunks_are_whole_groups_at_least_chunk_long_and_about_four_per_thread() {
        for (n, threads) in [
            (1, 1),
            (CHUNK + 1, 2),
            (8 << 20, 2),
            (8 << 20, 64),
            (1_000_003, 3),
        ] {
            let c = chunk_len(n, threads);
            assert!(
                c.is_multiple_of(quant8::GROUP) && c >= CHUNK,
                "{n} on {threads}: {c}"
            );
            assert!(n.div_ceil(c) <= 4 * threads, "{n} on {threads}: {c}");
        }
        assert_eq!(chunk_len(8 << 20, 2), 1 << 20);
    }

    #[test]
    fn a_read_into_the_wrong_number_of_bytes_is_refused_before_writing() {
        let m = Moment::F32(vec![1.0; 100].into());
        let mut out = vec![7u8; 399];
        let e = fill(&Source::Decoded(&m), DType::F32, &mut out, true).unwrap_err();
        assert!(e.to_string().contains("399 bytes"), "{e}");
        assert!(out.iter().all(|&b| b == 7));
        let e = fill(&Source::I8(&[1, 2]), DType::F32, &mut out[..8], true).unwrap_err();
        assert!(matches!(e, Error::Internal(_)), "{e}");
    }
}
