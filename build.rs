//! Generates the C header from the `ffi` module into `$OUT_DIR/fo.h`. The committed
//! `include/fo.h` must equal it: `tests/header.rs` fails otherwise, and
//! `FO_BLESS=1 cargo test --test header` rewrites it.
use std::path::PathBuf;

fn main() {
    let crate_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("fo.h");
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    // A SONAME lets consumers record `libfo.so` (not a build path) as their dependency.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libfo.so");
    let config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    match cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
    {
        Ok(bindings) => {
            bindings.write_to_file(&out);
        }
        Err(e) => panic!("cbindgen failed to generate fo.h: {e}"),
    }
}
