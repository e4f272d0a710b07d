//! A device parameter's optimizer state: the buffers a host `ParamState` holds, in device
//! memory, byte for byte as the host holds them (`StateLayout`). Reading it back and
//! writing it are plain copies of those buffers, so a state read from the device is the
//! state a host step would have produced, and a checkpoint written from it is the same.
use std::sync::Arc;

use crate::device::{backend, Backend};
use crate::error::{Error, Result};
use crate::kernels::step_table::{MomentKind, MomentPtrs, StateLayout, StatePtrs};
use crate::optim::math::state::ParamState;
use crate::tensor::Device;

pub struct DeviceState {
    pub device: Device,
    pub step: u64,
    /// As `ParamState::m_valid`: SGD's buffer holds a value.
    pub m_valid: bool,
    pub layout: StateLayout,
    numel: usize,
    ptrs: StatePtrs,
    backend: Arc<dyn Backend>,
    /// The one allocation every buffer of `ptrs` lies in (address, bytes; 0 when the state
    /// holds no byte), freed on drop. One block, so that an overlapped step's undo record
    /// of it is one copy: on an H200 each `cuMemcpyDtoDAsync` cost microseconds of host
    /// time that a backward bound by the host's launches waited for.
    block: (u64, usize),
}

/// Where a buffer starts in its state's block: the step kernel's vector accesses need 16
/// bytes, and 256 is what a separate allocation of its own would give.
const BUFFER_ALIGN: usize = 256;

/// A state's buffers as `(address, bytes)`, in one fixed order (m, m scales, v, v scales,
/// error bits), so a host and a device state of one layout pair up buffer by buffer.
fn buffers(p: &StatePtrs, layout: &StateLayout, n: usize) -> Vec<(u64, usize)> {
    let mut out = Vec::with_capacity(5);
    for m in [&p.m, &p.v].into_iter().flatten() {
        let (d, s) = StateLayout::moment_bytes(m.kind, n);
        out.push((m.data, d));
        out.push((m.scales, s));
    }
    out.push((p.error_bits, n * layout.error_bits_width as usize / 8));
    out
}

impl DeviceState {
    /// Zeroed state of `numel` elements on `device`, zeroed in order on `stream`.
    ///
    /// # Safety
    /// `stream` must be 0 or a valid stream of `device`.
    pub unsafe fn zeroed(
        device: Device,
        layout: StateLayout,
        numel: usize,
        stream: usize,
    ) -> Result<DeviceState> {
        let mut st = DeviceState {
            device,
            step: 0,
            m_valid: false,
            layout,
            numel,
            ptrs: StatePtrs {
                m: None,
                v: None,
                error_bits: 0,
                error_bits_width: layout.error_bits_width,
            },
            backend: backend(device)?,
            block: (0, 0),
        };
        // The buffers' offsets in `buffers` order (a buffer of no byte has address 0).
        let mut end = 0usize;
        let mut place = |bytes: usize| -> Option<usize> {
            (bytes > 0).then(|| {
                let at = end.next_multiple_of(BUFFER_ALIGN);
                end = at + bytes;
                at
            })
        };
        let moment = |kind, place: &mut dyn FnMut(usize) -> Option<usize>| {
            (kind != MomentKind::None).then(|| {
                let (d, sc) = StateLayout::moment_bytes(kind, numel);
                (kind, place(d), place(sc))
            })
        };
        let (m, v) = (moment(layout.m, &mut place), moment(layout.v, &mut place));
        let eb = place(numel * layout.error_bits_width as usize / 8);
        if end > 0 {
            st.block = (st.backend.alloc_zeroed(end, stream)?, end);
        }
        let at = |off: Option<usize>| off.map_or(0, |o| st.block.0 + o as u64);
        let ptrs = |m: Option<(MomentKind, Option<usize>, Option<usize>)>| {
            m.map(|(kind, d, sc)| MomentPtrs {
                kind,
                data: at(d),
                scales: at(sc),
            })
        };
        (st.ptrs.m, st.ptrs.v, st.ptrs.error_bits) = (ptrs(m), ptrs(v), at(eb));
        Ok(st)
    }

