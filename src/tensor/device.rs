//! `Device`: which memory a tensor lives in, the host's or a CUDA device's.
//!
//! Why here, on the tensor's floor, and not in `crate::device` where users look for it
//! (it is re-exported there): the tensor view carries its device, and the view sits below
//! the device room (the device room's backends read and write views; `shard`, `math` and
//! `kernels` between them use views but no backend). A type the view holds must sit on
//! the view's floor or below, so the value lives with the view while the backends that
//! serve it stay in the device room.
use std::fmt;

use crate::error::{Error, Result};

/// Where a tensor's memory is. The C ABI's `int32_t device` is -1 for the host and an
/// ordinal >= 0 for a CUDA device; inside the crate that number is this enum, converted
/// once at the boundary (`from_c`) and back only where C or driver code takes an int
/// (`to_c`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Device {
    /// Host memory: read and written in place.
    #[default]
    Host,
    /// Memory of the CUDA device with this ordinal.
    Cuda(u32),
}

impl Device {
    /// The C code for the host (`FO_DEVICE_HOST`).
    pub const HOST_CODE: i32 = -1;

    /// The device a C caller named with `code`: -1 the host, >= 0 a CUDA ordinal; any
    /// other value is an `InvalidArgument` for `what` (`grads[0].device`) naming it.
    pub fn from_c(code: i32, what: &str) -> Result<Device> {
        match code {
            Device::HOST_CODE => Ok(Device::Host),
            n if n >= 0 => Ok(Device::Cuda(n as u32)),
            n => Err(Error::invalid(
                what,
                format!("{n} is neither -1 (host) nor a CUDA ordinal"),
            )),
        }
    }

    /// The C code of this device: -1 for the host, the ordinal for a CUDA device (an
    /// ordinal past `i32::MAX`, which `from_c` never makes, saturates: no machine has
    /// such a device, so opening it is refused like any absent ordinal).
    pub fn to_c(self) -> i32 {
        match self {
            Device::Host => Device::HOST_CODE,
            Device::Cuda(n) => i32::try_from(n).unwrap_or(i32::MAX),
        }
    }

    pub fn is_host(self) -> bool {
        self == Device::Host
    }

    pub fn is_cuda(self) -> bool {
        !self.is_host()
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Host => f.write_str("host"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c_codes_convert_both_ways() {
        for (code, d) in [
            (-1, Device::Host),
            (0, Device::Cuda(0)),
            (7, Device::Cuda(7)),
            (i32::MAX, Device::Cuda(i32::MAX as u32)),
        ] {
            assert_eq!(Device::from_c(code, "t.device").unwrap(), d);
            assert_eq!(d.to_c(), code);
        }
        assert_eq!(Device::Cuda(u32::MAX).to_c(), i32::MAX);
    }

    #[test]
    fn codes_below_minus_one_are_refused_naming_the_value() {
        for code in [-2, i32::MIN] {
            let e = Device::from_c(code, "grads[3].device").unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
            let m = e.to_string();
            assert!(
                m.contains("grads[3].device")
                    && m.contains(&format!("{code} is neither -1 (host) nor a CUDA ordinal")),
                "{m}"
            );
        }
    }

    #[test]
    fn displays_host_and_cuda_ordinals() {
        assert_eq!(Device::Host.to_string(), "host");
        assert_eq!(Device::Cuda(0).to_string(), "cuda:0");
        assert_eq!(Device::Cuda(7).to_string(), "cuda:7");
        assert!(Device::Host.is_host() && Device::Cuda(1).is_cuda());
    }
}
