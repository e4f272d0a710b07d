//! The CUDA backend (feature `cuda`): a device's primary context with fo's kernels loaded
//! (`nvrtc` compiles them once per architecture), and the `Backend` calls on it.
//!
//! Only the raw driver calls of cudarc are used, because fo borrows the caller's stream
//! and the caller's current context must be left as it was: each entry pushes the
//! device's primary context (the one the CUDA runtime, hence torch, uses) and pops it on
//! return (`context::Current`, the one guard). Library presence is checked before any
//! call: cudarc panics when a library it was asked to use is absent. Asynchronous copies
//! from host memory go through the device's pinned `Ring`, never from pageable memory.
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{result as cu, sys as cusys};

use super::context::Current;
use super::lanes::Lanes;
use super::nvrtc::{
    arch_option, compile_ptx, cubin_arch_option, cubin_for, missing_nvrtc, nvrtc_version,
    NORM_ENTRIES,
};
use super::ring::Ring;
use crate::error::{Error, Result};
use crate::kernels::norm_table::NormTable;
use crate::kernels::step_path::{entry_name, STEP_PATHS};

/// Threads per block (whole warps; the kernels' launch bounds assume it); the step kernel
/// gives each 32-element group eight of them, 4 elements each (`STEP_LANES_PER_GROUP`).
const BLOCK: u32 = crate::kernels::gpu::BLOCK_THREADS;
/// Blocks per SM the grid is capped at; the kernel's grid-stride loop covers the rest, so
/// a huge group does not launch millions of blocks. 16 blocks of 128 threads fill an SM
/// (2048 threads) when registers allow: the one-path step entries need 43 to 60 (p5 is
/// capped at 48, fo_step.cuh).
const BLOCKS_PER_SM: u32 = 16;

/// Why GPU steps cannot run in this process (a library that does not load), or None.
/// libcuda comes with the NVIDIA driver, never with pip, so cudarc's search of the
/// library path by name is the right one for it (`libcuda.so.1` is the driver's soname);
/// NVRTC comes from pip too and has fo's own search (`nvrtc_lib`).
pub fn missing_library() -> Option<String> {
    // SAFETY: only tries to load libcuda; no CUDA call is made.
    if !unsafe { cusys::is_culib_present() } {
        return Some(format!(
            "the CUDA driver library (libcuda.so) could not be loaded; tried {} on the \
             library path (it comes with the NVIDIA driver, not with pip)",
            cudarc::get_lib_name_candidates("cuda").join(", ")
        ));
    }
    missing_nvrtc()
}

/// What is missing for device tensors, or where they are taken.
pub(super) fn missing() -> String {
    match missing_library() {
        Some(m) => m,
        None => "device tensors are taken by fo_optimizer_add_param, fo_optimizer_step, \
                 fo_optimizer_set_mirror, fo_clip_grad_norm and fo_broadcast_state_dict, not here"
            .into(),
    }
}

/// CUDA device `on` (`open::backend` keeps the host away) as a backend, opening it on
/// first use.
pub(super) fn backend(on: crate::tensor::Device) -> Result<Arc<dyn super::Backend>> {
    Ok(device(on.to_c())? as Arc<dyn super::Backend>)
}

/// Streams are taken where the libraries load.
pub(super) fn stream_support() -> Result<()> {
    match missing_library() {
        Some(m) => Err(Error::Unsupported(format!("fo_optimizer_set_stream: {m}"))),
        None => Ok(()),
    }
}

/// The CUDA driver's version as "major.minor" (12080 -> 12.8).
pub fn driver_version() -> String {
    let mut v = 0;
    // SAFETY: writes one int.
    match unsafe { cusys::cuDriverGetVersion(&mut v) }.result() {
        Ok(()) => format!("{}.{}", v / 1000, (v % 1000) / 10),
        Err(e) => format!("unknown ({e:?})"),
    }
}

fn cuda_err(what: &str, e: cu::DriverError) -> Error {
    Error::Internal(format!("CUDA call {what} failed: {e:?}"))
}

