//! The backend of a build without the `cuda` feature: every device is refused with an
//! `Unsupported` error that says how to get one, so callers never write `#[cfg]`.
use std::sync::Arc;

use super::backend::Backend;
use crate::error::{Error, Result};
use crate::tensor::Device;

const WITHOUT: &str = "this libfo was built without GPU support (rebuild with `--features cuda`)";

/// What is missing for device tensors.
pub(super) fn missing() -> String {
    WITHOUT.into()
}

/// No device opens.
pub(super) fn backend(device: Device) -> Result<Arc<dyn Backend>> {
    Err(Error::Unsupported(super::device_refusal(device)))
}

/// No stream is taken.
pub(super) fn stream_support() -> Result<()> {
    Err(Error::Unsupported(format!(
        "fo_optimizer_set_stream: {WITHOUT}"
    )))
}
