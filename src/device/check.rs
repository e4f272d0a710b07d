//! The one check a device tensor passes before fo queues anything on it: contiguous, on
//! an open device, and its memory really that device's (`Backend::memory_of`).
//!
//! A host pointer or another device's memory given with `device >= 0` would fault inside
//! fo's kernel: a sticky error that kills the CUDA context torch shares. Refused here
//! instead, naming the argument, before anything is queued.
use super::backend::Memory;
use super::open::backend;
use crate::error::{Error, Result};
use crate::tensor::HostTensor;

/// A device tensor argument as errors name it: `arg` the argument (`grads[0]`,
/// `dests[1].tensor`, `param`), `context` what it is for the reader ("parameter fc1.w",
/// empty when `arg` says enough), `noun` what a device one is ("gradient"). A device that
/// does not open is `Unsupported` as "`arg`.device = N: why" where `arg` names an element
/// of an argument list (`by_arg`), else as "`context`: device = N: why".
pub struct DeviceArg<'a> {
    pub arg: &'a str,
    pub context: &'a str,
    pub noun: &'a str,
    pub by_arg: bool,
}

impl DeviceArg<'_> {
    fn say(&self, m: impl std::fmt::Display) -> String {
        if self.context.is_empty() {
            m.to_string()
        } else {
            format!("{}: {m}", self.context)
        }
    }
}

/// Checks that `t`, given on CUDA device `device` (>= 0), is contiguous, that the device
/// opens (libraries, ordinal, kernels), and that `t`'s first and last bytes are memory of
/// that device. Changes nothing; queues nothing.
///
/// # Safety
/// `t`'s address is only queried (never read); any value is safe to pass.
pub unsafe fn check_tensor(t: &HostTensor, device: i32, a: &DeviceArg<'_>) -> Result<()> {
    check_contiguous(t, a)?;
    super::open_device(device).map_err(|e| match e {
        Error::Unsupported(m) if a.by_arg || a.context.is_empty() => {
            Error::Unsupported(format!("{}.{m}", a.arg))
        }
        Error::Unsupported(m) => Error::Unsupported(a.say(m)),
        e => e,
    })?;
    check_memory(t, device, a)
}

/// The contiguity half of `check_tensor`: fo's kernels and copies take flat memory.
pub fn check_contiguous(t: &HostTensor, a: &DeviceArg<'_>) -> Result<()> {
    if t.is_contiguous() {
        return Ok(());
    }
    Err(Error::invalid(
        a.arg,
        a.say(format_args!(
            "a device {} must be contiguous (strides {:?} for shape {:?})",
            a.noun,
            t.strides(),
            t.shape()
        )),
    ))
}

/// The memory half of `check_tensor` (for a device already open).
///
/// # Safety
/// As `check_tensor`.
pub unsafe fn check_memory(t: &HostTensor, device: i32, a: &DeviceArg<'_>) -> Result<()> {
    let bytes = t.nbytes() as u64;
    if bytes == 0 {
        return Ok(()); // nothing is read or written: any address will do
    }
    let b = backend(device)?;
    let first = t.as_ptr() as u64;
    for at in [first, first + bytes - 1] {
        let where_ = match b.memory_of(at)? {
            Memory::Device(d) if d == device => continue,
            Memory::Untracked => continue,
            Memory::Host => "host memory".to_string(),
            Memory::Device(d) => format!("memory of device {d}"),
        };
        let which = if at == first {
            "pointer"
        } else {
            "its last byte"
        };
        return Err(Error::invalid(
            a.arg,
            a.say(format_args!(
                "{which} {at:#x} is {where_}, not device {device}'s ({bytes} bytes from {first:#x} \
                 given with device = {device})"
            )),
        ));
    }
    Ok(())
}
