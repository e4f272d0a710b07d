//! The launch path (feature `cuda`): NVRTC compiles `KERNEL_SOURCES` once per device to a
//! CUBIN for that device's `sm_XY` (PTX for its `compute_XY` as the fallback, which needs
//! a driver at least as new as NVRTC), and each (param group, step) uploads its tensor table and
//! launches `fo_step_kernel` once on the caller's stream (`backend::launch`). Everything is
//! stream-ordered (table allocation, copy from the pinned ring, kernel, free): the host
//! never waits for the device there.
//!
//! Only the raw driver and NVRTC calls of cudarc are used, because fo borrows the
//! caller's stream and the caller's current context must be left as it was: each entry
//! pushes the device's primary context (the one the CUDA runtime, hence torch, uses) and
//! pops it on return (`context::Current`, the one guard). Library presence is checked before any call: cudarc panics when a
//! library it was asked to use is absent.
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{result as cu, sys as cusys};
use cudarc::nvrtc::{result as nvr, sys as nvsys};

use super::backend::Backend;
use super::check::Memory;
use super::context::Current;
use super::norm_table::{NormTable, LANES};
use super::ring::Ring;
use super::KERNEL_SOURCES;
use crate::error::{Error, Result};

/// The step kernel's entry point (`extern "C"` in fo_step.cuh).
pub const ENTRY: &str = "fo_step_kernel";
/// The clip's kernels (fo_norm.cuh): lane partials, chunk folds, scaling.
pub const NORM_ENTRIES: [&str; 3] = [
    "fo_norm_lanes_kernel",
    "fo_norm_chunks_kernel",
    "fo_scale_kernel",
];
/// NVRTC options besides `--gpu-architecture`: the same as scripts/nvrtc_check.py, which
/// compiles the kernels in CI. `--fmad=false`: only the multiply-adds written as `fo_fma`
/// fuse, as on the CPU path.
pub const NVRTC_OPTIONS: [&str; 3] = ["--fmad=false", "-std=c++17", "--restrict"];
/// Threads per block; each thread steps one 32-element group at a time.
const BLOCK: u32 = 128;
/// Resident blocks per SM the grid is capped at; the kernel's grid-stride loop covers
/// the rest, so a huge group does not launch millions of blocks.
const BLOCKS_PER_SM: u32 = 8;

/// Why GPU steps cannot run in this process (a library that does not load), or None.
pub fn missing_library() -> Option<&'static str> {
    // SAFETY: only tries to load libcuda; no CUDA call is made.
    if !unsafe { cusys::is_culib_present() } {
        return Some("the CUDA driver library (libcuda.so) could not be loaded");
    }
    missing_nvrtc()
}

/// Why NVRTC cannot be used (compiling needs no GPU and no libcuda), or None.
pub fn missing_nvrtc() -> Option<&'static str> {
    // SAFETY: only tries to load the library; no NVRTC call is made.
    if !unsafe { nvsys::is_culib_present() } {
        return Some("the NVRTC library (libnvrtc.so) could not be loaded; add its directory to LD_LIBRARY_PATH");
    }
    None
}

fn cuda_err(what: &str, e: cu::DriverError) -> Error {
    Error::Internal(format!("CUDA call {what} failed: {e:?}"))
}

/// The `--gpu-architecture` option for compute capability `major.minor` (PTX for the
/// device's own virtual architecture; the driver finishes it for the exact chip).
pub fn arch_option(major: i32, minor: i32) -> String {
    format!("--gpu-architecture=compute_{major}{minor}")
}

/// The `--gpu-architecture` option for a CUBIN (machine code) of compute capability
/// `major.minor`. Unlike PTX, a CUBIN from NVRTC 12.x loads on any 12.x driver (CUDA's
/// minor version compatibility): PTX `.version 8.7` from NVRTC 12.8 needs R570 or newer.
pub fn cubin_arch_option(major: i32, minor: i32) -> String {
    format!("--gpu-architecture=sm_{major}{minor}")
}

/// Compiles the kernels to a CUBIN for `arch` (a `cubin_arch_option`).
pub fn compile_cubin(arch: &str) -> Result<Vec<u8>> {
    compile(arch, |prog| {
        let mut size = 0usize;
        // SAFETY: a compiled program; the buffer holds `size` bytes.
        unsafe {
            nvsys::nvrtcGetCUBINSize(prog, &mut size).result()?;
            let mut out = vec![0u8; size];
            nvsys::nvrtcGetCUBIN(prog, out.as_mut_ptr() as *mut c_char).result()?;
            Ok(out)
        }
    })
}

