//! The plain-old-data structs that cross the boundary, and their checked conversions.
use std::ffi::c_void;

use super::args::{arg_count, arg_dims, arg_ndim, arg_slice};
use super::code_tables::PLACEMENT;
use super::codes::{
    FO_MAX_DIMS, FO_PLACEMENT_PARTIAL, FO_PLACEMENT_REPLICATE, FO_PLACEMENT_SHARD,
    FO_PLACEMENT_STRIDED_SHARD,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shard::{Placement, ShardInfo, ShardSpec};
use crate::tensor::{Device, TensorView};

/// A tensor in caller memory. `dtype`: a `FO_DTYPE_*` code (`FO_DTYPE_F32`, ...).
/// `strides` are in elements (NULL = contiguous row-major). `device` is `FO_DEVICE_HOST`
/// (-1) for host memory, >= 0 a CUDA ordinal.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fo_tensor {
    pub data: *mut c_void,
    pub dtype: i32,
    pub ndim: i32,
    pub shape: *const i64,
    pub strides: *const i64,
    pub device: i32,
}

impl fo_tensor {
    /// A checked view of host memory; `what` names the argument in errors.
    pub(crate) unsafe fn to_host(self, what: &str) -> Result<TensorView> {
        crate::device::refuse_unless_host(self.device, what)?;
        self.view_on(Device::Host, what)
    }

    /// A checked view of the tensor's memory on its device. Device memory is checked as a
    /// view (shape, strides, NULL, alignment) and never read on the host; the entry
    /// points taking it (`fo_optimizer_add_param`, `fo_optimizer_step`, ...) hand it to
    /// the GPU only.
    pub(crate) unsafe fn to_view(self, what: &str) -> Result<TensorView> {
        let device = Device::from_c(self.device, &format!("{what}.device"))?;
        self.view_on(device, what)
    }

    /// `to_view` with the argument's name made only for an error: a step converts every
    /// gradient at every call, and formatting their names (`grads[i].shape`, ...) was
    /// most of that conversion's cost. The checks are `to_view`'s: any failure runs
    /// `to_view` again with the name, for its error.
    pub(crate) unsafe fn to_view_named(self, what: impl Fn() -> String) -> Result<TensorView> {
        match self.try_view() {
            Some(v) => Ok(v),
            None => self.to_view(&what()),
        }
    }

    /// The view `to_view` makes, or None where it would fail.
    unsafe fn try_view(self) -> Option<TensorView> {
        let device = match self.device {
            Device::HOST_CODE => Device::Host,
            n if n >= 0 => Device::Cuda(n as u32),
            _ => return None,
        };
        let dtype = DType::by_code(self.dtype)?;
        let ndim = usize::try_from(self.ndim)
            .ok()
            .filter(|&n| n <= FO_MAX_DIMS)?;
        if ndim > 0 && self.shape.is_null() {
            return None;
        }
        let shape = std::slice::from_raw_parts(self.shape, ndim);
        let strides = match (self.strides.is_null(), ndim) {
            (true, _) => None,
            (false, 0) => Some(&[][..]),
            (false, n) => Some(std::slice::from_raw_parts(self.strides, n)),
        };
        TensorView::on(device, self.data as *mut u8, dtype, shape, strides, "").ok()
    }

    unsafe fn view_on(self, device: Device, what: &str) -> Result<TensorView> {
        let dtype = DType::from_code(self.dtype, &format!("{what}.dtype"))?;
        let ndim = arg_ndim(self.ndim, &format!("{what}.ndim"), false)?;
        let shape = arg_slice(self.shape, ndim, &format!("{what}.shape"))?;
        let strides = if self.strides.is_null() {
            None
        } else {
            Some(arg_slice(self.strides, ndim, &format!("{what}.strides"))?)
        };
        TensorView::on(device, self.data as *mut u8, dtype, shape, strides, what)
    }
}

