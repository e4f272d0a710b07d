//! Where a parameter and its state live, and what the step does about it: host, device, or
//! host state with device gradients and mirrors (offloaded), and the host view of each.
//!
//! - `offload`: Megatron's offload plan (which parameters stay on the host);
//! - `offload_step`: host parameters with device gradients and device mirrors;
//! - `offload_pipe`: their step as a pipeline over the device's copy lanes;
//! - `device_state` / `device_step`: state in device memory and the device half of the
//!   step (not run on a GPU yet); `device_table`: its launch tables, resident on the
//!   device between steps;
//! - `staging`: device parameters and state seen from the host, for state by key and
//!   checkpoints.
mod device_state;
pub(crate) mod device_step;
pub(crate) mod device_table;
pub mod offload;
pub(crate) mod offload_pipe;
pub(crate) mod offload_step;
pub(crate) mod staging;
#[cfg(test)]
mod test_views;

pub use device_state::DeviceState;

use crate::tensor::{Device, TensorView};

/// A device copy of a host parameter, rewritten after every step of the parameter.
pub struct Mirror {
    pub tensor: TensorView,
}

impl Mirror {
    /// The CUDA device the copy is on.
    pub fn device(&self) -> Device {
        self.tensor.device()
    }
}
