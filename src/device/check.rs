//! The one check a device tensor passes before fo queues anything on it: contiguous, on
//! an open device, and its memory really that device's (`Backend::memory_of`).
//!
//! A host pointer or another device's memory given as a CUDA device's would fault inside
//! fo's kernel: a sticky error that kills the CUDA context torch shares. Refused here
//! instead, naming the argument, before anything is queued.
use super::backend::Memory;
use super::open::backend;
use crate::error::{Error, Result};
use crate::tensor::{Device, TensorView};

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

/// Checks that `t`, a view on a CUDA device, is contiguous, that its device opens
/// (libraries, ordinal, kernels), and that `t`'s first and last bytes are memory of that
/// device. Changes nothing; queues nothing.
///
/// # Safety
/// `t`'s address is only queried (never read); any value is safe to pass.
pub unsafe fn check_tensor(t: &TensorView, a: &DeviceArg<'_>) -> Result<()> {
    check_contiguous(t, a)?;
    open_for(t.device(), a)?;
    check_memory(t, a)
}

/// Opens `device` for argument `a`, naming it in the refusal.
fn open_for(device: Device, a: &DeviceArg<'_>) -> Result<()> {
    super::open_device(device).map_err(|e| match e {
        Error::Unsupported(m) if a.by_arg || a.context.is_empty() => {
            Error::Unsupported(format!("{}.{m}", a.arg))
        }
        Error::Unsupported(m) => Error::Unsupported(a.say(m)),
        e => e,
    })
}

/// The contiguity half of `check_tensor`: fo's kernels and copies take flat memory.
pub fn check_contiguous(t: &TensorView, a: &DeviceArg<'_>) -> Result<()> {
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
pub unsafe fn check_memory(t: &TensorView, a: &DeviceArg<'_>) -> Result<()> {
    let bytes = t.nbytes() as u64;
    if bytes == 0 {
        return Ok(()); // nothing is read or written: any address will do
    }
    let b = backend(t.device())?;
    // Errors name the device by the number the caller gave (`device = 0`).
    let device = t.device().to_c();
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

/// Device memory this optimizer has already validated, so a step queries the driver only
/// for gradients outside it: an unchanged gradient costs no `cuPointerGetAttribute`, and
/// torch's gradients, which its caching allocator carves out of a few large segments,
/// cost one look-up per segment, not one per tensor per step.
///
/// Why this is as sound as querying every step. What the check stops is memory that is
/// not the device's (a host tensor, another GPU's tensor given with `device = N`): a
/// kernel touching it faults, a sticky error that kills the CUDA context torch shares. A
/// range enters here only after the driver said its first and last byte are device N's,
/// and it is the whole allocation the driver reports (`allocation_of`), or else just the
/// bytes checked. While an allocation lives its addresses stay that device's memory, so
/// every tensor inside it passes without a look-up. An entry can only be stale after
/// the caller freed the allocation and the same addresses were mapped again as something
/// else before a step; a gradient there is memory freed under fo, which breaks the
/// borrowing rule of every fo call (memory stays alive for the call), and which the
/// per-step query did not catch either (it looked at two bytes: an address reused by the
/// same device passed, a hole in the middle passed). A pointer outside every entry,
/// including host memory given as a device gradient, is still queried and refused before
/// anything is queued.
#[derive(Default)]
pub struct KnownMemory {
    /// `(device, start, end)`: validated byte ranges, oldest first.
    ranges: Vec<(Device, u64, u64)>,
}

/// Ranges kept; past it the oldest is forgotten (and queried again if used again).
const KNOWN_RANGES: usize = 1024;

/// `t`'s bytes as `[lo, hi)`, or None where they are empty or wrap the address space.
fn span(t: &TensorView) -> Option<(u64, u64)> {
    let lo = t.as_ptr() as u64;
    lo.checked_add(t.nbytes() as u64)
        .filter(|&hi| hi > lo)
        .map(|hi| (lo, hi))
}

impl KnownMemory {
    /// `check_tensor`, with the memory half skipped inside a range already validated.
    ///
    /// # Safety
    /// As `check_tensor`.
    pub unsafe fn check_tensor(&mut self, t: &TensorView, a: &DeviceArg<'_>) -> Result<()> {
        check_contiguous(t, a)?;
        open_for(t.device(), a)?;
        self.check(t, a)
    }

    /// Whether `t`'s bytes lie inside a range already validated on its device (`check`
    /// then passes without a look-up): the caller can skip naming the tensor.
    pub fn knows(&self, t: &TensorView) -> bool {
        span(t).is_some_and(|(lo, hi)| self.holds(t.device(), lo, hi))
    }

    fn holds(&self, device: Device, lo: u64, hi: u64) -> bool {
        self.ranges
            .iter()
            .any(|&(d, s, e)| d == device && s <= lo && hi <= e)
    }

    /// `check_memory`, skipped for a tensor inside a range already validated on its
    /// device.
    ///
    /// # Safety
    /// As `check_memory`.
    pub unsafe fn check(&mut self, t: &TensorView, a: &DeviceArg<'_>) -> Result<()> {
        let device = t.device();
        let Some((lo, hi)) = span(t) else {
            return check_memory(t, a); // empty (nothing to check) or wrapping
        };
        if self.holds(device, lo, hi) {
            return Ok(());
        }
        check_memory(t, a)?;
        let (s, e) = match backend(device)?.allocation_of(lo)? {
            Some((s, n)) if s <= lo && s.checked_add(n).is_some_and(|e| hi <= e) => (s, s + n),
            _ => (lo, hi),
        };
        if self.ranges.len() == KNOWN_RANGES {
            self.ranges.remove(0);
        }
        self.ranges.push((device, s, e));
        Ok(())
    }

    /// Validated ranges held (tests).
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }
}