/// One CUDA device with fo's kernel loaded (compiled once, kept for the process).
pub struct Device {
    pub ordinal: i32,
    pub arch: String,
    ctx: cusys::CUcontext,
    /// The step kernel's entries by path (`kernels::step_path`; 0: `ENTRY`).
    step_funcs: Vec<cusys::CUfunction>,
    /// `NORM_ENTRIES`, in order.
    norm: [cusys::CUfunction; 3],
    max_blocks: u32,
    ring: Ring,
    lanes: Lanes,
}

// SAFETY: a primary context and a function handle may be used from any thread once the
// context is current there (every use goes through `Current`).
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

/// One device's slot: opened once, by the first caller; others for it wait on it only.
type Slot = Arc<Mutex<Option<Arc<Device>>>>;

fn devices() -> &'static Mutex<HashMap<i32, Slot>> {
    static D: OnceLock<Mutex<HashMap<i32, Slot>>> = OnceLock::new();
    D.get_or_init(Default::default)
}

/// Device `ordinal` with the kernel loaded, compiling it on first use (holding only this
/// device's slot, so another device opens meanwhile). Failures are not cached: a later
/// call tries again.
pub fn device(ordinal: i32) -> Result<Arc<Device>> {
    let slot = devices()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(ordinal)
        .or_default()
        .clone();
    let mut s = slot.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = &*s {
        return Ok(d.clone());
    }
    // Checked before the first CUDA call only: every step looks its device up here.
    if let Some(m) = missing_library() {
        return Err(Error::Unsupported(format!("device = {ordinal}: {m}")));
    }
    // SAFETY: the libraries are present (checked above).
    let d = Arc::new(unsafe { Device::open(ordinal)? });
    *s = Some(d.clone());
    Ok(d)
}

/// fo's kernels loaded into the current context: the device's CUBIN, else (NVRTC without
/// that architecture, say) PTX for the driver to finish. A driver too old for NVRTC's PTX
/// is `Unsupported`, naming both versions. Returns the module and what was loaded.
unsafe fn load_module(ordinal: i32, major: i32, minor: i32) -> Result<(cusys::CUmodule, String)> {
    let cubin_arch = cubin_arch_option(major, minor);
    let cubin = cubin_for(major, minor).and_then(|c| {
        cu::module::load_data(c.as_ptr() as *const c_void)
            .map_err(|e| cuda_err("cuModuleLoadData (CUBIN)", e))
    });
    let cubin_err = match cubin {
        Ok(m) => return Ok((m, format!("{cubin_arch} (CUBIN)"))),
        Err(e) => e,
    };
    let arch = arch_option(major, minor);
    let ptx = compile_ptx(&arch)?;
    match cu::module::load_data(ptx.as_ptr() as *const c_void) {
        Ok(m) => Ok((m, format!("{arch} (PTX)"))),
        Err(e) if e.0 == cusys::CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => {
            Err(Error::Unsupported(format!(
                "device = {ordinal}: the CUDA driver (CUDA {}) is older than NVRTC {} that \
                 compiled fo's kernels, so it cannot load their PTX \
                 (CUDA_ERROR_UNSUPPORTED_PTX_VERSION), and the sm_{major}{minor} CUBIN did not \
                 load either ({cubin_err}); update the driver, or set FO_NVRTC_LIBRARY to \
                 an NVRTC no newer than the driver (pip's nvidia-cuda-nvrtc-cu12 for a CUDA 12 \
                 driver)",
                driver_version(),
                nvrtc_version()
            )))
        }
        Err(e) => Err(cuda_err("cuModuleLoadData (PTX)", e)),
    }
}

