//! The emulated device's `Backend`: every call queues a job on the stream's worker, as
//! CUDA queues work on a stream; copies check their host side when they run.
use std::sync::{Arc, Condvar, Mutex};

use super::{
    device_at, devices, holds, host_marks, Addr, Emulated, Event, DOWNLOADS, POINTER_QUERIES,
    TABLE_UPLOADS,
};
use crate::device::backend::{Backend, Memory};
use crate::device::lanes::{LaneStreams, Lanes};
use crate::device::ring::{PinnedCopy, Ring};
use crate::error::{Error, Result};
use crate::kernels::norm_table::NormTable;
use crate::kernels::step_table::{FoStepTensor, StepLaunch};

impl LaneStreams for Emulated {
    unsafe fn create_stream(&self) -> Result<usize> {
        Ok(super::create_stream(self.ordinal))
    }
}

impl PinnedCopy for Emulated {
    unsafe fn alloc_pinned(&self, bytes: usize) -> Result<u64> {
        let _cur = self.enter();
        let p = self.raw_alloc(bytes)?;
        self.pinned.lock().unwrap().insert(p, bytes.max(1));
        self.count(bytes.max(1) as isize, 0);
        Ok(p)
    }

    unsafe fn free_pinned(&self, ptr: u64) {
        let _cur = self.enter();
        let bytes = self.live.lock().unwrap().get(&ptr).copied().unwrap_or(0);
        self.raw_free(ptr);
        self.count(-(bytes as isize), 0);
    }

    unsafe fn copy_to_device(&self, dst: u64, src: u64, bytes: usize, stream: usize) -> Result<()> {
        let _cur = self.enter();
        let w = self.worker(stream)?;
        w.push(self.checked_copy(
            src as usize,
            src as usize,
            dst as usize,
            bytes,
            "a copy to the device",
        ));
        Ok(())
    }

    unsafe fn copy_to_host(&self, dst: u64, src: u64, bytes: usize, stream: usize) -> Result<()> {
        let _cur = self.enter();
        let w = self.worker(stream)?;
        w.push(self.checked_copy(
            dst as usize,
            src as usize,
            dst as usize,
            bytes,
            "a copy to the host",
        ));
        Ok(())
    }

    unsafe fn record_event(&self, stream: usize) -> Result<u64> {
        let _cur = self.enter();
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let w = self.worker(stream)?;
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ev: Arc<Event> = Default::default();
        self.events.lock().unwrap().insert(id, ev.clone());
        w.push(Box::new(move || {
            *ev.0.lock().unwrap() = true;
            ev.1.notify_all();
        }));
        Ok(id)
    }

    unsafe fn wait_event(&self, event: u64) -> Result<()> {
        let _cur = self.enter();
        let ev = self.events.lock().unwrap().remove(&event).ok_or_else(|| {
            Error::Internal(format!(
                "emulated device {}: no event {event}",
                self.ordinal
            ))
        })?;
        let mut done = ev.0.lock().unwrap();
        if !*done {
            super::BLOCKING_WAITS.with(|w| w.set(w.get() + 1));
        }
        while !*done {
            done = ev.1.wait(done).unwrap();
        }
        Ok(())
    }
}

impl Backend for Emulated {
    unsafe fn alloc_zeroed(&self, bytes: usize, stream: usize) -> Result<u64> {
        let _cur = self.enter();
        let w = self.worker(stream)?;
        let p = self.raw_alloc(bytes)?;
        let (at, n) = (Addr(p as usize), bytes.max(1));
        w.push(Box::new(move || {
            let at = at;
            std::ptr::write_bytes(at.0 as *mut u8, 0, n)
        }));
        Ok(p)
    }

    unsafe fn free(&self, ptr: u64) {
        let _cur = self.enter();
        // cuMemFree waits for the device's work.
        self.synchronize();
        self.raw_free(ptr)
    }

    unsafe fn alloc_async(&self, bytes: usize, stream: usize) -> Result<u64> {
        let _cur = self.enter();
        self.worker(stream)?;
        let p = self.raw_alloc(bytes)?;
        self.count(0, bytes.max(1) as isize);
        Ok(p)
    }

    unsafe fn free_async(&self, ptr: u64, stream: usize) {
        let _cur = self.enter();
        let Ok(w) = self.worker(stream) else { return };
        let d = device_at(self.ordinal).expect("an emulated device");
        let at = Addr(ptr as usize);
        w.push(Box::new(move || {
            let at = at;
            let bytes = d
                .live
                .lock()
                .unwrap()
                .get(&(at.0 as u64))
                .copied()
                .unwrap_or(0);
            d.raw_free(at.0 as u64);
            d.count(0, -(bytes as isize));
        }));
    }

    fn lanes(&self) -> &Lanes {
        &self.lanes
    }

    fn ring(&self) -> &Ring {
        &self.ring
    }

    unsafe fn memory_of(&self, ptr: u64) -> Result<Memory> {
        let _cur = self.enter();
        POINTER_QUERIES.with(|q| q.set(q.get() + 1));
        let p = ptr as usize;
        if host_marks()
            .lock()
            .unwrap()
            .iter()
            .any(|&(a, n)| a <= p && p < a + n)
        {
            return Ok(Memory::Host);
        }
        for d in devices().into_iter().flatten() {
            if holds(&d.pinned.lock().unwrap(), p) {
                return Ok(Memory::Host);
            }
            if holds(&d.live.lock().unwrap(), p) {
                return Ok(Memory::Device(d.ordinal));
            }
        }
        Ok(Memory::Untracked)
    }

