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
    /// The allocations behind `ptrs`, freed on drop.
    owned: Vec<u64>,
}

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
            owned: Vec::new(),
        };
        // Allocations go into `st` as they are made, so an error frees them (drop).
        let moment = |st: &mut DeviceState, kind| -> Result<Option<MomentPtrs>> {
            if kind == MomentKind::None {
                return Ok(None);
            }
            let (d, sc) = StateLayout::moment_bytes(kind, numel);
            Ok(Some(MomentPtrs {
                kind,
                data: st.alloc(d, stream)?,
                scales: st.alloc(sc, stream)?,
            }))
        };
        st.ptrs.m = moment(&mut st, layout.m)?;
        st.ptrs.v = moment(&mut st, layout.v)?;
        st.ptrs.error_bits = st.alloc(numel * layout.error_bits_width as usize / 8, stream)?;
        Ok(st)
    }

    unsafe fn alloc(&mut self, bytes: usize, stream: usize) -> Result<u64> {
        if bytes == 0 {
            return Ok(0);
        }
        let p = self.backend.alloc_zeroed(bytes, stream)?;
        self.owned.push(p);
        Ok(p)
    }

    pub fn nbytes(&self) -> usize {
        self.layout.nbytes(self.numel)
    }

    /// The device addresses of the state's buffers, for a launch table.
    pub fn ptrs(&self) -> StatePtrs {
        self.ptrs
    }

    /// Copies the state's buffers, one after the other, to `nbytes()` bytes of this
    /// device at `dst` (`back`: from `dst` into the buffers), in order on `stream`; the
    /// host does not wait. An overlapped step's undo record of a device parameter.
    ///
    /// # Safety
    /// `dst` must be `nbytes()` bytes of the state's device, valid until the copies have
    /// run; `stream` 0 or a valid stream of that device.
    pub unsafe fn copy_with(&self, dst: u64, back: bool, stream: usize) -> Result<()> {
        let mut at = dst;
        for (d, bytes) in buffers(&self.ptrs, &self.layout, self.numel) {
            if bytes > 0 {
                let (to, from) = if back { (d, at) } else { (at, d) };
                self.backend.copy_on_device(to, from, bytes, stream)?;
            }
            at += bytes as u64;
        }
        Ok(())
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
        self.owned
            .iter()
            .for_each(|&p| unsafe { self.backend.free(p) });
    }
}