/// One mesh dim's placement. `kind`: `FO_PLACEMENT_REPLICATE`, `FO_PLACEMENT_SHARD`,
/// `FO_PLACEMENT_STRIDED_SHARD` (torch `_StridedShard`) or `FO_PLACEMENT_PARTIAL`. `dim`
/// is the tensor dim for the two shard kinds; `split_factor` (>= 1) is read for
/// `FO_PLACEMENT_STRIDED_SHARD` only.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct fo_placement {
    pub kind: i32,
    pub dim: i32,
    pub split_factor: i32,
}

impl fo_placement {
    pub(crate) fn to_placement(self, what: &str) -> Result<Placement> {
        let dim = || arg_count(self.dim as i64, &format!("{what}.dim"));
        Ok(match self.kind {
            FO_PLACEMENT_REPLICATE => Placement::Replicate,
            FO_PLACEMENT_SHARD => Placement::Shard(dim()?),
            FO_PLACEMENT_STRIDED_SHARD => {
                if self.split_factor < 1 {
                    return Err(Error::invalid(
                        format!("{what}.split_factor"),
                        format!("must be >= 1, got {}", self.split_factor),
                    ));
                }
                Placement::StridedShard {
                    dim: dim()?,
                    split_factor: self.split_factor as usize,
                }
            }
            FO_PLACEMENT_PARTIAL => Placement::Partial,
            k => {
                return Err(Error::invalid(
                    format!("{what}.kind"),
                    format!("unknown placement kind {k} (valid: {})", PLACEMENT.valid()),
                ))
            }
        })
    }

    pub(crate) fn from_placement(p: Placement) -> fo_placement {
        let (kind, dim, split_factor) = match p {
            Placement::Replicate => (FO_PLACEMENT_REPLICATE, 0, 0),
            Placement::Shard(d) => (FO_PLACEMENT_SHARD, d as i32, 0),
            Placement::StridedShard { dim, split_factor } => {
                (FO_PLACEMENT_STRIDED_SHARD, dim as i32, split_factor as i32)
            }
            Placement::Partial => (FO_PLACEMENT_PARTIAL, 0, 0),
        };
        fo_placement {
            kind,
            dim,
            split_factor,
        }
    }
}

/// Where a local tensor lies in its global (DTensor) tensor: the global shape
/// (`ndim` sizes), the mesh (`mesh_ndim` sizes), this rank's coordinate in it, and one
/// placement per mesh dim. All arrays are borrowed for the duration of the call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fo_shard_spec {
    pub ndim: i32,
    pub global_shape: *const i64,
    pub mesh_ndim: i32,
    pub mesh_shape: *const i64,
    pub coord: *const i64,
    pub placements: *const fo_placement,
}

impl fo_shard_spec {
    pub(crate) unsafe fn to_spec(self) -> Result<ShardSpec> {
        shard_spec_from_parts(
            self.ndim,
            self.global_shape,
            self.mesh_ndim,
            self.mesh_shape,
            self.coord,
            self.placements,
        )
    }
}

/// The checked `ShardSpec` behind every entry point that takes sharding as loose arrays.
pub(crate) unsafe fn shard_spec_from_parts(
    ndim: i32,
    global_shape: *const i64,
    mesh_ndim: i32,
    mesh_shape: *const i64,
    coord: *const i64,
    placements: *const fo_placement,
) -> Result<ShardSpec> {
    let ndim = arg_ndim(ndim, "ndim", false)?;
    let mesh_ndim = arg_ndim(mesh_ndim, "mesh_ndim", true)?;
    let global_shape = arg_dims(
        arg_slice(global_shape, ndim, "global_shape")?,
        "global_shape",
    )?;
    let mesh_shape = arg_dims(
        arg_slice(mesh_shape, mesh_ndim, "mesh_shape")?,
        "mesh_shape",
    )?;
    let coord = arg_dims(arg_slice(coord, mesh_ndim, "coord")?, "coord")?;
    let placements = arg_slice(placements, mesh_ndim, "placements")?
        .iter()
        .enumerate()
        .map(|(i, p)| p.to_placement(&format!("placements[{i}]")))
        .collect::<Result<Vec<_>>>()?;
    ShardSpec::new(global_shape, mesh_shape, coord, placements)
}

