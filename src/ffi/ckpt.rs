//! The checkpoint C ABI: `fo_state_pack` and its packed view, save, `fo_state_load`,
//! `fo_checkpoint_consolidate`, `fo_checkpoint_verify`. Thin: converts the C structs and
//! codes; `crate::ckpt` validates and does the work.
use std::ffi::{c_char, c_void, CString};

use super::args::{arg_flag, arg_mut, arg_path, arg_ref, arg_str};
use super::code_tables::{PACK_MODE, PACK_PARAMS};
use super::codes::{
    FO_MAX_DIMS, FO_PACK_MODE_COMPRESSED, FO_PACK_MODE_PORTABLE, FO_PACK_PARAMS_MASTER,
    FO_PACK_PARAMS_NONE, FO_PACK_PARAMS_STORED, FO_WRITE_UNSHARDED_RANK0,
};
use super::handle::{destroy, enter, Guarded, Handle};
use super::optim::{enter_opt, fo_optimizer, write_string};
use super::status::{fo_status, guard, guard_void};
use crate::ckpt::{self, LoadOptions, Mode, Packed, ParamsAs, SaveOptions};
use crate::error::{Error, Result};

/// How to pack or save. `mode`: `FO_PACK_MODE_COMPRESSED` (int8/uint8 codes + fp16
/// scales + error bits) or `FO_PACK_MODE_PORTABLE` (dequantized f32 state). `params`:
/// `FO_PACK_PARAMS_NONE` (state only), `_STORED` (also the params under their plain FQN as
/// stored) or `_MASTER` (also as f32 masters: param + error bits). `write_unsharded`:
/// `FO_WRITE_UNSHARDED_RANK0` (-1) rank 0 writes unsharded entries, 0 this rank does not,
/// 1 it does. `world_size` is 1..=FO_MAX_WORLD_SIZE. `save_id`: the same string on every rank of one save; required when
/// `world_size` > 1 (ranks saving independently cannot agree on a generated one), NULL
/// for one rank generates one. The save becomes visible when the last rank finishes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fo_pack_options {
    pub rank: i32,
    pub world_size: i32,
    pub mode: i32,
    pub params: i32,
    pub write_unsharded: i32,
    pub save_id: *const c_char,
}

impl fo_pack_options {
    /// Field by field conversion only: the ranges (world size, rank inside it) are
    /// `SaveOptions::validate`'s, which every core save entry runs.
    pub(super) unsafe fn to_options(self) -> Result<SaveOptions> {
        let count = |v: i32, what: &str| {
            usize::try_from(v).map_err(|_| Error::invalid(what, format!("negative value {v}")))
        };
        let mode = match self.mode {
            FO_PACK_MODE_COMPRESSED => Mode::Compressed,
            FO_PACK_MODE_PORTABLE => Mode::Portable,
            m => {
                return Err(Error::invalid(
                    "options.mode",
                    format!("unknown mode {m} (valid: {})", PACK_MODE.valid()),
                ))
            }
        };
        let mut o = SaveOptions::new(
            count(self.rank, "options.rank")?,
            count(self.world_size, "options.world_size")?,
            mode,
        );
        o.params = match self.params {
            FO_PACK_PARAMS_NONE => None,
            FO_PACK_PARAMS_STORED => Some(ParamsAs::Stored),
            FO_PACK_PARAMS_MASTER => Some(ParamsAs::Master),
            p => {
                return Err(Error::invalid(
                    "options.params",
                    format!("unknown value {p} (valid: {})", PACK_PARAMS.valid()),
                ))
            }
        };
        o.write_unsharded = match self.write_unsharded {
            FO_WRITE_UNSHARDED_RANK0 => None,
            w => Some(arg_flag(w, "options.write_unsharded").map_err(|_| {
                Error::invalid(
                    "options.write_unsharded",
                    format!("{w} is not {FO_WRITE_UNSHARDED_RANK0} (rank 0), 0 or 1"),
                )
            })?),
        };
        if !self.save_id.is_null() {
            o.save_id = arg_str(self.save_id, "options.save_id")?.to_string();
        }
        Ok(o)
    }
}

/// A rank's packed state: named chunks with global shape and offsets, data included.
/// Created by `fo_state_pack`, freed by `fo_packed_destroy`. One call at a time per
/// handle (FO_ERR_BUSY otherwise, as for `fo_optimizer`).
pub struct fo_packed {
    inner: Handle<PackedNames>,
}

/// The packed state and its names as C strings (they live as long as the handle).
pub(crate) struct PackedNames {
    inner: Packed,
    names: Vec<(CString, CString)>,
}

impl Guarded for fo_packed {
    type Inner = PackedNames;
    const ARG: &'static str = "packed";
    fn handle(&self) -> &Handle<PackedNames> {
        &self.inner
    }
}

