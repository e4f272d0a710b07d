//! What the fuzz targets run, kept out of the targets so the integrator can re-point them
//! at new parse entry points in one place. Every function must return (Ok or Err) for any
//! input: a panic, an abort or a hang is the bug the fuzzer reports.
use std::fs::File;
use std::path::{Path, PathBuf};

use fo::ckpt::{parse_sharding_info, read_header, FoMeta};
use fo::ckpt::naming::shard_file_name;
use fo::ckpt::{consolidate, load, verify, LoadOptions};
use fo::optim::{Algorithm, OptimConfig, Optimizer, StateFormat};
use fo::{DType, TensorView};

/// A per-process scratch directory (the fuzzer runs one input at a time per process).
pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fo-fuzz-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The header parsers on `bytes` taken as a whole safetensors file: the safetensors header,
/// then fo's metadata (`__metadata__["fo"]`) and DCP's sharding info when present.
pub fn parse_all(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
    let file = File::open(path).unwrap();
    let Ok(h) = read_header(path, &file) else { return };
    if let Some(s) = h.metadata.get("fo") {
        let _ = serde_json::from_str::<FoMeta>(s);
    }
    if let Some(s) = h.metadata.get("DCP_SHARDING_INFO") {
        let _ = parse_sharding_info(path, s);
    }
}

/// The parameters the seed corpus was saved from (fuzz/make_corpus.py): same FQNs and
/// shapes, so a well-formed input loads and every reader path past the checks is reached.
pub const PARAMS: [(&str, &[usize]); 2] = [("w", &[4, 3]), ("b", &[5])];

/// An optimizer with `PARAMS` (f32, quant8 state, no error bits, as the seeds were saved). The memory
/// is leaked: the optimizer borrows it for the whole fuzzing process.
pub fn fixture_optimizer() -> Optimizer {
    let mut cfg = OptimConfig::default_for(Algorithm::AdamW);
    cfg.master_weight_bits = 0; // f32 params hold their own master
    assert_eq!(cfg.state_format, StateFormat::Quant8);
    let mut opt = Optimizer::new(cfg).unwrap();
    for (fqn, shape) in PARAMS {
        let n: usize = shape.iter().product();
        let mem: &'static mut [f32] = Box::leak(vec![0.5f32; n].into_boxed_slice());
        let shape_i: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        // SAFETY: `mem` is leaked, so it outlives the optimizer.
        unsafe {
            let t = TensorView::host(mem.as_mut_ptr() as *mut u8, DType::F32, &shape_i, None, fqn).unwrap();
            opt.add_param(fqn, t, None, 0).unwrap();
        }
    }
    opt
}

/// `bytes` as rank 0's file of a one-rank checkpoint, through every reader: verify, a
/// strict load, a lenient load, and consolidate.
pub fn load_all(dir: &Path, out: &Path, opt: &mut Optimizer, bytes: &[u8]) {
    std::fs::write(dir.join(shard_file_name(0)), bytes).unwrap();
    let _ = verify(dir, &mut |_, _| {});
    let _ = load(opt, dir, &LoadOptions::default());
    let _ = load(opt, dir, &LoadOptions { strict: false, ..LoadOptions::default() });
    let _ = std::fs::remove_dir_all(out);
    let _ = consolidate(dir, out, &mut |_, _| {});
}
