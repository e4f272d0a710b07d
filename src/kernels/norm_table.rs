//! The gradient-norm kernels' side of the host (gpu/fo_norm.cuh): their launch table,
//! and the host's copy of their summation order, so a norm summed on the device and one
//! summed on the host are the same bits. A tensor's elements are cut into chunks of
//! `CHUNK`; lane `l` of 32 adds elements `l, l+32, ...` of its chunk in order; a chunk's
//! lanes fold in an xor butterfly; a tensor's chunks add in order.
use crate::dtype::DType;
use crate::error::{Error, Result};

pub const LANES: usize = 32;
pub const PER_LANE: usize = 256;
/// Elements per chunk (`FO_NORM_CHUNK`).
pub const CHUNK: usize = LANES * PER_LANE;

/// `fo_norm_tensor`: one gradient of a launch.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FoNormTensor {
    pub data: u64,
    pub numel: u64,
    pub chunk_begin: u64,
    pub dtype: i32,
    pub reserved: i32,
}

/// One launch of the norm or scale kernels over several gradients of one device.
#[derive(Debug, Default)]
pub struct NormTable {
    pub tensors: Vec<FoNormTensor>,
    pub total_chunks: u64,
    /// For each caller's tensor (in order), its range of global chunks.
    pub chunks: Vec<std::ops::Range<usize>>,
}

impl NormTable {
    /// The table of `(address, numel, dtype)` gradients, in order; empty ones take no row
    /// (and no chunk). Dtypes other than F32, F16, BF16 and F64 are refused.
    pub fn new(grads: &[(u64, usize, DType)]) -> Result<NormTable> {
        let mut t = NormTable::default();
        for (i, &(data, numel, dtype)) in grads.iter().enumerate() {
            if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
                return Err(Error::Dtype(format!(
                    "grads[{i}] is {dtype}: the norm kernels take F32, F16, BF16 or F64"
                )));
            }
            let n = numel.div_ceil(CHUNK);
            let begin = t.total_chunks as usize;
            t.chunks.push(begin..begin + n);
            if n == 0 {
                continue;
            }
            t.tensors.push(FoNormTensor {
                data,
                numel: numel as u64,
                chunk_begin: t.total_chunks,
                dtype: dtype.code(),
                reserved: 0,
            });
            t.total_chunks += n as u64;
        }
        Ok(t)
    }

    /// The table's bytes as the kernels read them.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: FoNormTensor is repr(C) plain data of 32 bytes without padding.
        unsafe {
            std::slice::from_raw_parts(
                self.tensors.as_ptr() as *const u8,
                std::mem::size_of_val(&self.tensors[..]),
            )
        }
    }

    /// Each caller's tensor's (sum, largest |x|) from the kernels' per-chunk output
    /// (`[sum, max]` per global chunk), adding its chunks in order.
    pub fn fold(&self, chunk_out: &[f64]) -> Vec<(f64, f64)> {
        self.chunks
            .iter()
            .map(|r| {
                r.clone().fold((0.0, 0.0), |(s, m), c| {
                    (s + chunk_out[2 * c], nan_max(chunk_out[2 * c + 1], m))
                })
            })
            .collect()
    }
}

/// The larger of two, NaN when either is (`fo_nanmax`).
fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else if a > b {
        a
    } else {
        b
    }
}

/// The device kernels' order on the host: feed a tensor's values one chunk (`CHUNK`
/// values, fewer for the last) at a time, in order; `sum` and `max` are then the
/// kernels' (sum of `|x|^power`, largest `|x|`) after `NormTable::fold`.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostNorm {
    pub sum: f64,
    pub max: f64,
}