/// One chunk of a packed state. `name` is the tensor name in the rank's file (the key,
/// or `<key>#<j>` for chunk j of a strided shard); `shape` is the chunk's shape,
/// `global_offset` where it starts in the key's `global_shape` (entries past `ndim` are
/// 0). `data` (`nbytes` bytes, row-major) and the strings live as long as the handle.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fo_packed_entry {
    pub name: *const c_char,
    pub key: *const c_char,
    pub dtype: i32,
    pub ndim: i32,
    pub shape: [i64; FO_MAX_DIMS],
    pub global_shape: [i64; FO_MAX_DIMS],
    pub global_offset: [i64; FO_MAX_DIMS],
    pub data: *const c_void,
    pub nbytes: u64,
}

fn dims(v: &[usize]) -> [i64; FO_MAX_DIMS] {
    let mut a = [0i64; FO_MAX_DIMS];
    a.iter_mut().zip(v).for_each(|(d, &x)| *d = x as i64);
    a
}

/// Packs the optimizer's local state (no collectives) into `*out`.
#[no_mangle]
pub unsafe extern "C" fn fo_state_pack(
    opt: *const fo_optimizer,
    options: *const fo_pack_options,
    out: *mut *mut fo_packed,
) -> fo_status {
    guard(|| {
        let out = arg_mut(out, "out")?;
        let opt = enter_opt(opt, "fo_state_pack")?;
        let packed = ckpt::pack(&opt, &arg_ref(options, "options")?.to_options()?)?;
        let cstr = |s: &str| {
            CString::new(s).map_err(|_| Error::invalid("key", format!("{s:?} contains a NUL byte")))
        };
        let names = packed
            .plan
            .chunks
            .iter()
            .map(|c| Ok((cstr(&c.name)?, cstr(&c.key)?)))
            .collect::<Result<_>>()?;
        *out = Box::into_raw(Box::new(fo_packed {
            inner: Handle::new(
                "the packed state",
                PackedNames {
                    inner: packed,
                    names,
                },
            ),
        }));
        Ok(())
    })
}

/// The number of chunks in a packed state.
#[no_mangle]
pub unsafe extern "C" fn fo_packed_num_entries(
    packed: *const fo_packed,
    out: *mut usize,
) -> fo_status {
    guard(|| {
        *arg_mut(out, "out")? = enter(packed, "fo_packed_num_entries")?
            .inner
            .plan
            .chunks
            .len();
        Ok(())
    })
}

/// Chunk `index` of a packed state.
#[no_mangle]
pub unsafe extern "C" fn fo_packed_get_entry(
    packed: *const fo_packed,
    index: usize,
    out: *mut fo_packed_entry,
) -> fo_status {
    guard(|| {
        *arg_mut(out, "out")? = enter(packed, "fo_packed_get_entry")?.entry(index)?;
        Ok(())
    })
}

impl PackedNames {
    fn entry(&self, index: usize) -> Result<fo_packed_entry> {
        let data = self.inner.chunk_data(index)?;
        let c = &self.inner.plan.chunks[index];
        Ok(fo_packed_entry {
            name: self.names[index].0.as_ptr(),
            key: self.names[index].1.as_ptr(),
            dtype: c.dtype.code(),
            ndim: c.shape.len() as i32,
            shape: dims(&c.shape),
            global_shape: dims(&c.global_shape),
            global_offset: dims(&c.global_offset),
            data: data.as_ptr() as *const c_void,
            nbytes: data.len() as u64,
        })
    }
}

