//! `TensorView`: a borrowed view of caller memory (pointer, dtype, shape, element
//! strides) that knows which device's memory it is, so no signature has to carry the
//! device beside it.
use super::gather::gather;
use super::{checked_numel, contiguous_strides, try_with_capacity, Device, Tensor, MAX_DIMS};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// A view of caller-owned memory: pointer, dtype, shape, element strides and the device
/// whose memory it is. fo never frees it; the caller keeps it alive while fo uses it.
///
/// The methods that touch the elements (`to_tensor`, `contiguous_bytes`, `write_bytes`,
/// ...) read and write through the pointer on the host: for a view on a CUDA device only
/// the device room's `read_tensor` / `write_tensor` move its bytes.
#[derive(Clone, Debug)]
pub struct TensorView {
    ptr: *mut u8,
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<usize>,
    device: Device,
}

// SAFETY: a TensorView is a borrowed pointer whose owner promised (at construction) that
// it stays valid; fo only ever touches disjoint tensors from different threads.
unsafe impl Send for TensorView {}
unsafe impl Sync for TensorView {}

impl TensorView {
    /// Validates and wraps caller host memory. `what` names the argument in errors.
    ///
    /// # Safety
    /// `ptr` must be valid for reads (and writes, if written through) of every element
    /// addressed by `shape` and `strides`, for as long as the view is used.
    pub unsafe fn host(
        ptr: *mut u8,
        dtype: DType,
        shape: &[i64],
        strides: Option<&[i64]>,
        what: &str,
    ) -> Result<TensorView> {
        TensorView::on(Device::Host, ptr, dtype, shape, strides, what)
    }