impl Device {
    unsafe fn open(ordinal: i32) -> Result<Device> {
        cu::init().map_err(|e| cuda_err("cuInit", e))?;
        let count = cu::device::get_count().map_err(|e| cuda_err("cuDeviceGetCount", e))?;
        if ordinal < 0 || ordinal >= count {
            return Err(Error::Unsupported(format!(
                "device = {ordinal}: this machine has {count} CUDA device(s)"
            )));
        }
        let dev = cu::device::get(ordinal).map_err(|e| cuda_err("cuDeviceGet", e))?;
        let attr =
            |a| cu::device::get_attribute(dev, a).map_err(|e| cuda_err("cuDeviceGetAttribute", e));
        use cusys::CUdevice_attribute as A;
        let major = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sms = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as u32;
        // The primary context stays retained for the process, as the module does.
        let ctx =
            cu::primary_ctx::retain(dev).map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", e))?;
        let _cur = Current::push(ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))?;
        let (module, arch) = match load_module(ordinal, major, minor) {
            Ok(m) => m,
            Err(e) => {
                drop(_cur);
                let _ = cu::primary_ctx::release(dev);
                return Err(e);
            }
        };
        let get = |name: &str| {
            cu::module::get_function(module, CString::new(name).expect("no NUL"))
                .map_err(|e| cuda_err("cuModuleGetFunction", e))
        };
        let step_funcs = (0..STEP_PATHS)
            .map(|p| get(&entry_name(p)))
            .collect::<Result<Vec<_>>>()?;
        let norm = [
            get(NORM_ENTRIES[0])?,
            get(NORM_ENTRIES[1])?,
            get(NORM_ENTRIES[2])?,
        ];
        Ok(Device {
            ordinal,
            arch,
            ctx,
            step_funcs,
            norm,
            max_blocks: sms * BLOCKS_PER_SM,
            ring: Ring::default(),
            lanes: Lanes::default(),
        })
    }

    /// Launches `func` on a grid-stride grid for `threads` threads (capped at the
    /// resident blocks; the kernels loop over the rest).
    unsafe fn run(
        &self,
        func: cusys::CUfunction,
        threads: u64,
        stream: cusys::CUstream,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        let grid = threads
            .div_ceil(BLOCK as u64)
            .clamp(1, self.max_blocks as u64) as u32;
        cu::launch_kernel(func, (grid, 1, 1), (BLOCK, 1, 1), 0, stream, args)
            .map_err(|e| cuda_err("cuLaunchKernel", e))
    }

    /// Copies `bytes` (a norm table) into stream-ordered device memory with `extra`
    /// more bytes after it, runs `body` with its address, then frees it in stream order.
    /// The source is pageable: callers wait for the stream before `bytes` is dropped
    /// (the norm and the scale do; a step's launch goes through the ring instead).
    unsafe fn with_device_copy<T>(
        &self,
        bytes: &[u8],
        extra: usize,
        stream: cusys::CUstream,
        body: impl FnOnce(u64) -> Result<T>,
    ) -> Result<T> {
        let d = cu::malloc_async(stream, bytes.len() + extra)
            .map_err(|e| cuda_err("cuMemAllocAsync", e))?;
        let out = cu::memcpy_htod_async(d, bytes, stream)
            .map_err(|e| cuda_err("cuMemcpyHtoDAsync", e))
            .and_then(|()| body(d));
        let freed = cu::free_async(d, stream).map_err(|e| cuda_err("cuMemFreeAsync", e));
        let out = out?;
        freed?;
        Ok(out)
    }

    /// `table`'s row count as the norm kernels take it.
    fn norm_rows(table: &NormTable) -> Result<i32> {
        i32::try_from(table.tensors.len())
            .map_err(|_| Error::invalid("grads", "more than 2^31 device gradients"))
    }
}

mod backend;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_libcuda_a_device_is_refused_naming_it() {
        // SAFETY: only tries to load the library.
        if unsafe { cusys::is_culib_present() } {
            eprintln!("skipped: libcuda loads on this machine");
            return;
        }
        let e = device(0).err().expect("no libcuda").to_string();
        assert!(
            e.contains("device = 0: the CUDA driver library (libcuda.so)"),
            "{e}"
        );
        let slots = devices().lock().unwrap();
        assert!(
            slots.values().all(|s| s.lock().unwrap().is_none()),
            "failures are not cached"
        );
    }
}
