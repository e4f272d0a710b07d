//! Which backend serves a device ordinal (opened on first use), and a tensor's bytes
//! wherever it lives: the calls above the trait that every device user goes through.
use std::sync::Arc;

use super::backend::Backend;
use crate::error::Result;
use crate::tensor::TensorView;

/// The backend of device `ordinal`, opening it (and compiling the kernels) on first use.
pub fn backend(ordinal: i32) -> Result<Arc<dyn Backend>> {
    #[cfg(test)]
    if let Some(b) = super::emulated::backend(ordinal) {
        return Ok(b);
    }
    super::imp::backend(ordinal)
}

/// The row-major bytes of `t`, wherever it lives: read in place from host memory
/// (`device` -1), copied down from device `device` (a contiguous view) after the work
/// queued on `stream`.
///
/// # Safety
/// `t` must be valid for reads (device memory of `device` when `device >= 0`), and
/// `stream` 0 or a valid stream of that device.
pub unsafe fn read_tensor(t: &TensorView, device: i32, stream: usize) -> Result<Vec<u8>> {
    if device < 0 {
        return Ok(t.to_tensor().data);
    }
    let mut b = crate::tensor::try_zeroed(t.nbytes(), "a device tensor's host copy")?;
    backend(device)?.download(t.as_ptr() as u64, &mut b, stream)?;
    Ok(b)
}

/// Writes row-major `bytes` (exactly `t.nbytes()`) into `t` wherever it lives: in place
/// in host memory, copied up to device `device` in order on `stream`.
///
/// # Safety
/// As `read_tensor`, for writes.
pub unsafe fn write_tensor(t: &TensorView, device: i32, bytes: &[u8], stream: usize) -> Result<()> {
    if device < 0 {
        return t.write_bytes(bytes);
    }
    t.check_len(bytes)?;
    backend(device)?.upload(t.as_ptr() as u64, bytes, stream)
}
