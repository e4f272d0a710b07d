//! Which backend serves a device ordinal (opened on first use), and a tensor's bytes
//! wherever it lives: the calls above the trait that every device user goes through.
use std::sync::Arc;

use super::backend::Backend;
use crate::error::{Error, Result};
use crate::tensor::{Device, TensorView};

/// The backend of CUDA `device`, opening it (and compiling the kernels) on first use.
/// The host has none: asking for it is a bug in fo, reported as `Internal`. Below this
/// call the backends take the driver's `int` ordinal.
pub fn backend(device: Device) -> Result<Arc<dyn Backend>> {
    if device.is_host() {
        return Err(Error::Internal(
            "a device backend was asked for host memory".into(),
        ));
    }
    #[cfg(test)]
    if let Some(b) = super::emulated::backend(device.to_c()) {
        return Ok(b);
    }
    super::imp::backend(device)
}

/// The row-major bytes of `t`, wherever it lives: read in place from host memory,
/// copied down from its CUDA device (a contiguous view) after the work queued on
/// `stream`.
///
/// # Safety
/// `t` must be valid for reads (memory of its device), and `stream` 0 or a valid stream
/// of that device.
pub unsafe fn read_tensor(t: &TensorView, stream: usize) -> Result<Vec<u8>> {
    if t.device().is_host() {
        return Ok(t.to_tensor().data);
    }
    let mut b = crate::tensor::try_zeroed(t.nbytes(), "a device tensor's host copy")?;
    backend(t.device())?.download(t.as_ptr() as u64, &mut b, stream)?;
    Ok(b)
}

/// Writes row-major `bytes` (exactly `t.nbytes()`) into `t` wherever it lives: in place
/// in host memory, copied up to its CUDA device in order on `stream`.
///
/// # Safety
/// As `read_tensor`, for writes.
pub unsafe fn write_tensor(t: &TensorView, bytes: &[u8], stream: usize) -> Result<()> {
    if t.device().is_host() {
        return t.write_bytes(bytes);
    }
    t.check_len(bytes)?;
    backend(t.device())?.upload(t.as_ptr() as u64, bytes, stream)
}
