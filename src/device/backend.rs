//! What fo needs from a device: memory, copies ordered on a stream, events, and launches
//! of the optimizer's and the clip's kernels (their tables are the kernels' ABI).
//!
//! CUDA provides it (feature `cuda`: `cuda::Device`); without the feature `no_cuda` refuses
//! every device clearly; the unit tests provide a host emulation (`emulated`: host memory,
//! the host build of the same kernel text), so device state, staging, the hybrid step and
//! the clip's device norm above this trait run in CI without a GPU.
use super::lanes::{LaneStreams, Lanes};
use super::ring::Ring;
use crate::error::Result;
use crate::kernels::norm_table::NormTable;
use crate::kernels::step_table::StepLaunch;

/// One device. Streams are `CUstream` values as integers (0: the legacy default stream).
pub trait Backend: LaneStreams + Send + Sync {
    /// `bytes` (at least 1) of device memory, zeroed in order on `stream`.
    ///
    /// # Safety
    /// `stream` must be 0 or a valid stream of this device.
    unsafe fn alloc_zeroed(&self, bytes: usize, stream: usize) -> Result<u64>;

    /// Frees memory from `alloc_zeroed` once the work queued on it is done.
    ///
    /// # Safety
    /// `ptr` came from `alloc_zeroed` of this backend and is not used afterwards.
    unsafe fn free(&self, ptr: u64);

    /// Copies `dst.len()` bytes at `src` into `dst` after the work queued on `stream`,
    /// and waits for the copy.
    ///
    /// # Safety
    /// `src` must be `dst.len()` readable bytes of this device; `stream` valid or 0.
    unsafe fn download(&self, src: u64, dst: &mut [u8], stream: usize) -> Result<()>;

    /// Copies `src` to `dst` in order on `stream`, after the work queued there; `src`
    /// may be reused when this returns.
    ///
    /// # Safety
    /// `dst` must be `src.len()` writable bytes of this device; `stream` valid or 0.
    unsafe fn upload(&self, dst: u64, src: &[u8], stream: usize) -> Result<()>;

    /// Copies `bytes` from `src` to `dst`, both memory of this device, in order on
    /// `stream` after the work queued there (`cuMemcpyDtoDAsync`); the host does not wait.
    ///
    /// # Safety
    /// Both ranges must be `bytes` of this device's memory that stay valid until the copy
    /// has run, and not overlap; `stream` valid or 0.
    unsafe fn copy_on_device(&self, dst: u64, src: u64, bytes: usize, stream: usize) -> Result<()>;

    /// `bytes` (at least 1) of device memory, allocated in order on `stream` (its
    /// contents undefined), for `free_async` on the same stream.
    ///
    /// # Safety
    /// `stream` must be 0 or a valid stream of this device.
    unsafe fn alloc_async(&self, bytes: usize, stream: usize) -> Result<u64>;

    /// Frees memory from `alloc_async` in order on `stream`, after the work queued there.
    ///
    /// # Safety
    /// `ptr` came from `alloc_async` and no work on another stream still uses it.
    unsafe fn free_async(&self, ptr: u64, stream: usize);

    /// This device's pinned staging ring (asynchronous copies go through it).
    fn ring(&self) -> &Ring;

    /// This device's copy lanes (the offload pipeline's streams and pinned slots).
    fn lanes(&self) -> &Lanes;

    /// Copies a step table's changed bytes `src` to `dst` (inside a resident table) in
    /// order on `stream`, through the pinned ring; `src` may be reused when this returns.
    /// One call per upload, so the emulated device can count them.
    ///
    /// # Safety
    /// As `Ring::upload`: `dst` must be `src.len()` writable bytes of this device.
    unsafe fn upload_table(&self, dst: u64, src: &[u8], stream: usize) -> Result<()>;

    /// Launches the step kernel's entry for `launch.path` on `stream` over `count` rows of
    /// a table already in device memory at `table` (spanning `launch.total_groups`
    /// groups), with the rule scalars and SGD's `first` flag by value, without waiting.
    ///
    /// # Safety
    /// `table` and every address in it must be memory of this device that stays valid
    /// until the kernel has run; `stream` valid or 0.
    unsafe fn launch_step(
        &self,
        table: u64,
        count: i32,
        launch: &StepLaunch,
        stream: usize,
    ) -> Result<()>;

    /// The norm kernels over `table` (`power` 1: sum of |x|, 2: of x*x) after the work
    /// queued on `stream`: `[sum, largest |x|]` per global chunk, waited for.
    ///
    /// # Safety
    /// Every tensor in the table must be readable memory of this device; `stream` valid or 0.
    unsafe fn norm_chunks(&self, table: &NormTable, power: u32, stream: usize) -> Result<Vec<f64>>;

    /// Multiplies every element of `table`'s tensors by `coef` (in f32 for 32- and 16-bit
    /// tensors, f64 for f64 ones) in order on `stream`, and waits for it.
    ///
    /// # Safety
    /// Every tensor in the table must be writable memory of this device; `stream` valid or 0.
    unsafe fn scale(&self, table: &NormTable, coef: f64, stream: usize) -> Result<()>;

    /// Checks that `stream` can order work on this device: 0, or a stream created in this
    /// device's primary context (the one torch uses). An `InvalidArgument` naming
    /// `stream` otherwise, before anything is queued.
    ///
    /// # Safety
    /// `stream` must be 0 or a live stream handle (of any device).
    unsafe fn check_stream(&self, stream: usize) -> Result<()>;

    /// Where `ptr` lives: host memory, memory of which device (`cuPointerGetAttribute`).
    ///
    /// # Safety
    /// None: the address is only looked up.
    unsafe fn memory_of(&self, ptr: u64) -> Result<Memory>;

    /// The whole allocation `ptr` lies in, `(start, bytes)`, where the driver knows it
    /// (`CU_POINTER_ATTRIBUTE_RANGE_START_ADDR` / `RANGE_SIZE` for device memory), else
    /// None. Asked only after `memory_of` said `ptr` is this device's memory.
    ///
    /// # Safety
    /// None: the address is only looked up.
    unsafe fn allocation_of(&self, ptr: u64) -> Result<Option<(u64, u64)>>;

    /// Makes the work queued on `to` from now on wait for the work queued on `from` so
    /// far (an event recorded on `from`, waited for on `to`); the host does not wait.
    ///
    /// # Safety
    /// Both streams pass `check_stream`.
    unsafe fn order_streams(&self, from: usize, to: usize) -> Result<()>;
}

/// Where an address lives, as the device's driver answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// Host memory: pageable (unknown to CUDA) or page-locked.
    Host,
    /// Device memory of this CUDA ordinal (managed memory counts as its device's).
    Device(i32),
    /// Memory no emulated device allocated (unit tests pass host buffers as device
    /// memory): taken to be what the caller says. The CUDA backend never answers this.
    Untracked,
}
