//! The offline checkpoint tools' C ABI: `fo_checkpoint_convert` (reshard and/or change the
//! moments' format) and `fo_checkpoint_diff_json` (compare two checkpoints), plus `fo_string_free`.
use std::ffi::{c_char, CString};

use super::args::{arg_flag, arg_mut, arg_path, arg_slice};
use super::code_tables::CONVERT_FORMAT;
use super::codes::{
    FO_CONVERT_FORMAT_COMPRESSED, FO_CONVERT_FORMAT_KEEP, FO_CONVERT_FORMAT_PORTABLE,
};
use super::status::{fo_status, guard, guard_void};
use super::types::fo_placement;
use crate::ckpt::tools::convert::{self, ConvertOptions, Format};
use crate::ckpt::tools::diff::{diff_json, DiffOptions};
use crate::error::{Error, Result};

/// How to convert. `to`: `FO_CONVERT_FORMAT_KEEP` (the moments as SRC has them),
/// `_PORTABLE` (f32) or `_COMPRESSED` (quant8; moments saved in another sharding are
/// requantized in the new groups). `ranks`: world size of DST, 1..=1024 (0: SRC's, or the
/// product of `mesh`). `mesh`/`mesh_ndim`: DST's mesh shape (`mesh_ndim` 0: `[ranks]`).
/// `placements`/`num_placements`: one per mesh dim (0: `Shard(0)` on every mesh dim; a
/// placement naming a dim a key lacks becomes Replicate for that key). `force`: 1 replaces
/// a non-empty DST.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fo_convert_options {
    pub to: i32,
    pub ranks: i32,
    pub mesh_ndim: i32,
    pub mesh: *const i64,
    pub num_placements: i32,
    pub placements: *const fo_placement,
    pub force: i32,
}

fn count(n: i32, name: &str) -> Result<usize> {
    usize::try_from(n).map_err(|_| Error::invalid(name, format!("must be >= 0, got {n}")))
}

unsafe fn convert_options(o: &fo_convert_options) -> Result<ConvertOptions> {
    let to = match o.to {
        FO_CONVERT_FORMAT_KEEP => None,
        FO_CONVERT_FORMAT_PORTABLE => Some(Format::Portable),
        FO_CONVERT_FORMAT_COMPRESSED => Some(Format::Compressed),
        t => {
            return Err(Error::invalid(
                "options.to",
                format!("unknown format {t} (valid: {})", CONVERT_FORMAT.valid()),
            ))
        }
    };
    let ranks = count(o.ranks, "options.ranks")?;
    let mesh = arg_slice(
        o.mesh,
        count(o.mesh_ndim, "options.mesh_ndim")?,
        "options.mesh",
    )?
    .iter()
    .map(|&d| {
        usize::try_from(d).map_err(|_| Error::invalid("options.mesh", format!("negative size {d}")))
    })
    .collect::<Result<Vec<_>>>()?;
    let n = count(o.num_placements, "options.num_placements")?;
    let placements = arg_slice(o.placements, n, "options.placements")?
        .iter()
        .enumerate()
        .map(|(i, p)| p.to_placement(&format!("options.placements[{i}]")))
        .collect::<Result<Vec<_>>>()?;
    Ok(ConvertOptions {
        to,
        ranks: (ranks > 0).then_some(ranks),
        mesh: (!mesh.is_empty()).then_some(mesh),
        placements: (n > 0).then_some(placements),
        force: arg_flag(o.force, "options.force")?,
        names: convert::OptionNames {
            ranks: "options.ranks",
            mesh: "options.mesh",
            placements: "options.placements",
        },
    })
}

/// Converts checkpoint `src` (fo's or PyTorch DCP HuggingFace files, sharded or
/// consolidated) into directory `dst`: resharded onto `options`' world size / mesh /
/// placements, moments in `options.to`'s format (`options` NULL: SRC's world size,
/// Shard(0), SRC's format, no force). DST must not exist or be empty (unless
/// `options.force`) and is never SRC, inside SRC or a directory holding SRC. Everything is
/// written into a staging directory beside DST and renamed onto it: on any error nothing
/// is left at DST (a DST being replaced stays as it was).
#[no_mangle]
pub unsafe extern "C" fn fo_checkpoint_convert(
    src: *const c_char,
    dst: *const c_char,
    options: *const fo_convert_options,
) -> fo_status {
    guard(|| {
        let o = match options.as_ref() {
            Some(o) => convert_options(o)?,
            None => ConvertOptions::default(),
        };
        convert::convert(
            arg_path(src, "src")?,
            arg_path(dst, "dst")?,
            &o,
            &mut |_, _| {},
        )?;
        Ok(())
    })
}

/// Compares checkpoints `a` and `b` (directories of any sharding, consolidated directories
/// or .safetensors files; compressed state as its dequantized values) key by key and sets
/// `*out_json` to a JSON report, freed with `fo_string_free`: `{"a", "b", "rtol", "atol",
/// "keys": [{"key", "status" ("equal", "within", "differs", "mismatch", "missing"),
/// "shape", "numel", "max_abs", "max_rel", "out_of_tolerance", "reason"}],
/// "keys_compared", "keys_differing", "equal"}`. An element is within tolerance when
/// `|a - b| <= atol + rtol * |b|` (NaN equals NaN); `rtol`, `atol` finite and >= 0.
/// Differing checkpoints are FO_OK (the report says so); an unreadable one is an error,
/// and `*out_json` is then NULL.
#[no_mangle]
pub unsafe extern "C" fn fo_checkpoint_diff_json(
    a: *const c_char,
    b: *const c_char,
    rtol: f64,
    atol: f64,
    out_json: *mut *mut c_char,
) -> fo_status {
    guard(|| {
        let out = arg_mut(out_json, "out_json")?;
        *out = std::ptr::null_mut();
        let o = DiffOptions {
            rtol,
            atol,
            ..Default::default()
        };
        let s = diff_json(arg_path(a, "a")?, arg_path(b, "b")?, &o)?;
        let s = CString::new(s).map_err(|_| Error::Internal("report holds a NUL".into()))?;
        *out = s.into_raw();
        Ok(())
    })
}

/// Frees a string the library allocated (`fo_checkpoint_diff_json`'s report). NULL-safe.
#[no_mangle]
pub unsafe extern "C" fn fo_string_free(s: *mut c_char) {
    guard_void(|| {
        if !s.is_null() {
            drop(CString::from_raw(s));
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diff_refuses_null_out_and_bad_tolerance() {
        let a = CString::new("/nonexistent/a").unwrap();
        let st = unsafe {
            fo_checkpoint_diff_json(a.as_ptr(), a.as_ptr(), 0.0, 0.0, std::ptr::null_mut())
        };
        assert_ne!(st, 0);
        let mut out: *mut c_char = std::ptr::dangling_mut::<c_char>();
        let st = unsafe { fo_checkpoint_diff_json(a.as_ptr(), a.as_ptr(), -1.0, 0.0, &mut out) };
        assert_ne!(st, 0);
        assert!(out.is_null());
    }
}