    /// Validates and wraps caller memory of `device`: shape, strides, NULL and alignment
    /// are checked here, never the memory itself (a device's memory is checked by the
    /// device room before anything is queued on it).
    ///
    /// # Safety
    /// As `host`, with `ptr` memory of `device` (for a CUDA device, valid there and
    /// never dereferenced on the host).
    pub unsafe fn on(
        device: Device,
        ptr: *mut u8,
        dtype: DType,
        shape: &[i64],
        strides: Option<&[i64]>,
        what: &str,
    ) -> Result<TensorView> {
        if shape.len() > MAX_DIMS {
            return Err(Error::invalid(
                format!("{what}.ndim"),
                format!("{} dims given, at most {MAX_DIMS} supported", shape.len()),
            ));
        }
        let ushape = non_negative(shape, what, "shape", |s| format!("negative size {s}"))?;
        let numel = match ushape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)) {
            Some(n) => n,
            None => checked_numel(&ushape, &format!("{what}.shape"))?, // its error
        };
        // Bytes as listed (not as stored: a stride-0 view lists more than it stores) must
        // be addressable, so `nbytes()` and every copy of the view are well defined.
        if numel
            .checked_mul(dtype.size())
            .is_none_or(|b| b > isize::MAX as usize)
        {
            return Err(Error::invalid(
                format!("{what}.shape"),
                format!("{ushape:?} of {dtype} is more than 2^63-1 bytes"),
            ));
        }
        let ustrides = match strides {
            None => contiguous_strides(&ushape),
            Some(st) => non_negative(st, what, "strides", |s| {
                format!("negative stride {s} is not supported")
            })?,
        };
        if numel > 0 {
            if ptr.is_null() {
                return Err(Error::invalid(
                    format!("{what}.data"),
                    format!("NULL for a tensor of shape {ushape:?}"),
                ));
            }
            if !(ptr as usize).is_multiple_of(dtype.size()) {
                return Err(Error::invalid(
                    format!("{what}.data"),
                    format!(
                        "address {ptr:p} is not aligned to {} bytes for {dtype}",
                        dtype.size()
                    ),
                ));
            }
            let extent = ushape
                .iter()
                .zip(&ustrides)
                .try_fold(1usize, |acc, (&n, &s)| {
                    (n - 1).checked_mul(s).and_then(|x| acc.checked_add(x))
                });
            match extent.and_then(|e| e.checked_mul(dtype.size())) {
                Some(bytes) if bytes <= isize::MAX as usize => {}
                _ => {
                    return Err(Error::invalid(
                        format!("{what}.strides"),
                        format!(
                        "shape {ushape:?} with strides {ustrides:?} overflows the address space"
                    ),
                    ))
                }
            }
        }
        Ok(TensorView {
            ptr,
            dtype,
            shape: ushape,
            strides: ustrides,
            device,
        })
    }

    /// The device whose memory the view is.
    pub fn device(&self) -> Device {
        self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// True when the elements are laid out row-major without gaps (size-1 and
    /// size-0 dims may carry any stride, as in torch).
    pub fn is_contiguous(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let expected = contiguous_strides(&self.shape);
        self.shape
            .iter()
            .zip(self.strides.iter().zip(&expected))
            .all(|(&n, (&s, &e))| n == 1 || s == e)
    }

    /// The bytes of a contiguous view.
    ///
    /// # Safety
    /// The memory must be valid and not written by anyone else while the slice lives.
    pub unsafe fn contiguous_bytes(&self) -> Option<&[u8]> {
        if !self.is_contiguous() {
            return None;
        }
        if self.numel() == 0 {
            return Some(&[]);
        }
        Some(std::slice::from_raw_parts(self.ptr, self.nbytes()))
    }

    /// The bytes of a contiguous view, writable.
    ///
    /// # Safety
    /// The memory must be valid and not accessed by anyone else while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn contiguous_bytes_mut(&self) -> Option<&mut [u8]> {
        if !self.is_contiguous() {
            return None;
        }
        if self.numel() == 0 {
            return Some(&mut []);
        }
        Some(std::slice::from_raw_parts_mut(self.ptr, self.nbytes()))
    }

    /// Calls `f(i, offset)` with the byte offset of every element `i`, in row-major
    /// logical order. A visitor, not a list: a list of offsets would cost 8 bytes per
    /// element on top of the data.
    fn for_each_offset(&self, mut f: impl FnMut(usize, usize)) {
        let n = self.numel();
        if n == 0 {
            return;
        }
        let nd = self.shape.len();
        let mut idx = vec![0usize; nd];
        for i in 0..n {
            f(
                i,
                idx.iter()
                    .zip(&self.strides)
                    .map(|(i, s)| i * s)
                    .sum::<usize>()
                    * self.dtype.size(),
            );
            for d in (0..nd).rev() {
                idx[d] += 1;
                if idx[d] < self.shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }

    /// Copies the elements out, row-major, into an owned tensor.
    ///
    /// # Safety
    /// The memory must be valid for reads.
    pub unsafe fn to_tensor(&self) -> Tensor {
        let data = match self.contiguous_bytes() {
            Some(b) => b.to_vec(),
            None => {
                let mut v = Vec::with_capacity(self.nbytes());
                gather(
                    self.ptr,
                    &self.shape,
                    &self.strides,
                    self.dtype.size(),
                    &mut v,
                );
                v
            }
        };
        Tensor {
            dtype: self.dtype,
            shape: self.shape.clone(),
            data,
        }
    }

    /// `to_tensor` for views whose size is the caller's word (any strides, so a stride-0
    /// view may claim far more elements than its memory): a buffer that cannot be
    /// allocated is an error naming `what`, not the process abort of a failed `Vec`.
    ///
    /// # Safety
    /// The memory must be valid for reads.
    pub unsafe fn try_to_tensor(&self, what: &str) -> Result<Tensor> {
        let mut data = try_with_capacity::<u8>(self.nbytes(), what)?;
        match self.contiguous_bytes() {
            Some(b) => data.extend_from_slice(b),
            None => gather(
                self.ptr,
                &self.shape,
                &self.strides,
                self.dtype.size(),
                &mut data,
            ),
        }
        Ok(Tensor {
            dtype: self.dtype,
            shape: self.shape.clone(),
            data,
        })
    }

    /// An error unless `bytes` holds exactly the view's `nbytes()`.
    pub fn check_len(&self, bytes: &[u8]) -> Result<()> {
        if bytes.len() != self.nbytes() {
            return Err(Error::Shape(format!(
                "{} bytes for a {} tensor of shape {:?} ({} bytes expected)",
                bytes.len(),
                self.dtype,
                self.shape,
                self.nbytes()
            )));
        }
        Ok(())
    }

    /// Writes row-major `bytes` (exactly `nbytes()` of them) into the viewed memory.
    ///
    /// # Safety
    /// The memory must be valid for writes and not accessed by anyone else meanwhile.
    pub unsafe fn write_bytes(&self, bytes: &[u8]) -> Result<()> {
        self.check_len(bytes)?;
        match self.contiguous_bytes_mut() {
            Some(dst) => dst.copy_from_slice(bytes),
            None => {
                let es = self.dtype.size();
                self.for_each_offset(|i, off| {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr().add(i * es), self.ptr.add(off), es)
                });
            }
        }
        Ok(())
    }
}

