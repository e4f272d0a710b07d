//! Tensors: owned on the host (`Tensor`: bytes, dtype, shape), borrowed views over the
//! caller's memory wherever it lives (`view`: `TensorView`, pointer, strides and its
//! `Device`; `gather`: a strided view copied out row-major), and the size checks both share.
pub mod device;
mod gather;
pub mod view;

pub use device::Device;
pub use view::TensorView;

use crate::dtype::DType;
use crate::error::{Error, Result};

/// Most dims a tensor or a mesh may have (`FO_MAX_DIMS` in C).
pub const MAX_DIMS: usize = 8;

/// Number of elements of a shape, or an error naming `what` on overflow.
pub fn checked_numel(shape: &[usize], what: &str) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            Error::invalid(
                what,
                format!("shape {shape:?} has more elements than fit in memory"),
            )
        })
}

/// An empty vector with room for `n` elements, where `n` comes from a caller or a file:
/// an allocation that fails is an error naming `what` (Rust's out-of-memory abort cannot
/// be caught at the C boundary).
pub fn try_with_capacity<T>(n: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        Error::invalid(
            what,
            format!(
                "cannot allocate {n} elements of {} bytes",
                std::mem::size_of::<T>()
            ),
        )
    })?;
    Ok(v)
}

/// `n` zero bytes, allocated as `try_with_capacity` does.
pub fn try_zeroed(n: usize, what: &str) -> Result<Vec<u8>> {
    let mut v = try_with_capacity(n, what)?;
    v.resize(n, 0);
    Ok(v)
}

/// Row-major (contiguous) strides of `shape`, in elements. A size-0 dim counts as 1,
/// as torch reports it.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        // Saturating: a shape whose strides overflow is refused wherever it is used
        // (`checked_numel`); this never wraps to a small, wrong stride meanwhile.
        strides[d] = strides[d + 1].saturating_mul(shape[d + 1].max(1));
    }
    strides
}

/// An owned, contiguous, row-major tensor (what fo allocates: loaded state, gathered
/// slices, received broadcasts).
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl Tensor {
    pub fn new(dtype: DType, shape: Vec<usize>, data: Vec<u8>) -> Result<Tensor> {
        let numel = checked_numel(&shape, "shape")?;
        if data.len() != numel * dtype.size() {
            return Err(Error::Shape(format!(
                "{} bytes given for a {dtype} tensor of shape {shape:?} ({} bytes expected)",
                data.len(),
                numel * dtype.size()
            )));
        }
        Ok(Tensor { dtype, shape, data })
    }

    pub fn zeros(dtype: DType, shape: Vec<usize>) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor {
            dtype,
            data: vec![0u8; n * dtype.size()],
            shape,
        }
    }

    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Result<Tensor> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Tensor::new(DType::F32, shape, data)
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn nbytes(&self) -> usize {
        self.data.len()
    }

    /// Values widened to f32 (floats only; f64 is narrowed).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let b = &self.data;
        Ok(match self.dtype {
            DType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            DType::F64 => b
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap()) as f32)
                .collect(),
            DType::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            DType::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            other => return Err(Error::Dtype(format!("cannot read {other} values as f32"))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_strides_count_empty_dims_as_one() {
        assert_eq!(contiguous_strides(&[10, 7]), vec![7, 1]);
        assert_eq!(contiguous_strides(&[3, 0, 4]), vec![4, 4, 1]);
        assert_eq!(contiguous_strides(&[]), Vec::<usize>::new());
    }
}
