//! `fo ckpt convert`: offline resharding onto other world sizes and meshes, and format
//! changes, checked with `fo ckpt diff` (exact for resharding, within docs/checkpoints.md's
//! requantization bound for quant8), and DST is never left half written.
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use fo::ckpt::Checkpoint;
use fo::ShardSpec;

fn fo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fo"))
        .args(args)
        .output()
        .unwrap()
}

fn ok(args: &[&str]) -> String {
    let out = fo(args);
    let s = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{args:?}: {s}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    s
}

fn oracle(rel: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/oracle")
        .join(rel)
        .display()
        .to_string()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fo-cli-convert-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A small fo checkpoint pair (compressed and portable, 3 ranks) written by `fo demo`.
fn demo_checkpoints(root: &Path) -> (PathBuf, PathBuf) {
    ok(&[
        "demo",
        "--steps",
        "12",
        "--ranks",
        "3",
        "--seed",
        "7",
        "--out",
        s(root),
    ]);
    (root.join("compressed"), root.join("portable"))
}

#[test]
fn torch_checkpoint_resharded_4_to_3_to_4_ranks_and_onto_a_2x2_mesh_is_unchanged() {
    let t = tmp("torch");
    let src = oracle("ckpt_fsdp2_4ranks/sharded");
    let out = fo(&["ckpt", "convert", &src, s(&t.join("r3")), "--ranks", "3"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("(48 keys, 3 ranks"));
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every key is carried over, the 0-element `empty` [0, 4] included.
    assert!(ok(&["ckpt", "verify", s(&t.join("r3"))]).contains("48 keys"));
    let inspect = ok(&["ckpt", "inspect", s(&t.join("r3"))]);
    assert!(
        inspect.contains("fo checkpoint: 3 files") && inspect.contains("mesh [3] [S0]"),
        "{inspect}"
    );
    ok(&[
        "ckpt",
        "convert",
        s(&t.join("r3")),
        s(&t.join("r4")),
        "--ranks",
        "4",
    ]);
    ok(&[
        "ckpt",
        "convert",
        &src,
        s(&t.join("tp")),
        "--mesh",
        "2,2",
        "--placements",
        "S0,S1",
    ]);
    for dst in ["r3", "r4", "tp"] {
        let out = fo(&["ckpt", "diff", "--json", &src, s(&t.join(dst))]);
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let not_equal: Vec<_> = j["keys"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|k| k["status"] != "equal")
            .map(|k| k["key"].clone())
            .collect();
        assert!(not_equal.is_empty(), "{dst}: {not_equal:?}");
        assert_eq!(j["keys_compared"], 48, "{dst}");
    }
    // The reproducer: 4 -> 2 ranks kept all 48 keys (it lost `empty`).
    let out = ok(&["ckpt", "convert", &src, s(&t.join("r2")), "--ranks", "2"]);
    assert!(out.contains("48 keys"), "{out}");
    ok(&["ckpt", "diff", &src, s(&t.join("r2"))]);
    std::fs::remove_dir_all(&t).unwrap();
}

/// The largest |value| of `key` (for variance: of sqrt(value)), which bounds every
/// destination group's absmax a'.
fn absmax(ck: &Path, key: &str, sqrt: bool) -> f64 {
    let ck = Checkpoint::open(ck).unwrap();
    let shape = ck
        .keys
        .get(key)
        .or_else(|| ck.keys.get(&format!("{key}::quantized")))
        .unwrap()
        .global_shape
        .clone();
    let v = ck
        .read_f32(key, &ShardSpec::unsharded(shape).unwrap())
        .unwrap();
    v.iter()
        .map(|&x| {
            if sqrt {
                (x as f64).sqrt()
            } else {
                (x as f64).abs()
            }
        })
        .fold(0.0, f64::max)
}

/// Every moment of `b` lies within docs/checkpoints.md's requantization bound of `a`'s.
fn assert_within_requant_bound(a: &Path, b: &Path) -> usize {
    let out = fo(&["ckpt", "diff", "--json", s(a), s(b)]);
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut requantized = 0;
    for k in j["keys"].as_array().unwrap() {
        let key = k["key"].as_str().unwrap();
        let max_abs = k["max_abs"].as_f64().unwrap();
        if key.ends_with(".exp_avg") {
            let bound = absmax(a, key, false) * (1.0 / 127.0 + 2f64.powi(-10));
            assert!(max_abs <= bound, "{key}: {max_abs} > {bound}");
        } else if key.ends_with(".exp_avg_sq") {
            // |sqrt v' - sqrt v| <= e = a'(1/510 + 2^-10), so |v' - v| <= e (2 a' + e).
            let am = absmax(a, key, true);
            let e = am * (1.0 / 510.0 + 2f64.powi(-10));
            assert!(
                max_abs <= e * (2.0 * am + e),
                "{key}: {max_abs} > {}",
                e * (2.0 * am + e)
            );
        } else {
            assert_eq!(k["status"], "equal", "{key}");
            continue;
        }
        requantized += (max_abs > 0.0) as usize;
    }
    requantized
}

#[test]
fn fo_compressed_state_converts_to_portable_exactly_and_reshards_within_the_bound() {
    let t = tmp("fo");
    let (compressed, portable) = demo_checkpoints(&t.join("demo"));
    // compressed -> portable, same ranks: the dequantized values, bit for bit.
    let out = ok(&[
        "ckpt",
        "convert",
        s(&compressed),
        s(&t.join("p")),
        "--to",
        "portable",
    ]);
    assert!(out.contains("portable"), "{out}");
    assert!(ok(&["ckpt", "inspect", s(&t.join("p"))]).contains("state is portable"));
    ok(&["ckpt", "diff", s(&compressed), s(&t.join("p"))]);
    ok(&["ckpt", "diff", s(&portable), s(&t.join("p"))]);
    // compressed 3 -> 2 ranks stays compressed, requantized in the new groups, and says
    // which keys were requantized and why (it used to say nothing).
    let out = fo(&[
        "ckpt",
        "convert",
        s(&compressed),
        s(&t.join("c2")),
        "--ranks",
        "2",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("note: ")
            && err.contains("requantized")
            && err.contains("groups of 32")
            && err.contains(".exp_avg"),
        "{err}"
    );
    assert!(ok(&["ckpt", "inspect", s(&t.join("c2"))]).contains("state is compressed"));
    ok(&["ckpt", "verify", s(&t.join("c2"))]);
    assert!(assert_within_requant_bound(&compressed, &t.join("c2")) > 0);
    // Same ranks and layout: codes and scales are copied, so nothing changes at all.
    ok(&[
        "ckpt",
        "convert",
        s(&compressed),
        s(&t.join("c3")),
        "--ranks",
        "3",
    ]);
    ok(&["ckpt", "diff", s(&compressed), s(&t.join("c3"))]);
    let out = fo(&[
        "ckpt",
        "convert",
        s(&compressed),
        s(&t.join("c3b")),
        "--ranks",
        "3",
    ]);
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // portable -> compressed: quantized afresh, within the same bound.
    ok(&[
        "ckpt",
        "convert",
        s(&portable),
        s(&t.join("q")),
        "--to",
        "compressed",
        "--ranks",
        "2",
    ]);
    assert!(ok(&["ckpt", "inspect", s(&t.join("q"))]).contains("state is compressed"));
    assert!(assert_within_requant_bound(&portable, &t.join("q")) > 0);
    // A converted checkpoint consolidates into FlashOptim's unsharded layout (requantized
    // in groups of the full tensor), which diff reads through its own scales.
    let out = fo(&["ckpt", "consolidate", s(&t.join("c2")), s(&t.join("full"))]);
    assert_eq!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("requantized") && err.contains(".exp_avg_sq"),
        "{err}"
    );
    // The consolidated output opens everywhere a checkpoint is read, as a directory or
    // as its one file, and converts back onto ranks.
    assert!(ok(&["ckpt", "inspect", s(&t.join("full"))]).contains("consolidated checkpoint"));
    ok(&["ckpt", "verify", s(&t.join("full"))]);
    let file = t.join("full/model-00001-of-00001.safetensors");
    ok(&["ckpt", "verify", s(&file)]);
    ok(&[
        "ckpt",
        "convert",
        s(&file),
        s(&t.join("back")),
        "--ranks",
        "2",
    ]);
    assert_within_requant_bound(&t.join("full"), &t.join("back"));
    assert!(assert_within_requant_bound(&t.join("c2"), &t.join("full")) > 0);
    std::fs::remove_dir_all(&t).unwrap();
}

#[test]
fn dst_is_never_left_half_written() {
    let t = tmp("atomic");
    let src = oracle("ckpt_fsdp2_4ranks/sharded");
    let dst = t.join("dst");
    ok(&["ckpt", "convert", &src, s(&dst), "--ranks", "2"]);
    let out = fo(&["ckpt", "convert", &src, s(&dst), "--ranks", "3"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--force"));
    // A source whose data is corrupt fails mid-way: the old DST stays, nothing is left over.
    let bad = t.join("bad");
    ok(&["ckpt", "convert", &src, s(&bad), "--ranks", "2"]);
    let f1 = bad.join("shard-00002-model-00001-of-00001.safetensors");
    let f = File::options().read(true).write(true).open(&f1).unwrap();
    let len = f.metadata().unwrap().len();
    let mut b = [0u8];
    f.read_exact_at(&mut b, len - 1).unwrap();
    f.write_all_at(&[b[0] ^ 0xff], len - 1).unwrap();
    let out = fo(&[
        "ckpt",
        "convert",
        s(&bad),
        s(&dst),
        "--ranks",
        "3",
        "--force",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("checksum"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(ok(&["ckpt", "inspect", s(&dst)]).contains("2 files"));
    let left: Vec<_> = std::fs::read_dir(&t)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");
    // --force replaces a good DST.
    ok(&["ckpt", "convert", &src, s(&dst), "--ranks", "3", "--force"]);
    assert!(ok(&["ckpt", "inspect", s(&dst)]).contains("3 files"));
    // Usage errors.
    let out = fo(&[
        "ckpt",
        "convert",
        &src,
        s(&t.join("x")),
        "--ranks",
        "3",
        "--mesh",
        "2,2",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let out = fo(&["ckpt", "convert", &src, s(&t.join("x")), "--to", "fp8"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(!t.join("x").exists());
    std::fs::remove_dir_all(&t).unwrap();
}
