//! `fo ckpt diff`: torch's sharded checkpoints equal their full file whatever the layout,
//! torch's own consolidation is caught losing values, a perturbed element is found and
//! counted against the tolerances, and `--json` carries the same verdict.
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fo"))
        .args(args)
        .output()
        .unwrap()
}

fn oracle(rel: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/oracle")
        .join(rel)
        .display()
        .to_string()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fo-cli-diff-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn torch_sharded_checkpoints_equal_their_full_file() {
    for layout in ["ckpt_fsdp2_4ranks", "ckpt_fsdp_tp_2x2"] {
        let out = fo(&[
            "ckpt",
            "diff",
            &oracle(&format!("{layout}/sharded")),
            &oracle(&format!("{layout}/full.safetensors")),
        ]);
        let s = text(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{layout}: {s}{}",
            text(&out.stderr)
        );
        assert!(s.contains("48 keys: 48 equal"), "{s}");
        let row = s.lines().find(|l| l.starts_with("mixer.weight ")).unwrap();
        assert!(row.contains("equal") && row.contains("0/16"), "{row}");
    }
    // Slabs of 5 elements: a [4, 4] key is read as rows [0,2) and [2,4), each side
    // through its own layout; still equal (and an off-by-one row offset would not be).
    let out = fo(&[
        "ckpt",
        "diff",
        "--slab-elems",
        "5",
        &oracle("ckpt_fsdp_tp_2x2/sharded"),
        &oracle("ckpt_fsdp_tp_2x2/full.safetensors"),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    // Two different shardings of the same save are compared element by element too.
    let out = fo(&[
        "ckpt",
        "diff",
        &oracle("ckpt_fsdp2_4ranks/sharded"),
        &oracle("ckpt_fsdp_tp_2x2/sharded"),
    ]);
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn torch_consolidation_is_caught_dropping_integers_and_zeroing_scalars() {
    let out = fo(&[
        "ckpt",
        "diff",
        &oracle("ckpt_fsdp_tp_2x2/sharded"),
        &oracle("ckpt_fsdp_tp_2x2/consolidated"),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let s = text(&out.stdout);
    let missing = s
        .lines()
        .find(|l| l.starts_with("bn.num_batches_tracked "))
        .unwrap();
    assert!(
        missing.contains("missing") && missing.contains("only in"),
        "{missing}"
    );
    let step = s
        .lines()
        .find(|l| l.starts_with("state.fc1.weight.step "))
        .unwrap();
    assert!(step.contains("differs") && step.contains("1/1"), "{step}");
    // The summary goes with the report, to stdout, equal or not; stderr stays empty.
    assert!(s.contains("12 differ or are missing"), "{s}");
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));

    let out = fo(&[
        "ckpt",
        "diff",
        "--json",
        &oracle("ckpt_fsdp_tp_2x2/sharded"),
        &oracle("ckpt_fsdp_tp_2x2/consolidated"),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["keys_differing"], 12);
    assert_eq!(j["equal"], false);
    let keys = j["keys"].as_array().unwrap();
    let k = keys
        .iter()
        .find(|k| k["key"] == "bn.num_batches_tracked")
        .unwrap();
    assert_eq!(k["status"], "missing");
    let k = keys
        .iter()
        .find(|k| k["key"] == "state.fc1.weight.step")
        .unwrap();
    assert_eq!(
        (k["status"].as_str(), k["max_abs"].as_f64(), &k["max_rel"]),
        (Some("differs"), Some(3.0), &serde_json::Value::Null)
    );
}

#[test]
fn one_perturbed_element_is_counted_against_the_tolerances() {
    let dir = tmp("perturbed");
    let full = dir.join("full.safetensors");
    std::fs::copy(oracle("ckpt_fsdp2_4ranks/full.safetensors"), &full).unwrap();
    let f = File::options().read(true).write(true).open(&full).unwrap();
    let h = fo::ckpt::read_header(&full, &f).unwrap();
    let e = h
        .tensors
        .iter()
        .find(|t| t.name == "bn.running_var")
        .unwrap();
    let at = h.data_start + e.start + 3 * 4;
    let mut b = [0u8; 4];
    f.read_exact_at(&mut b, at).unwrap();
    let x = f32::from_le_bytes(b);
    f.write_all_at(&(x + 1e-3).to_le_bytes(), at).unwrap();
    drop(f);
    let (a, b) = (
        oracle("ckpt_fsdp2_4ranks/sharded"),
        full.display().to_string(),
    );

    let out = fo(&["ckpt", "diff", &a, &b]);
    assert_eq!(out.status.code(), Some(1));
    let s = text(&out.stdout);
    let row = s
        .lines()
        .find(|l| l.starts_with("bn.running_var "))
        .unwrap();
    assert!(row.contains("differs") && row.contains("1/7"), "{row}");
    assert!(s.contains("47 equal") && s.contains("1 differ"), "{s}");
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));

    let out = fo(&["ckpt", "diff", "--json", "--atol", "2e-3", &a, &b]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let k = j["keys"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["key"] == "bn.running_var")
        .unwrap();
    assert_eq!(k["status"], "within");
    let max_abs = k["max_abs"].as_f64().unwrap();
    assert!((max_abs - 1e-3).abs() < 1e-4, "{max_abs}");
    assert_eq!(j["equal"], true);
    // A relative tolerance alone: |x| is about 1, so rtol 1e-2 covers the 1e-3 change.
    let out = fo(&["ckpt", "diff", "--rtol", "1e-2", &a, &b]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    assert!(text(&out.stdout).contains("1 within tolerance"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unreadable_inputs_and_bad_tolerances_are_errors_not_differences() {
    let out = fo(&[
        "ckpt",
        "diff",
        "/nonexistent/a",
        &oracle("ckpt_fsdp2_4ranks/sharded"),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("/nonexistent/a"),
        "{}",
        text(&out.stderr)
    );
    let out = fo(&["ckpt", "diff", "--atol", "x", "a", "b"]);
    assert_eq!(out.status.code(), Some(2));
    let out = fo(&[
        "ckpt",
        "diff",
        "--atol=-1",
        &oracle("ckpt_fsdp2_4ranks/sharded"),
        &oracle("ckpt_fsdp2_4ranks/sharded"),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("must be a finite number >= 0"),
        "{}",
        text(&out.stderr)
    );
    // `--rtol -1` (no `=`): refused for its value, not taken for a flag.
    for bad in ["-1", "nan", "inf"] {
        let out = fo(&["ckpt", "diff", "--rtol", bad, "a", "b"]);
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let err = text(&out.stderr);
        assert!(
            err.contains("--rtol") && err.contains(">= 0") && !err.contains("'-- "),
            "{bad}: {err}"
        );
    }
}