/// What `fo_wrap_uneven` reports for one mesh coordinate. Entries past `ndim` are 0.
/// `global_offset` follows PyTorch 2.15: the first global index held along each dim, and
/// `global_shape[d]` (a sentinel) where the coordinate holds nothing along a sharded dim.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct fo_shard_info {
    pub ndim: i32,
    pub local_shape: [i64; FO_MAX_DIMS],
    pub global_offset: [i64; FO_MAX_DIMS],
    pub global_shape: [i64; FO_MAX_DIMS],
    /// Contiguous strides of the global tensor, in elements (a size-0 dim counts as 1).
    pub global_stride: [i64; FO_MAX_DIMS],
    /// 1 when the shard is one contiguous box of the global tensor (strided shards are not).
    pub is_box: i32,
}

impl From<ShardInfo> for fo_shard_info {
    fn from(s: ShardInfo) -> fo_shard_info {
        let fill = |v: &[usize]| {
            let mut a = [0i64; FO_MAX_DIMS];
            for (dst, &x) in a.iter_mut().zip(v) {
                *dst = x as i64;
            }
            a
        };
        fo_shard_info {
            ndim: s.global_shape.len() as i32,
            local_shape: fill(&s.local_shape),
            global_offset: fill(&s.global_offset),
            global_shape: fill(&s.global_shape),
            global_stride: fill(&s.global_stride),
            is_box: s.is_box as i32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `to_view_named` (a step's gradients) gives what `to_view` gives, view or error,
    /// across every field a caller can get wrong.
    #[test]
    fn a_lazily_named_view_is_the_named_one() {
        let mut buf = [0u64; 8];
        let data = buf.as_mut_ptr() as *mut c_void;
        let shape = [2i64, 3];
        let bad_shape = [2i64, -1];
        let huge = [i64::MAX, 4];
        let strides = [3i64, 1];
        let bad_strides = [-3i64, 1];
        let t = |data, dtype, ndim, shape: *const i64, strides: *const i64, device| fo_tensor {
            data,
            dtype,
            ndim,
            shape,
            strides,
            device,
        };
        let null = std::ptr::null::<i64>();
        let cases = [
            t(data, 0, 2, shape.as_ptr(), null, -1),
            t(data, 2, 2, shape.as_ptr(), strides.as_ptr(), 3),
            t(data, 0, 0, null, null, -1),
            t(data, 0, 0, null, strides.as_ptr(), -1),
            t(std::ptr::null_mut(), 0, 2, shape.as_ptr(), null, -1),
            t(std::ptr::null_mut(), 0, 2, bad_shape.as_ptr(), null, -1),
            t(data, 0, 2, huge.as_ptr(), null, -1),
            t(
                (data as *mut u8).wrapping_add(1) as *mut c_void,
                0,
                2,
                shape.as_ptr(),
                null,
                -1,
            ),
            t(data, 99, 2, shape.as_ptr(), null, -1),
            t(data, 0, -1, shape.as_ptr(), null, -1),
            t(data, 0, 9, shape.as_ptr(), null, -1),
            t(data, 0, 2, null, null, -1),
            t(data, 0, 2, shape.as_ptr(), bad_strides.as_ptr(), -1),
            t(data, 0, 2, shape.as_ptr(), null, -2),
        ];
        for (k, c) in cases.iter().enumerate() {
            let want = unsafe { c.to_view("grads[7]") };
            let got = unsafe { c.to_view_named(|| "grads[7]".to_string()) };
            match (want, got) {
                (Ok(w), Ok(g)) => assert_eq!(format!("{w:?}"), format!("{g:?}"), "case {k}"),
                (Err(w), Err(g)) => assert_eq!(w.to_string(), g.to_string(), "case {k}"),
                (w, g) => panic!("case {k}: to_view gave {w:?}, to_view_named {g:?}"),
            }
        }
    }
}