impl HostNorm {
    /// Adds one chunk; `power` 1 or 2.
    pub fn chunk(&mut self, chunk: &[f64], power: u32) {
        debug_assert!(chunk.len() <= CHUNK && (power == 1 || power == 2));
        let (mut s, mut m, nan) = if power == 2 {
            lanes::<true>(chunk)
        } else {
            lanes::<false>(chunk)
        };
        let mut off = LANES / 2;
        while off > 0 {
            for l in 0..off {
                s[l] += s[l + off];
                m[l] = if m[l + off] > m[l] { m[l + off] } else { m[l] };
            }
            off /= 2;
        }
        self.sum += s[0];
        // The largest |x| is order-free; NaN is tracked apart so the lanes vectorize.
        self.max = nan_max(if nan { f64::NAN } else { m[0] }, self.max);
    }
}

/// The 32 lanes of one chunk: (sums, maxima of the non-NaN values, whether a NaN was seen).
fn lanes<const SQUARE: bool>(chunk: &[f64]) -> ([f64; LANES], [f64; LANES], bool) {
    let (mut s, mut m, mut nan) = ([0f64; LANES], [0f64; LANES], false);
    let mut add = |l: usize, x: f64| {
        let a = x.abs();
        s[l] += if SQUARE { a * a } else { a };
        m[l] = if a > m[l] { a } else { m[l] };
        nan |= a.is_nan();
    };
    let mut rows = chunk.chunks_exact(LANES);
    for row in &mut rows {
        for (l, &x) in row.iter().enumerate() {
            add(l, x);
        }
    }
    for (l, &x) in rows.remainder().iter().enumerate() {
        add(l, x);
    }
    (s, m, nan)
}

/// (sum of `|x|^power`, largest `|x|`) of `values` in the device kernels' order.
#[cfg(test)]
pub fn host_partial(values: &[f64], power: u32) -> (f64, f64) {
    let mut acc = HostNorm::default();
    for chunk in values.chunks(CHUNK) {
        acc.chunk(chunk, power);
    }
    (acc.sum, acc.max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_rows_skip_empty_tensors_and_chunks_add_up() {
        let t = NormTable::new(&[
            (16, CHUNK + 1, DType::F32),
            (32, 0, DType::BF16),
            (48, 5, DType::F64),
        ])
        .unwrap();
        assert_eq!(t.tensors.len(), 2);
        assert_eq!(t.total_chunks, 3);
        assert_eq!(t.chunks, vec![0..2, 2..2, 2..3]);
        assert_eq!((t.tensors[1].chunk_begin, t.tensors[1].dtype), (2, 3));
        assert_eq!(t.as_bytes().len(), 64);
        let e = NormTable::new(&[(0, 1, DType::I32)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("grads[0] is I32"), "{e}");
        let folded = t.fold(&[1.0, 2.0, 3.0, f64::NAN, 4.0, 0.5]);
        assert_eq!(folded[0].0, 4.0);
        assert!(folded[0].1.is_nan());
        assert_eq!(folded[1], (0.0, 0.0));
        assert_eq!(folded[2], (4.0, 0.5));
    }

    #[test]
    fn host_partial_is_the_exact_norm_where_rounding_cannot_differ() {
        // Small integers: every order gives the same sum, so this checks the walk.
        let v: Vec<f64> = (0..3 * CHUNK + 17).map(|i| (i % 13) as f64 - 6.0).collect();
        let want2: f64 = v.iter().map(|x| x * x).sum();
        let want1: f64 = v.iter().map(|x| x.abs()).sum();
        assert_eq!(host_partial(&v, 2), (want2, 6.0));
        assert_eq!(host_partial(&v, 1), (want1, 6.0));
        assert_eq!(host_partial(&[], 2), (0.0, 0.0));
        let mut w = v.clone();
        w[CHUNK + 3] = f64::INFINITY;
        assert_eq!(host_partial(&w, 1).1, f64::INFINITY);
        w[2 * CHUNK + 9] = f64::NAN;
        let (s, m) = host_partial(&w, 2);
        assert!(s.is_nan() && m.is_nan());
    }
}