/// `vals` (a view's shape or strides, argument `{what}.{field}`) as `usize`s; a negative
/// one is refused, naming its dim, with `why(value)`.
fn non_negative(
    vals: &[i64],
    what: &str,
    field: &str,
    why: impl Fn(i64) -> String,
) -> Result<Vec<usize>> {
    vals.iter()
        .enumerate()
        .map(|(d, &v)| {
            usize::try_from(v).map_err(|_| Error::invalid(format!("{what}.{field}[{d}]"), why(v)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::try_zeroed;

    #[test]
    fn strided_view_reads_and_writes_in_logical_order() {
        // A transposed 2x3 view of a row-major 3x2 buffer.
        let mut buf: Vec<f32> = vec![0., 1., 2., 3., 4., 5.];
        let v = unsafe {
            TensorView::host(
                buf.as_mut_ptr() as *mut u8,
                DType::F32,
                &[2, 3],
                Some(&[1, 2]),
                "t",
            )
            .unwrap()
        };
        assert!(!v.is_contiguous());
        let t = unsafe { v.to_tensor() };
        assert_eq!(t.to_f32().unwrap(), vec![0., 2., 4., 1., 3., 5.]);
        let src: Vec<u8> = [10f32, 12., 14., 11., 13., 15.]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        unsafe { v.write_bytes(&src).unwrap() };
        assert_eq!(buf, vec![10., 11., 12., 13., 14., 15.]);
    }

    #[test]
    fn views_larger_than_memory_can_hold_are_errors_not_aborts() {
        let mut x = 0f32;
        let p = &mut x as *mut f32 as *mut u8;
        // A stride-0 view listing 2^59 f32 (2^61 bytes): valid to describe, impossible to copy.
        let v = unsafe { TensorView::host(p, DType::F32, &[1 << 59], Some(&[0]), "values[0]") }
            .unwrap();
        let e = unsafe { v.try_to_tensor("values[0]") }.unwrap_err();
        assert!(
            e.to_string().contains("values[0]") && e.to_string().contains("cannot allocate"),
            "{e}"
        );
        let e =
            unsafe { TensorView::host(p, DType::F32, &[1 << 62], Some(&[0]), "g") }.unwrap_err();
        assert!(e.to_string().contains("2^63-1 bytes"), "{e}");
        assert!(try_zeroed(usize::MAX / 2, "n").is_err());
        assert_eq!(try_zeroed(3, "n").unwrap(), vec![0, 0, 0]);
    }

    #[test]
    fn rejects_null_negative_and_too_many_dims() {
        let e = unsafe { TensorView::host(std::ptr::null_mut(), DType::F32, &[2], None, "param") }
            .unwrap_err();
        assert!(e.to_string().contains("param.data"), "{e}");
        let mut x = 0f32;
        let p = &mut x as *mut f32 as *mut u8;
        let e = unsafe { TensorView::host(p, DType::F32, &[1, -2], None, "grad") }.unwrap_err();
        assert!(e.to_string().contains("grad.shape[1]"), "{e}");
        let e = unsafe { TensorView::host(p, DType::F32, &[1; 9], None, "g") }.unwrap_err();
        assert!(e.to_string().contains("at most 8"), "{e}");
        // An empty tensor may have a NULL pointer.
        assert!(
            unsafe { TensorView::host(std::ptr::null_mut(), DType::F32, &[0, 4], None, "e") }
                .is_ok()
        );
    }
}