    unsafe fn allocation_of(&self, ptr: u64) -> Result<Option<(u64, u64)>> {
        let _cur = self.enter();
        POINTER_QUERIES.with(|q| q.set(q.get() + 1));
        let p = ptr as usize;
        let live = self.live.lock().unwrap();
        Ok(live
            .iter()
            .find(|(&a, &n)| a as usize <= p && p < a as usize + n)
            .map(|(&a, &n)| (a, n as u64)))
    }

    unsafe fn download(&self, src: u64, dst: &mut [u8], stream: usize) -> Result<()> {
        let _cur = self.enter();
        let w = self.worker(stream)?;
        DOWNLOADS.with(|d| d.set(d.get() + 1));
        let (s, d, n) = (
            Addr(src as usize),
            Addr(dst.as_mut_ptr() as usize),
            dst.len(),
        );
        w.push(Box::new(move || {
            let (s, d) = (s, d);
            std::ptr::copy_nonoverlapping(s.0 as *const u8, d.0 as *mut u8, n)
        }));
        w.sync();
        Ok(())
    }

    unsafe fn upload(&self, dst: u64, src: &[u8], stream: usize) -> Result<()> {
        let _cur = self.enter();
        let w = self.worker(stream)?;
        // Staged now (as CUDA stages a pageable source), written in stream order.
        let staged = src.to_vec();
        let d = Addr(dst as usize);
        w.push(Box::new(move || {
            let d = d;
            std::ptr::copy_nonoverlapping(staged.as_ptr(), d.0 as *mut u8, staged.len())
        }));
        Ok(())
    }

    unsafe fn copy_on_device(&self, dst: u64, src: u64, bytes: usize, stream: usize) -> Result<()> {
        let _cur = self.enter();
        super::DEVICE_COPIES.with(|c| c.set(c.get() + 1));
        let w = self.worker(stream)?;
        let (s, d) = (Addr(src as usize), Addr(dst as usize));
        w.push(Box::new(move || {
            let (s, d) = (s, d);
            std::ptr::copy_nonoverlapping(s.0 as *const u8, d.0 as *mut u8, bytes)
        }));
        Ok(())
    }

    unsafe fn upload_table(&self, dst: u64, src: &[u8], stream: usize) -> Result<()> {
        let _cur = self.enter();
        TABLE_UPLOADS.with(|u| u.set(u.get() + 1));
        self.ring.upload(self, dst, src, stream)
    }

    unsafe fn launch_step(
        &self,
        table: u64,
        count: i32,
        launch: &StepLaunch,
        stream: usize,
    ) -> Result<()> {
        let _cur = self.enter();
        let w = self.worker(stream)?;
        let (run, t, l) = (self.run.step, Addr(table as usize), *launch);
        let failed = self.violations.clone();
        w.push(Box::new(move || {
            let t = t;
            // After a violation the table may be garbage: a sticky error, as a fault on a
            // GPU is, so the test reports the violation instead of crashing.
            if failed.lock().unwrap().is_empty() {
                run(
                    t.0 as *const FoStepTensor,
                    count,
                    l.total_groups,
                    &l.rule,
                    l.first as i32,
                    l.path,
                )
            }
        }));
        Ok(())
    }

    unsafe fn norm_chunks(&self, table: &NormTable, power: u32, stream: usize) -> Result<Vec<f64>> {
        let _cur = self.enter();
        let w = self.worker(stream)?;
        let mut out = vec![0f64; 2 * table.total_chunks as usize];
        if !table.tensors.is_empty() {
            let (run, t, chunks) = (self.run.norm, table.tensors.clone(), table.total_chunks);
            let o = Addr(out.as_mut_ptr() as usize);
            w.push(Box::new(move || {
                let o = o;
                run(
                    t.as_ptr(),
                    t.len() as i32,
                    chunks,
                    power as i32,
                    o.0 as *mut f64,
                )
            }));
            w.sync();
        }
        Ok(out)
    }

    unsafe fn scale(&self, table: &NormTable, coef: f64, stream: usize) -> Result<()> {
        let _cur = self.enter();
        let w = self.worker(stream)?;
        if !table.tensors.is_empty() {
            let (run, t, chunks) = (self.run.scale, table.tensors.clone(), table.total_chunks);
            w.push(Box::new(move || {
                run(t.as_ptr(), t.len() as i32, chunks, coef as f32, coef)
            }));
            w.sync();
        }
        Ok(())
    }

    unsafe fn check_stream(&self, stream: usize) -> Result<()> {
        let _cur = self.enter();
        self.worker(stream).map(|_| ())
    }

    unsafe fn order_streams(&self, from: usize, to: usize) -> Result<()> {
        let _cur = self.enter();
        let (f, t) = (self.worker(from)?, self.worker(to)?);
        if Arc::ptr_eq(&f, &t) {
            return Ok(());
        }
        let event = Arc::new((Mutex::new(false), Condvar::new()));
        let recorded = event.clone();
        f.push(Box::new(move || {
            *recorded.0.lock().unwrap() = true;
            recorded.1.notify_all();
        }));
        t.push(Box::new(move || {
            let mut done = event.0.lock().unwrap();
            while !*done {
                done = event.1.wait(done).unwrap();
            }
        }));
        Ok(())
    }
}
