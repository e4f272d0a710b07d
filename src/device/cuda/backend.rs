//! `Backend` on a CUDA device: every call pushes the device's primary context (`Current`)
//! and queues on the caller's stream; only `download`, `upload`, the norm and the scale wait.
use std::ffi::c_void;

use cudarc::driver::{result as cu, sys as cusys};

use super::{cuda_err, Device};
use crate::device::backend::{Backend, Memory};
use crate::device::context::Current;
use crate::device::lanes::{LaneStreams, Lanes};
use crate::device::ring::{PinnedCopy, Ring};
use crate::error::{Error, Result};
use crate::kernels::gpu::STEP_LANES_PER_GROUP;
use crate::kernels::norm_table::{NormTable, LANES};
use crate::kernels::step_path::STEP_PATHS;
use crate::kernels::step_table::StepLaunch;

fn stream_of(s: usize) -> cusys::CUstream {
    s as cusys::CUstream
}

impl Device {
    /// Makes the device's primary context current until the guard drops.
    unsafe fn enter(&self) -> Result<Current> {
        Current::push(self.ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))
    }
}

impl LaneStreams for Device {
    unsafe fn create_stream(&self) -> Result<usize> {
        let _cur = self.enter()?;
        // Non-blocking: the lanes order themselves against the caller's stream with
        // events, and must not wait for unrelated work on the legacy default stream.
        cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map(|s| s as usize)
            .map_err(|e| cuda_err("cuStreamCreate", e))
    }
}

impl PinnedCopy for Device {
    unsafe fn alloc_pinned(&self, bytes: usize) -> Result<u64> {
        let _cur = self.enter()?;
        cu::malloc_host(bytes.max(1), 0)
            .map(|p| p as u64)
            .map_err(|e| cuda_err("cuMemHostAlloc", e))
    }

    unsafe fn free_pinned(&self, ptr: u64) {
        if let Ok(_cur) = Current::push(self.ctx) {
            let _ = cu::free_host(ptr as *mut c_void);
        }
    }

    unsafe fn copy_to_device(&self, dst: u64, src: u64, bytes: usize, stream: usize) -> Result<()> {
        let _cur = self.enter()?;
        cusys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, bytes, stream_of(stream))
            .result()
            .map_err(|e| cuda_err("cuMemcpyHtoDAsync", e))
    }

    unsafe fn copy_to_host(&self, dst: u64, src: u64, bytes: usize, stream: usize) -> Result<()> {
        let _cur = self.enter()?;
        cusys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, bytes, stream_of(stream))
            .result()
            .map_err(|e| cuda_err("cuMemcpyDtoHAsync", e))
    }

    unsafe fn record_event(&self, stream: usize) -> Result<u64> {
        let _cur = self.enter()?;
        let ev = cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| cuda_err("cuEventCreate", e))?;
        if let Err(e) = cu::event::record(ev, stream_of(stream)) {
            let _ = cu::event::destroy(ev);
            return Err(cuda_err("cuEventRecord", e));
        }
        Ok(ev as u64)
    }

    unsafe fn wait_event(&self, event: u64) -> Result<()> {
        let _cur = self.enter()?;
        let ev = event as cusys::CUevent;
        let r = cusys::cuEventSynchronize(ev)
            .result()
            .map_err(|e| cuda_err("cuEventSynchronize", e));
        let _ = cu::event::destroy(ev);
        r
    }
}

impl Backend for Device {
    unsafe fn alloc_zeroed(&self, bytes: usize, stream: usize) -> Result<u64> {
        let _cur = self.enter()?;
        let ptr = cu::malloc_sync(bytes.max(1)).map_err(|e| cuda_err("cuMemAlloc", e))?;
        if let Err(e) = cu::memset_d8_async(ptr, 0, bytes.max(1), stream_of(stream)) {
            let _ = cu::free_sync(ptr);
            return Err(cuda_err("cuMemsetD8Async", e));
        }
        Ok(ptr)
    }

    unsafe fn free(&self, ptr: u64) {
        // cuMemFree waits for the work still using the memory.
        if let Ok(_cur) = Current::push(self.ctx) {
            let _ = cu::free_sync(ptr);
        }
    }

