//! `fo bench step --only arith`: the exact vs fast table runs end to end on a small size,
//! reports every algorithm in both modes next to the compressed-step ceiling, says why
//! torch is missing when the python given cannot run, and names a bad `--arithmetic`.
use std::process::Command;

fn fo(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fo"))
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn arith_table_reports_exact_and_fast_for_every_algorithm() {
    let (ok, text) = fo(&[
        "bench",
        "step",
        "--only",
        "arith",
        "--sizes",
        "64K",
        "--iters",
        "2",
        "--torch",
        "/nonexistent/python",
    ]);
    assert!(ok, "{text}");
    for row in [
        "ceiling12 (no math)",
        "fo fp32 AdamW",
        "AdamW exact",
        "AdamW fast",
        "Adam fast",
        "Lion exact",
        "Lion fast",
        "SGD momentum 0.9 exact",
        "SGD momentum 0.9 fast",
    ] {
        assert!(text.contains(row), "missing {row:?} in\n{text}");
    }
    assert!(
        text.contains("torch: cannot run /nonexistent/python"),
        "{text}"
    );
    assert!(text.contains("threads 1"), "{text}");
}

#[test]
fn bad_arithmetic_is_named() {
    let (ok, text) = fo(&[
        "bench",
        "step",
        "--only",
        "arith",
        "--sizes",
        "64K",
        "--arithmetic",
        "quick",
    ]);
    assert!(!ok);
    assert!(text.contains("arithmetic"), "{text}");
}