/// NVRTC's version as "major.minor".
pub fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints (the library is present: checked by the callers).
    match unsafe { nvsys::nvrtcVersion(&mut major, &mut minor) }.result() {
        Ok(()) => format!("{major}.{minor}"),
        Err(e) => format!("unknown ({e:?})"),
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

/// Compiles the kernels to PTX with `arch` (an `arch_option`). The headers are handed to
/// NVRTC in memory, so no file or include path is needed at run time. Errors carry
/// NVRTC's log.
pub fn compile_ptx(arch: &str) -> Result<Vec<c_char>> {
    compile(arch, |prog| {
        // SAFETY: a compiled program.
        unsafe { nvr::get_ptx(prog) }.map(|v| v.into_iter().map(|b| b as u8).collect::<Vec<u8>>())
    })
    .map(|v| v.into_iter().map(|b| b as c_char).collect())
}

/// Compiles the kernels with `arch` and takes the output with `get`.
fn compile<T: Into<Vec<u8>>>(
    arch: &str,
    get: impl FnOnce(nvsys::nvrtcProgram) -> std::result::Result<T, nvr::NvrtcError>,
) -> Result<Vec<u8>> {
    if let Some(m) = missing_nvrtc() {
        return Err(Error::Unsupported(m.into()));
    }
    let cstr = |s: &str| CString::new(s).expect("kernel sources hold no NUL");
    let names: Vec<CString> = KERNEL_SOURCES.iter().map(|(n, _)| cstr(n)).collect();
    let texts: Vec<CString> = KERNEL_SOURCES.iter().map(|(_, t)| cstr(t)).collect();
    let name_ptrs: Vec<*const c_char> = names.iter().map(|c| c.as_ptr()).collect();
    let text_ptrs: Vec<*const c_char> = texts.iter().map(|c| c.as_ptr()).collect();
    let main = cstr("#include \"fo_step.cuh\"\n#include \"fo_norm.cuh\"\n");
    let mut opts: Vec<String> = vec![arch.to_string()];
    opts.extend(NVRTC_OPTIONS.iter().map(|s| s.to_string()));
    let nv = |what: &str, e: nvr::NvrtcError| Error::Unsupported(format!("NVRTC {what}: {e:?}"));
    // SAFETY: every pointer outlives the program, which is destroyed before returning.
    unsafe {
        let mut prog: nvsys::nvrtcProgram = std::ptr::null_mut();
        nvsys::nvrtcCreateProgram(
            &mut prog,
            main.as_ptr(),
            c"fo_kernels.cu".as_ptr(),
            names.len() as i32,
            text_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
        .result()
        .map_err(|e| nv("nvrtcCreateProgram", e))?;
        let compiled = nvr::compile_program(prog, &opts);
        let out = match compiled {
            Ok(()) => get(prog)
                .map(Into::into)
                .map_err(|e| nv("nvrtcGetPTX/nvrtcGetCUBIN", e)),
            Err(e) => {
                let log = nvr::get_program_log(prog)
                    .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
                    .unwrap_or_default();
                Err(Error::Unsupported(format!(
                    "NVRTC could not compile fo's kernels ({} {}): {e:?}\n{log}",
                    arch,
                    NVRTC_OPTIONS.join(" ")
                )))
            }
        };
        let _ = nvr::destroy_program(prog);
        out
    }
}

/// One CUDA device with fo's kernel loaded (compiled once, kept for the process).
pub struct Device {
    pub ordinal: i32,
    pub arch: String,
    ctx: cusys::CUcontext,
    func: cusys::CUfunction,
    /// `NORM_ENTRIES`, in order.
    norm: [cusys::CUfunction; 3],
    max_blocks: u32,
    ring: Ring,
}

// SAFETY: a primary context and a function handle may be used from any thread once the
// context is current there (every use goes through `Current`).
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

fn devices() -> &'static Mutex<HashMap<i32, Arc<Device>>> {
    static D: OnceLock<Mutex<HashMap<i32, Arc<Device>>>> = OnceLock::new();
    D.get_or_init(Default::default)
}

/// Device `ordinal` with the kernel loaded, compiling it on first use. Failures are not
/// cached: a later call tries again.
pub fn device(ordinal: i32) -> Result<Arc<Device>> {
    let mut map = devices().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = map.get(&ordinal) {
        return Ok(d.clone());
    }
    // Checked before the first CUDA call only: every step looks its device up here.
    if let Some(m) = missing_library() {
        return Err(Error::Unsupported(format!("device = {ordinal}: {m}")));
    }
    // SAFETY: the libraries are present (checked above).
    let d = Arc::new(unsafe { Device::open(ordinal)? });
    map.insert(ordinal, d.clone());
    Ok(d)
}

/// fo's kernels loaded into the current context: the device's CUBIN, else (NVRTC without
/// that architecture, say) PTX for the driver to finish. A driver too old for NVRTC's PTX
/// is `Unsupported`, naming both versions. Returns the module and what was loaded.
unsafe fn load_module(ordinal: i32, major: i32, minor: i32) -> Result<(cusys::CUmodule, String)> {
    let cubin_arch = cubin_arch_option(major, minor);
    let cubin = compile_cubin(&cubin_arch).and_then(|c| {
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
                 load either ({cubin_err}); update the driver, or put an NVRTC no newer than \
                 the driver first on LD_LIBRARY_PATH",
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
        let func = get(ENTRY)?;
        let norm = [
            get(NORM_ENTRIES[0])?,
            get(NORM_ENTRIES[1])?,
            get(NORM_ENTRIES[2])?,
        ];
        Ok(Device {
            ordinal,
            arch,
            ctx,
            func,
            norm,
            max_blocks: sms * BLOCKS_PER_SM,
            ring: Ring::default(),
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

fn stream_of(s: usize) -> cusys::CUstream {
    s as cusys::CUstream
}

impl Backend for Device {
    unsafe fn alloc_zeroed(&self, bytes: usize, stream: usize) -> Result<u64> {
        let _cur = Current::push(self.ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))?;
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

    unsafe fn alloc_pinned(&self, bytes: usize) -> Result<u64> {
        let _cur = Current::push(self.ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))?;
        cu::malloc_host(bytes.max(1), 0)
            .map(|p| p as u64)
            .map_err(|e| cuda_err("cuMemHostAlloc", e))
    }

    unsafe fn free_pinned(&self, ptr: u64) {
        if let Ok(_cur) = Current::push(self.ctx) {
            let _ = cu::free_host(ptr as *mut c_void);
        }
    }

    unsafe fn download(&self, src: u64, dst: &mut [u8], stream: usize) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let _cur = Current::push(self.ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))?;
        let s = stream_of(stream);
        cu::memcpy_dtoh_async(dst, src, s).map_err(|e| cuda_err("cuMemcpyDtoHAsync", e))?;
        cu::stream::synchronize(s).map_err(|e| cuda_err("cuStreamSynchronize", e))
    }

    unsafe fn upload(&self, dst: u64, src: &[u8], stream: usize) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let _cur = Current::push(self.ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))?;
        let s = stream_of(stream);
        cu::memcpy_htod_async(dst, src, s).map_err(|e| cuda_err("cuMemcpyHtoDAsync", e))?;
        // A pageable source may be staged lazily: wait, so `src` may be reused at once.
        cu::stream::synchronize(s).map_err(|e| cuda_err("cuStreamSynchronize", e))
    }

    unsafe fn alloc_async(&self, bytes: usize, stream: usize) -> Result<u64> {
        let _cur = Current::push(self.ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))?;
        cu::malloc_async(stream_of(stream), bytes.max(1))
            .map_err(|e| cuda_err("cuMemAllocAsync", e))
    }

    unsafe fn free_async(&self, ptr: u64, stream: usize) {
        if let Ok(_cur) = Current::push(self.ctx) {
            let _ = cu::free_async(ptr, stream_of(stream));
        }
    }

    unsafe fn copy_to_device(&self, dst: u64, src: u64, bytes: usize, stream: usize) -> Result<()> {
        let _cur = Current::push(self.ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))?;
        cusys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, bytes, stream_of(stream))
            .result()
            .map_err(|e| cuda_err("cuMemcpyHtoDAsync", e))
    }

    unsafe fn copy_to_host(&self, dst: u64, src: u64, bytes: usize, stream: usize) -> Result<()> {
        let _cur = Current::push(self.ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))?;
        cusys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, bytes, stream_of(stream))
            .result()
            .map_err(|e| cuda_err("cuMemcpyDtoHAsync", e))
    }

    unsafe fn record_event(&self, stream: usize) -> Result<u64> {
        let _cur = Current::push(self.ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))?;
        let ev = cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| cuda_err("cuEventCreate", e))?;
        if let Err(e) = cu::event::record(ev, stream_of(stream)) {
            let _ = cu::event::destroy(ev);
            return Err(cuda_err("cuEventRecord", e));
        }
        Ok(ev as u64)
    }

    unsafe fn wait_event(&self, event: u64) -> Result<()> {
        let _cur = Current::push(self.ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))?;
        let ev = event as cusys::CUevent;
        let r = cusys::cuEventSynchronize(ev)
            .result()
            .map_err(|e| cuda_err("cuEventSynchronize", e));
        let _ = cu::event::destroy(ev);
        r
    }

    fn ring(&self) -> &Ring {
        &self.ring
    }

    unsafe fn launch_step(
        &self,
        table: u64,
        count: i32,
        total_groups: u64,
        stream: usize,
    ) -> Result<()> {
        let _cur = Current::push(self.ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))?;
        let (mut t, mut n, mut total) = (table, count, total_groups);
        let mut args = [
            &mut t as *mut _ as *mut c_void,
            &mut n as *mut _ as *mut c_void,
            &mut total as *mut _ as *mut c_void,
        ];
        self.run(self.func, total_groups, stream_of(stream), &mut args)
    }

    unsafe fn norm_chunks(&self, table: &NormTable, power: u32, stream: usize) -> Result<Vec<f64>> {
        if table.tensors.is_empty() {
            return Ok(Vec::new());
        }
        let (chunks, count) = (table.total_chunks, Self::norm_rows(table)?);
        let mut out = vec![0u8; 16 * chunks as usize];
        let _cur = Current::push(self.ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))?;
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
        let _cur = Current::push(self.ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))?;
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
        let _cur = Current::push(self.ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))?;
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
        let _cur = Current::push(self.ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))?;
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

    unsafe fn order_streams(&self, from: usize, to: usize) -> Result<()> {
        if from == to {
            return Ok(());
        }
        let _cur = Current::push(self.ctx).map_err(|e| cuda_err("cuCtxPushCurrent", e))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvrtc_options_are_the_ones_ci_compiles_with() {
        let script = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/nvrtc_check.py"
        ))
        .unwrap();
        for o in NVRTC_OPTIONS {
            assert!(
                script.contains(&format!("\"{o}\"")),
                "{o} not in nvrtc_check.py"
            );
        }
        assert!(script.contains(&format!("ENTRY = \"{ENTRY}\"")));
        for e in NORM_ENTRIES {
            assert!(
                script.contains(&format!("\"{e}\"")),
                "{e} not in nvrtc_check.py"
            );
        }
        assert_eq!(arch_option(9, 0), "--gpu-architecture=compute_90");
        assert_eq!(arch_option(8, 6), "--gpu-architecture=compute_86");
        assert_eq!(cubin_arch_option(9, 0), "--gpu-architecture=sm_90");
    }

    /// Runs where NVRTC loads (no GPU needed): scripts/test.sh puts the pinned NVRTC wheel
    /// on LD_LIBRARY_PATH for it.
    #[test]
    fn nvrtc_compiles_the_embedded_kernels_to_ptx_and_cubin_for_sm80_and_sm90() {
        if let Some(why) = missing_nvrtc() {
            eprintln!("skipped: {why}");
            return;
        }
        let written = include_str!("kernels/fo_rules.cuh")
            .matches("fo_fma(")
            .count();
        for (major, minor) in [(8, 0), (9, 0)] {
            let ptx = compile_ptx(&arch_option(major, minor)).unwrap();
            let bytes: Vec<u8> = ptx.iter().map(|&c| c as u8).collect();
            let text = CStr::from_bytes_until_nul(&bytes)
                .unwrap()
                .to_str()
                .unwrap();
            for entry in std::iter::once(ENTRY).chain(NORM_ENTRIES) {
                assert!(
                    text.contains(&format!(".entry {entry}")),
                    "sm_{major}{minor}: {entry}"
                );
            }
            // --fmad=false holds for f64 too: the norm's sums are not contracted.
            assert!(!text.contains("fma.rn.f64"), "sm_{major}{minor}");
            assert!(
                text.contains(&format!(".target sm_{major}{minor}")),
                "sm_{major}{minor}"
            );
            // --fmad=false took effect: the only fused multiply-adds are the written ones.
            assert_eq!(
                text.matches("fma.rn.f32").count(),
                written,
                "sm_{major}{minor}"
            );
        }
        // The CUBIN the device loads first (PTX is the fallback): an ELF for each.
        for (major, minor) in [(8, 0), (9, 0)] {
            let cubin = compile_cubin(&cubin_arch_option(major, minor)).unwrap();
            assert!(cubin.starts_with(b"\x7fELF"), "sm_{major}{minor}");
            for entry in std::iter::once(ENTRY).chain(NORM_ENTRIES) {
                assert!(
                    cubin.windows(entry.len()).any(|w| w == entry.as_bytes()),
                    "sm_{major}{minor} CUBIN: {entry}"
                );
            }
        }
        assert!(nvrtc_version().starts_with("12."), "{}", nvrtc_version());
        let e = compile_ptx("--gpu-architecture=compute_10")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("NVRTC could not compile fo's kernels (--gpu-architecture=compute_10"),
            "{e}"
        );
    }

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
        assert!(
            devices().lock().unwrap().is_empty(),
            "failures are not cached"
        );
    }
}