    unsafe fn download(&self, src: u64, dst: &mut [u8], stream: usize) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let _cur = self.enter()?;
        let s = stream_of(stream);
        cu::memcpy_dtoh_async(dst, src, s).map_err(|e| cuda_err("cuMemcpyDtoHAsync", e))?;
        cu::stream::synchronize(s).map_err(|e| cuda_err("cuStreamSynchronize", e))
    }

    unsafe fn upload(&self, dst: u64, src: &[u8], stream: usize) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let _cur = self.enter()?;
        let s = stream_of(stream);
        cu::memcpy_htod_async(dst, src, s).map_err(|e| cuda_err("cuMemcpyHtoDAsync", e))?;
        // A pageable source may be staged lazily: wait, so `src` may be reused at once.
        cu::stream::synchronize(s).map_err(|e| cuda_err("cuStreamSynchronize", e))
    }

    unsafe fn copy_on_device(&self, dst: u64, src: u64, bytes: usize, stream: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let _cur = self.enter()?;
        cusys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream_of(stream))
            .result()
            .map_err(|e| cuda_err("cuMemcpyDtoDAsync", e))
    }

    unsafe fn alloc_async(&self, bytes: usize, stream: usize) -> Result<u64> {
        let _cur = self.enter()?;
        cu::malloc_async(stream_of(stream), bytes.max(1))
            .map_err(|e| cuda_err("cuMemAllocAsync", e))
    }

    unsafe fn free_async(&self, ptr: u64, stream: usize) {
        if let Ok(_cur) = Current::push(self.ctx) {
            let _ = cu::free_async(ptr, stream_of(stream));
        }
    }

    fn lanes(&self) -> &Lanes {
        &self.lanes
    }

    fn ring(&self) -> &Ring {
        &self.ring
    }

    unsafe fn upload_table(&self, dst: u64, src: &[u8], stream: usize) -> Result<()> {
        self.ring.upload(self, dst, src, stream)
    }

    unsafe fn launch_step(
        &self,
        table: u64,
        count: i32,
        launch: &StepLaunch,
        stream: usize,
    ) -> Result<()> {
        let _cur = self.enter()?;
        let (mut t, mut n, mut total) = (table, count, launch.total_groups);
        // `fo_rule` by value: cuLaunchKernel copies the struct's 68 bytes from here.
        let (mut r, mut f) = (launch.rule, launch.first as i32);
        let mut args = [
            &mut t as *mut _ as *mut c_void,
            &mut n as *mut _ as *mut c_void,
            &mut total as *mut _ as *mut c_void,
            &mut r as *mut _ as *mut c_void,
            &mut f as *mut _ as *mut c_void,
        ];
        // Eight lanes per 32-element group, 4 elements each (fo_step.cuh); BLOCK is whole warps.
        let threads = launch.total_groups.saturating_mul(STEP_LANES_PER_GROUP);
        let path = launch.path;
        let func = *self.step_funcs.get(path as usize).ok_or_else(|| {
            Error::invalid(
                "path",
                format!("no step kernel path {path} (0..{STEP_PATHS})"),
            )
        })?;
        self.run(func, threads, stream_of(stream), &mut args)
    }

    unsafe fn norm_chunks(&self, table: &NormTable, power: u32, stream: usize) -> Result<Vec<f64>> {
        if table.tensors.is_empty() {
            return Ok(Vec::new());
        }
        let (chunks, count) = (table.total_chunks, Self::norm_rows(table)?);
        let mut out = vec![0u8; 16 * chunks as usize];
        let _cur = self.enter()?;
        let s = stream_of(stream);
        let lanes = chunks * LANES as u64;
        // After the table: lane sums, lane maxima, then [sum, max] per chunk.
        let extra = 16 * lanes as usize + out.len();
        self.with_device_copy(table.as_bytes(), extra, s, |d| {
            let at = d + table.as_bytes().len() as u64;
            let (mut t, mut n, mut total, mut p) = (d, count, chunks, power as i32);
            let (mut ls, mut lm, mut o) = (at, at + 8 * lanes, at + 16 * lanes);
            let mut args = [
                &mut t as *mut _ as *mut c_void,
                &mut n as *mut _ as *mut c_void,
                &mut total as *mut _ as *mut c_void,
                &mut p as *mut _ as *mut c_void,
                &mut ls as *mut _ as *mut c_void,
                &mut lm as *mut _ as *mut c_void,
            ];
            self.run(self.norm[0], lanes, s, &mut args)?;
            let mut args = [
                &mut ls as *mut _ as *mut c_void,
                &mut lm as *mut _ as *mut c_void,
                &mut total as *mut _ as *mut c_void,
                &mut o as *mut _ as *mut c_void,
            ];
            self.run(self.norm[1], chunks, s, &mut args)?;
            cu::memcpy_dtoh_async(&mut out[..], o, s).map_err(|e| cuda_err("cuMemcpyDtoHAsync", e))
        })?;
        cu::stream::synchronize(s).map_err(|e| cuda_err("cuStreamSynchronize", e))?;
        Ok(out
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect())
    }

    unsafe fn scale(&self, table: &NormTable, coef: f64, stream: usize) -> Result<()> {
        if table.tensors.is_empty() {
            return Ok(());
        }
        let count = Self::norm_rows(table)?;
        let _cur = self.enter()?;
        let s = stream_of(stream);
        self.with_device_copy(table.as_bytes(), 0, s, |d| {
            let (mut t, mut n, mut total) = (d, count, table.total_chunks);
            let (mut c, mut c64) = (coef as f32, coef);
            let mut args = [
                &mut t as *mut _ as *mut c_void,
                &mut n as *mut _ as *mut c_void,
                &mut total as *mut _ as *mut c_void,
                &mut c as *mut _ as *mut c_void,
                &mut c64 as *mut _ as *mut c_void,
            ];
            self.run(
                self.norm[2],
                table.total_chunks * LANES as u64,
                s,
                &mut args,
            )
        })?;
        cu::stream::synchronize(s).map_err(|e| cuda_err("cuStreamSynchronize", e))
    }

    unsafe fn check_stream(&self, stream: usize) -> Result<()> {
        if stream == 0 {
            return Ok(());
        }
        let _cur = self.enter()?;
        let mut ctx: cusys::CUcontext = std::ptr::null_mut();
        cusys::cuStreamGetCtx(stream_of(stream), &mut ctx)
            .result()
            .map_err(|e| {
                Error::invalid("stream", format!("{stream:#x} is not a CUDA stream: {e:?}"))
            })?;
        if ctx != self.ctx {
            return Err(Error::invalid(
                "stream",
                format!(
                    "{stream:#x} is a stream of another CUDA context than device {}'s primary \
                     context (a stream of another device?); fo runs device {}'s work on a \
                     stream of that device",
                    self.ordinal, self.ordinal
                ),
            ));
        }
        Ok(())
    }

    unsafe fn memory_of(&self, ptr: u64) -> Result<Memory> {
        use cusys::CUpointer_attribute as P;
        let _cur = self.enter()?;
        let get = |attr: P, out: *mut c_void| cusys::cuPointerGetAttribute(out, attr, ptr);
        let mut managed: u32 = 0;
        match get(
            P::CU_POINTER_ATTRIBUTE_IS_MANAGED,
            &mut managed as *mut u32 as *mut c_void,
        ) {
            cusys::CUresult::CUDA_SUCCESS => {}
            // Not an address CUDA knows: pageable host memory.
            cusys::CUresult::CUDA_ERROR_INVALID_VALUE => return Ok(Memory::Host),
            e => return Err(cuda_err("cuPointerGetAttribute", cu::DriverError(e))),
        }
        let mut ty: u32 = 0;
        get(
            P::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            &mut ty as *mut u32 as *mut c_void,
        )
        .result()
        .map_err(|e| cuda_err("cuPointerGetAttribute", e))?;
        if managed == 0 && ty == cusys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 {
            return Ok(Memory::Host);
        }
        let mut ordinal: i32 = -1;
        get(
            P::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            &mut ordinal as *mut i32 as *mut c_void,
        )
        .result()
        .map_err(|e| cuda_err("cuPointerGetAttribute", e))?;
        Ok(Memory::Device(ordinal))
    }

    unsafe fn allocation_of(&self, ptr: u64) -> Result<Option<(u64, u64)>> {
        use cusys::CUpointer_attribute as P;
        let _cur = self.enter()?;
        let (mut start, mut size): (cusys::CUdeviceptr, usize) = (0, 0);
        let r = cusys::cuPointerGetAttribute(
            &mut start as *mut _ as *mut c_void,
            P::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            ptr,
        )
        .result()
        .and_then(|()| {
            cusys::cuPointerGetAttribute(
                &mut size as *mut _ as *mut c_void,
                P::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                ptr,
            )
            .result()
        });
        // A driver that cannot say leaves the cache to the tensor's own bytes.
        Ok(match r {
            Ok(()) if start <= ptr && ptr - start < size as u64 => Some((start, size as u64)),
            _ => None,
        })
    }

    unsafe fn order_streams(&self, from: usize, to: usize) -> Result<()> {
        if from == to {
            return Ok(());
        }
        let _cur = self.enter()?;
        let ev = cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| cuda_err("cuEventCreate", e))?;
        let r = cu::event::record(ev, stream_of(from))
            .map_err(|e| cuda_err("cuEventRecord", e))
            .and_then(|()| {
                cu::stream::wait_event(
                    stream_of(to),
                    ev,
                    cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
                .map_err(|e| cuda_err("cuStreamWaitEvent", e))
            });
        // A recorded event may be destroyed at once: the wait keeps what it needs.
        let _ = cu::event::destroy(ev);
        r
    }
}
