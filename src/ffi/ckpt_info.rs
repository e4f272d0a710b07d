//! `fo_checkpoint_info_json`: a checkpoint's logical keys and param groups, for readers
//! outside the library (Python's torch layout, checkpoint tools) that must not parse
//! safetensors headers or know fo's key suffixes themselves.
use std::ffi::c_char;
use std::path::Path;

use super::args::arg_str;
use super::optim::write_string;
use super::status::{fo_status, guard};

/// The table of contents of checkpoint `dir` (fo's or PyTorch DCP HuggingFace files,
/// validated as `fo_state_load` validates them) as JSON into `buf` (`capacity` bytes;
/// `*out_len` is always the size needed, NUL included; when it exceeds `capacity` nothing
/// is written and FO_ERR_INVALID_ARGUMENT is returned): `{"mode", "param_groups"` (null in
/// files fo did not write), `"keys": {key: {"dtype", "shape", "compressed"}}}`. A quant8
/// pair `K::quantized` + `K::scales` is listed as the one key `K`, `compressed` true,
/// dtype `"F32"` (what it decodes to), shape the global shape.
#[no_mangle]
pub unsafe extern "C" fn fo_checkpoint_info_json(
    dir: *const c_char,
    buf: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> fo_status {
    guard(|| {
        let s = crate::ckpt::info_json(Path::new(arg_str(dir, "dir")?))?;
        write_string(&s, buf, capacity, out_len)
    })
}
