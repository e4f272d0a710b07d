//! The safetensors header parser and fo's metadata parsers on arbitrary file contents.
#![no_main]
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

static PATH: OnceLock<std::path::PathBuf> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let path = PATH.get_or_init(|| fo_fuzz::scratch("header").join("input.safetensors"));
    fo_fuzz::parse_all(path, data);
});
