//! The optimizer's GPU half: the kernel source (`kernels/*.cuh`, one `__host__ __device__`
//! text that NVRTC builds for the GPU and the C++ compiler builds for the host), the
//! launch table (`table`, built and tested on the host), and with feature `cuda` the
//! launch path (`launch`: NVRTC once per device, one launch per param group and step on
//! the optimizer's stream) and parameter state in device memory (`DeviceState`).
//!
//! What is proven where: the arithmetic on the host only (cpp_tests/test_gpu_kernels_host.cpp,
//! bit for bit against the CPU step; scripts/nvrtc_check.py, NVRTC compiles it for
//! sm_80/sm_90); the table's layout and fields on the host (table_tests.rs). The launch
//! path has not been run on a GPU. Without the feature, or without libcuda/NVRTC, device
//! tensors are refused with `Unsupported`, naming what is missing.
pub mod table;

#[cfg(feature = "cuda")]
pub mod launch;

use super::state::{Moment, ParamState};
use crate::error::{Error, Result};
use table::{MomentKind, StateLayout, StatePtrs, StepTable};

/// A moment from its stored bytes (little-endian, as the device and the host hold them):
/// `data` the values or codes, `scales` the fp16 scales of the quantized kinds; None for
/// `MomentKind::None`.
pub fn moment_from_bytes(kind: MomentKind, data: &[u8], scales: &[u8]) -> Option<Moment> {
    use super::master_split::Half;
    use super::state::Root;
    let u16s = |b: &[u8]| -> Vec<u16> {
        b.chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect()
    };
    let f16s = |b: &[u8]| u16s(b).into_iter().map(half::f16::from_bits).collect();
    Some(match kind {
        MomentKind::None => return None,
        MomentKind::F32 => Moment::F32(
            data.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        MomentKind::F16 => Moment::Half(Half::F16, u16s(data)),
        MomentKind::BF16 => Moment::Half(Half::BF16, u16s(data)),
        MomentKind::Q8Signed => Moment::Signed {
            codes: data.iter().map(|&b| b as i8).collect(),
            scales: f16s(scales),
        },
        MomentKind::Q8Sqrt | MomentKind::Q8Fourth => Moment::Unsigned {
            codes: data.to_vec(),
            scales: f16s(scales),
            root: if kind == MomentKind::Q8Fourth {
                Root::Fourth
            } else {
                Root::Sqrt
            },
        },
    })
}

/// The kernel headers, in include order, for a launcher that hands them to NVRTC.
pub const KERNEL_SOURCES: &[(&str, &str)] = &[
    ("fo_shim.cuh", include_str!("kernels/fo_shim.cuh")),
    ("fo_halfconv.cuh", include_str!("kernels/fo_halfconv.cuh")),
    ("fo_master.cuh", include_str!("kernels/fo_master.cuh")),
    ("fo_quant8.cuh", include_str!("kernels/fo_quant8.cuh")),
    ("fo_rules.cuh", include_str!("kernels/fo_rules.cuh")),
    ("fo_step.cuh", include_str!("kernels/fo_step.cuh")),
];

/// Why an entry point that takes host memory only cannot use a tensor on CUDA device
/// `device`: the sentence an `Unsupported` error carries.
pub fn device_refusal(device: i32) -> String {
    format!(
        "device = {device}: {}; only host tensors (device -1) can be used here",
        missing()
    )
}

#[cfg(not(feature = "cuda"))]
fn missing() -> String {
    "this libfo was built without GPU support (rebuild with `--features cuda`)".into()
}

#[cfg(feature = "cuda")]
fn missing() -> String {
    match launch::missing_library() {
        Some(m) => m.into(),
        None => "only fo_optimizer_add_param and fo_optimizer_step take device tensors (state \
                 get/set, checkpoints, clipping and broadcast of device tensors are not available yet)"
            .into(),
    }
}

/// A parameter's optimizer state in device memory, laid out as the host state would be
/// (`StateLayout`). Exists only in builds with feature `cuda`.
pub struct DeviceState {
    pub device: i32,
    pub step: u64,
    /// As `ParamState::m_valid`: SGD's buffer holds a value.
    pub m_valid: bool,
    pub layout: StateLayout,
    numel: usize,
    #[cfg(feature = "cuda")]
    ptrs: StatePtrs,
    /// Owns the device memory behind `ptrs` (freed on drop).
    #[cfg(feature = "cuda")]
    _bufs: Vec<launch::DeviceBuffer>,
    #[cfg(not(feature = "cuda"))]
    never: std::convert::Infallible,
}

impl DeviceState {
    pub fn nbytes(&self) -> usize {
        self.layout.nbytes(self.numel)
    }

    /// A host copy of the state, read after the work queued on `stream` (0: the legacy
    /// default stream), which this waits for.
    ///
    /// # Safety
    /// `stream` must be 0 or a valid stream of the state's device.
    pub unsafe fn to_host(&self, stream: usize) -> Result<ParamState> {
        #[cfg(feature = "cuda")]
        {
            let dev = launch::device(self.device)?;
            let s = stream as cudarc::driver::sys::CUstream;
            let n = self.numel;
            let read = |src: u64, bytes: usize| -> Result<Vec<u8>> {
                let mut v = vec![0u8; bytes];
                dev.download(src, &mut v, s)?;
                Ok(v)
            };
            let moment = |m: Option<table::MomentPtrs>| -> Result<Option<Moment>> {
                let Some(m) = m else { return Ok(None) };
                let (d, sc) = StateLayout::moment_bytes(m.kind, n);
                Ok(moment_from_bytes(
                    m.kind,
                    &read(m.data, d)?,
                    &read(m.scales, sc)?,
                ))
            };
            let p = self.ptrs;
            let err = read(p.error_bits, n * p.error_bits_width as usize / 8)?;
            let pairs =
                |b: &[u8]| -> Vec<[u8; 2]> { b.chunks_exact(2).map(|c| [c[0], c[1]]).collect() };
            Ok(ParamState {
                step: self.step,
                m: moment(p.m)?,
                v: moment(p.v)?,
                error_bits: match p.error_bits_width {
                    8 => Some(super::state::ErrorBits::I8(
                        err.iter().map(|&b| b as i8).collect(),
                    )),
                    16 => Some(super::state::ErrorBits::I16(
                        pairs(&err).into_iter().map(i16::from_le_bytes).collect(),
                    )),
                    _ => None,
                },
                m_valid: self.m_valid,
            })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = stream;
            match self.never {}
        }
    }

    /// The device addresses of the state's buffers, for a launch table.
    pub fn ptrs(&self) -> StatePtrs {
        #[cfg(feature = "cuda")]
        return self.ptrs;
        #[cfg(not(feature = "cuda"))]
        match self.never {}
    }
}

/// Checks that tensors on device `ordinal` can be stepped (the libraries load, the
/// device exists, the kernels compile for it), compiling the kernels on first use.
pub fn open_device(ordinal: i32) -> Result<()> {
    #[cfg(feature = "cuda")]
    return launch::device(ordinal).map(|_| ()).map_err(|e| match e {
        Error::Unsupported(m) if !m.starts_with("device = ") => {
            Error::Unsupported(format!("device = {ordinal}: {m}"))
        }
        e => e,
    });
    #[cfg(not(feature = "cuda"))]
    Err(Error::Unsupported(device_refusal(ordinal)))
}

/// Whether this build and machine can take a CUDA stream (`fo_optimizer_set_stream`).
pub fn stream_support() -> Result<()> {
    #[cfg(feature = "cuda")]
    return match launch::missing_library() {
        Some(m) => Err(Error::Unsupported(format!("fo_optimizer_set_stream: {m}"))),
        None => Ok(()),
    };
    #[cfg(not(feature = "cuda"))]
    Err(Error::Unsupported(
        "fo_optimizer_set_stream: this libfo was built without GPU support (rebuild with `--features cuda`)"
            .into(),
    ))
}

/// Zeroed state for a parameter of `numel` elements on device `device`, zeroed in order
/// on `stream` (a `CUstream`; 0 = the legacy default stream).
///
/// # Safety
/// `stream` must be 0 or a valid stream of `device`.
pub unsafe fn new_device_state(
    device: i32,
    layout: StateLayout,
    numel: usize,
    stream: usize,
) -> Result<DeviceState> {
    #[cfg(feature = "cuda")]
    {
        use table::MomentPtrs;
        let dev = launch::device(device)?;
        let s = stream as cudarc::driver::sys::CUstream;
        let mut bufs = Vec::new();
        let mut alloc = |bytes: usize| -> Result<u64> {
            if bytes == 0 {
                return Ok(0);
            }
            let b = launch::DeviceBuffer::zeroed(&dev, bytes, s)?;
            let p = b.ptr;
            bufs.push(b);
            Ok(p)
        };
        let mut moment = |kind| -> Result<Option<MomentPtrs>> {
            if kind == table::MomentKind::None {
                return Ok(None);
            }
            let (d, sc) = StateLayout::moment_bytes(kind, numel);
            Ok(Some(MomentPtrs {
                kind,
                data: alloc(d)?,
                scales: alloc(sc)?,
            }))
        };
        let (m, v) = (moment(layout.m)?, moment(layout.v)?);
        let width = layout.error_bits_width;
        let error_bits = alloc(numel * width as usize / 8)?;
        Ok(DeviceState {
            device,
            step: 0,
            m_valid: false,
            layout,
            numel,
            ptrs: StatePtrs {
                m,
                v,
                error_bits,
                error_bits_width: width,
            },
            _bufs: bufs,
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (layout, numel, stream);
        Err(Error::Unsupported(device_refusal(device)))
    }
}

/// Launches each `(device, table)` on `stream` (0 = the legacy default stream), in order,
/// without waiting for the device.
///
/// # Safety
/// Every address in the tables must be memory of its device that stays valid until the
/// kernels have run; `stream` must be 0 or a valid stream of those devices.
pub unsafe fn launch_tables(tables: &[(i32, StepTable)], stream: usize) -> Result<()> {
    #[cfg(feature = "cuda")]
    for (device, t) in tables {
        launch::device(*device)?.launch(t, stream as cudarc::driver::sys::CUstream)?;
    }
    #[cfg(not(feature = "cuda"))]
    if let Some((device, _)) = tables.first() {
        let _ = stream;
        return Err(Error::Unsupported(device_refusal(*device)));
    }
    Ok(())
}

#[cfg(test)]
#[path = "host_kernel_tests.rs"]
mod host_kernel_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_names_what_is_missing() {
        let m = device_refusal(0);
        assert!(m.starts_with("device = 0: "), "{m}");
        #[cfg(not(feature = "cuda"))]
        assert!(m.contains("--features cuda"), "{m}");
        #[cfg(feature = "cuda")]
        assert!(
            m.contains("libcuda") || m.contains("NVRTC") || m.contains("fo_optimizer_step"),
            "{m}"
        );
    }

    #[test]
    fn every_kernel_header_is_embedded() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/optim/gpu/kernels");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".cuh"))
            .collect();
        on_disk.sort();
        let mut embedded: Vec<String> = KERNEL_SOURCES.iter().map(|(n, _)| n.to_string()).collect();
        embedded.sort();
        assert_eq!(on_disk, embedded);
    }
}