    pub fn nbytes(&self) -> usize {
        self.layout.nbytes(self.numel)
    }

    /// The device addresses of the state's buffers, for a launch table.
    pub fn ptrs(&self) -> StatePtrs {
        self.ptrs
    }

    /// The bytes `copy_with` copies: the state's block, its buffers and the padding that
    /// aligns them (at most `BUFFER_ALIGN` a buffer more than `nbytes()`).
    pub fn record_bytes(&self) -> usize {
        self.block.1
    }

    /// Copies the state's block to `record_bytes()` bytes of this device at `dst` (`back`:
    /// from `dst` into the block), in order on `stream`, in one copy; the host does not
    /// wait. An overlapped step's undo record of a device parameter.
    ///
    /// # Safety
    /// `dst` must be `record_bytes()` bytes of the state's device, valid until the copy
    /// has run; `stream` 0 or a valid stream of that device.
    pub unsafe fn copy_with(&self, dst: u64, back: bool, stream: usize) -> Result<()> {
        let (base, bytes) = self.block;
        if bytes == 0 {
            return Ok(());
        }
        let (to, from) = if back { (base, dst) } else { (dst, base) };
        self.backend.copy_on_device(to, from, bytes, stream)
    }

    /// A host copy of the state, read after the work queued on `stream`, which this
    /// waits for.
    ///
    /// # Safety
    /// `stream` must be 0 or a valid stream of the state's device.
    pub unsafe fn to_host(&self, stream: usize) -> Result<ParamState> {
        let mut host = self.layout.zeroed(self.numel);
        let hp = StatePtrs::of_host(&mut host);
        for ((h, bytes), (d, _)) in buffers(&hp, &self.layout, self.numel)
            .into_iter()
            .zip(buffers(&self.ptrs, &self.layout, self.numel))
        {
            if bytes > 0 {
                let dst = std::slice::from_raw_parts_mut(h as *mut u8, bytes);
                self.backend.download(d, dst, stream)?;
            }
        }
        host.step = self.step;
        host.m_valid = self.m_valid;
        Ok(host)
    }

    /// Replaces the state with `st` (a host state of this layout and size), in order on
    /// `stream` after the work queued there.
    ///
    /// # Safety
    /// `stream` must be 0 or a valid stream of the state's device.
    pub unsafe fn upload(&mut self, mut st: ParamState, stream: usize) -> Result<()> {
        let hp = StatePtrs::of_host(&mut st);
        let host = buffers(&hp, &self.layout, self.numel);
        let dev = buffers(&self.ptrs, &self.layout, self.numel);
        if hp.m.map(|m| m.kind) != self.ptrs.m.map(|m| m.kind)
            || hp.v.map(|m| m.kind) != self.ptrs.v.map(|m| m.kind)
            || hp.error_bits_width != self.ptrs.error_bits_width
            || st.nbytes() != self.nbytes()
        {
            return Err(Error::Internal(format!(
                "a host state laid out as {:?}/{:?}/{} bits ({} bytes) cannot replace device state {:?} ({} bytes)",
                hp.m.map(|m| m.kind),
                hp.v.map(|m| m.kind),
                hp.error_bits_width,
                st.nbytes(),
                self.layout,
                self.nbytes()
            )));
        }
        for ((h, bytes), (d, _)) in host.into_iter().zip(dev) {
            if bytes > 0 {
                let src = std::slice::from_raw_parts(h as *const u8, bytes);
                self.backend.upload(d, src, stream)?;
            }
        }
        self.step = st.step;
        self.m_valid = st.m_valid;
        Ok(())
    }
}

impl Drop for DeviceState {
    fn drop(&mut self) {
        // SAFETY: allocated by this backend in `zeroed`, used by nothing after the state.
        if self.block.0 != 0 {
            unsafe { self.backend.free(self.block.0) };
        }
    }
}