/// The metadata fo stores with the packed state (mode, `param_groups`, per-key mesh and
/// placements) as JSON, into `buf` (`capacity` bytes); `*out_len` is the size needed.
#[no_mangle]
pub unsafe extern "C" fn fo_packed_metadata_json(
    packed: *const fo_packed,
    buf: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> fo_status {
    guard(|| {
        write_string(
            &enter(packed, "fo_packed_metadata_json")?
                .inner
                .metadata_json()
                .to_string(),
            buf,
            capacity,
            out_len,
        )
    })
}

/// Writes a packed state as this rank's file in `dir` (atomic: temp file, fsync, rename).
#[no_mangle]
pub unsafe extern "C" fn fo_packed_save(packed: *const fo_packed, dir: *const c_char) -> fo_status {
    guard(|| {
        let packed = enter(packed, "fo_packed_save")?;
        ckpt::save_rank(arg_path(dir, "dir")?, &packed.inner)
    })
}

/// Frees a packed state (NULL is a no-op); waits for a call in progress on another
/// thread, as `fo_optimizer_destroy` does.
#[no_mangle]
pub unsafe extern "C" fn fo_packed_destroy(packed: *mut fo_packed) {
    guard_void(|| destroy(packed, "fo_packed_destroy"))
}

/// Packs and writes this rank's file in one pass, one entry at a time (peak extra
/// memory: the largest entry).
#[no_mangle]
pub unsafe extern "C" fn fo_state_save(
    opt: *const fo_optimizer,
    dir: *const c_char,
    options: *const fo_pack_options,
) -> fo_status {
    guard(|| {
        let opt = enter_opt(opt, "fo_state_save")?;
        let dir = arg_path(dir, "dir")?;
        ckpt::save_optimizer(&opt, dir, &arg_ref(options, "options")?.to_options()?)
    })
}

/// `fo_state_save` through a communicator (its rank and world size must be the
/// options'): the ranks agree on the save id (rank 0's, generated when NULL), each
/// stages its file, and rank 0 commits once every rank reported success. Returns OK on
/// every rank only once the checkpoint is committed; on failure every rank returns the
/// first failing rank's error and the previous checkpoint stays the visible one.
#[no_mangle]
pub unsafe extern "C" fn fo_state_save_comm(
    opt: *const fo_optimizer,
    dir: *const c_char,
    options: *const fo_pack_options,
    comm: *const super::comm::fo_comm,
) -> fo_status {
    guard(|| {
        let comm = enter(comm, "fo_state_save_comm")?;
        // Every local check feeds the ranks' agreement, so a bad argument on one rank
        // is every rank's error instead of the others' timeout.
        let (held, busy) = match enter_opt(opt, "fo_state_save_comm") {
            Ok(g) => (Some(g), None),
            Err(e) => (None, Some(e)),
        };
        let local = (|| {
            if let Some(e) = busy {
                return Err(e);
            }
            let opt = &**held.as_ref().expect("entered");
            let o = arg_ref(options, "options")?.to_options()?;
            Ok((opt, arg_path(dir, "dir")?, o))
        })();
        ckpt::save::collective::save_optimizer_comm_checked(&comm, local).map(|_| ())
    })
}

/// How to load. `strict` (default 1): missing or unexpected keys are an error; 0: they
/// are skipped and reported. `params`: 1 also loads params saved under their FQN.
/// `param_groups` (default 1): restores each group's saved hyper-parameters. Each field
/// is 0 or 1; other values are FO_ERR_INVALID_ARGUMENT.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fo_load_options {
    pub strict: i32,
    pub params: i32,
    pub param_groups: i32,
}

/// What a load did. Counts always; when `json` is not NULL and `json_capacity` is large
/// enough, the key names as JSON `{"loaded":[..],"missing":[..],"unexpected":[..],
/// "requantized":[..]}` (`json_len`: the size needed, NUL included).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct fo_load_report {
    pub loaded: i64,
    pub missing: i64,
    pub unexpected: i64,
    pub requantized: i64,
    pub json: *mut c_char,
    pub json_capacity: usize,
    pub json_len: usize,
}

/// Loads checkpoint `dir` (any sharding, fo's or PyTorch DCP HuggingFace files) into the
/// optimizer, resharded to its params' specs. `options` NULL: defaults. `report` may be
/// NULL. On error the optimizer is unchanged.
#[no_mangle]
pub unsafe extern "C" fn fo_state_load(
    opt: *mut fo_optimizer,
    dir: *const c_char,
    options: *const fo_load_options,
    report: *mut fo_load_report,
) -> fo_status {
    guard(|| {
        let o = match options.as_ref() {
            None => LoadOptions::default(),
            Some(o) => LoadOptions {
                strict: arg_flag(o.strict, "options.strict")?,
                params: arg_flag(o.params, "options.params")?,
                param_groups: arg_flag(o.param_groups, "options.param_groups")?,
            },
        };
        let mut opt = enter_opt(opt, "fo_state_load")?;
        let r = ckpt::load(&mut opt, arg_path(dir, "dir")?, &o)?;
        if let Some(out) = report.as_mut() {
            (out.loaded, out.missing, out.unexpected, out.requantized) = (
                r.loaded.len() as i64,
                r.missing.len() as i64,
                r.unexpected.len() as i64,
                r.requantized.len() as i64,
            );
            let json = r.to_json().to_string();
            out.json_len = json.len() + 1;
            if !out.json.is_null() && out.json_capacity > json.len() {
                write_string(&json, out.json, out.json_capacity, &mut out.json_len)?;
            }
        }
        Ok(())
    })
}

/// Writes every key's full tensor into `out_dir/model-00001-of-00001.safetensors` plus
/// `model.safetensors.index.json` (integer and 0-dim tensors kept exactly).
#[no_mangle]
pub unsafe extern "C" fn fo_checkpoint_consolidate(
    dir: *const c_char,
    out_dir: *const c_char,
) -> fo_status {
    guard(|| {
        ckpt::consolidate(
            arg_path(dir, "dir")?,
            arg_path(out_dir, "out_dir")?,
            &mut |_, _| {},
        )?;
        Ok(())
    })
}

/// Checks every checksum and that every global element of every key is saved exactly once.
#[no_mangle]
pub unsafe extern "C" fn fo_checkpoint_verify(dir: *const c_char) -> fo_status {
    guard(|| {
        ckpt::verify(arg_path(dir, "dir")?, &mut |_, _| {})?;
        Ok(())
    })
}
