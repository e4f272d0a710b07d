//! A param group's step table kept resident in device memory between steps.
//!
//! A table row holds only what changes when memory changes (pointers, sizes, dtypes,
//! state kinds); the rule's step-dependent scalars travel with each launch. So a step
//! whose pointers did not change uploads nothing, and one whose gradient moved uploads
//! only the bytes from its first changed byte to its last (one copy), not the table.
use std::collections::HashMap;
use std::sync::Arc;

use crate::device::{backend, Backend};
use crate::error::{Error, Result};
use crate::kernels::step_table::{FoStepTensor, StepTable};
use crate::tensor::Device;

/// One group's table on one device: device memory (`capacity` bytes) and a host copy of
/// what that memory holds, valid only in stream order (`uploaded`, empty when unknown).
pub struct ResidentTable {
    backend: Arc<dyn Backend>,
    ptr: u64,
    capacity: usize,
    uploaded: Vec<u8>,
}

/// The resident tables of an optimizer, by (param group, device).
#[derive(Default)]
pub struct ResidentTables(HashMap<(usize, Device), ResidentTable>);

impl ResidentTables {
    /// Queues `table`'s launches on `stream` after bringing its resident copy up to date
    /// (uploading the changed bytes, if any, in stream order before the launches).
    ///
    /// # Safety
    /// Every address in the table must be memory of `device` that stays valid until the
    /// kernels have run; `stream` must be 0 or a valid stream of `device`.
    pub unsafe fn launch(
        &mut self,
        group: usize,
        device: Device,
        table: &StepTable,
        stream: usize,
    ) -> Result<()> {
        if table.tensors.is_empty() {
            return Ok(());
        }
        let t = match self.0.entry((group, device)) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => v.insert(ResidentTable {
                backend: backend(device)?,
                ptr: 0,
                capacity: 0,
                uploaded: Vec::new(),
            }),
        };
        let d = t.sync(table.as_bytes(), stream)?;
        let row = std::mem::size_of::<FoStepTensor>() as u64;
        for l in &table.launches {
            let count = i32::try_from(l.count).map_err(|_| {
                Error::invalid("params", "more than 2^31 device tensors in one param group")
            })?;
            let at = d + row * l.row as u64;
            t.backend.launch_step(at, count, l, stream)?;
        }
        Ok(())
    }
}

impl ResidentTable {
    /// Makes the device copy hold `bytes` in `stream` order and returns its address.
    ///
    /// # Safety
    /// `stream` must be 0 or a valid stream of this table's device.
    unsafe fn sync(&mut self, bytes: &[u8], stream: usize) -> Result<u64> {
        if bytes.len() > self.capacity {
            // Grown (parameters registered): a new buffer with room for more. The old
            // one is freed after the work that reads it (`free` waits for the device).
            let capacity = bytes.len().next_power_of_two();
            let ptr = self.backend.alloc_zeroed(capacity, stream)?;
            if self.ptr != 0 {
                self.backend.free(self.ptr);
            }
            (self.ptr, self.capacity) = (ptr, capacity);
            self.uploaded.clear();
        }
        let Some((lo, hi)) = changed_span(&self.uploaded, bytes) else {
            return Ok(self.ptr);
        };
        // Until the upload is queued, what the device holds is unknown.
        self.uploaded.clear();
        self.backend
            .upload_table(self.ptr + lo as u64, &bytes[lo..hi], stream)?;
        self.uploaded.extend_from_slice(bytes);
        Ok(self.ptr)
    }
}

/// The bytes `[lo, hi)` of `new` that differ from `old` (all of them beyond `old`'s end),
/// or None when `new` is a prefix of `old` (the kernel reads only `new.len()` bytes).
fn changed_span(old: &[u8], new: &[u8]) -> Option<(usize, usize)> {
    let differs = |i: &usize| old.get(*i) != Some(&new[*i]);
    let lo = (0..new.len()).find(differs)?;
    let hi = (lo..new.len())
        .rev()
        .find(differs)
        .map_or(lo + 1, |h| h + 1);
    Some((lo, hi))
}

impl Drop for ResidentTable {
    fn drop(&mut self) {
        if self.ptr != 0 {
            // SAFETY: allocated by `alloc_zeroed` of this backend; `free` waits for the
            // launches still reading it.
            unsafe { self.backend.free(self.ptr) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::changed_span;

    #[test]
    fn only_the_changed_span_is_uploaded() {
        assert_eq!(changed_span(&[], &[1, 2, 3]), Some((0, 3)));
        assert_eq!(changed_span(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(changed_span(&[1, 2, 3, 4], &[1, 2]), None);
        assert_eq!(changed_span(&[1, 2, 3, 4], &[1, 9, 3, 4]), Some((1, 2)));
        assert_eq!(changed_span(&[1, 2, 3, 4], &[1, 9, 3, 8]), Some((1, 4)));
        assert_eq!(changed_span(&[1, 2], &[1, 2, 5]), Some((2, 3)));
    }
}
