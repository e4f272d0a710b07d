//! `fo selftest`: without a GPU (this build without feature `cuda`, or no libcuda, or no
//! device) it says why and exits 0; on a GPU machine it must find 0 mismatching elements.
use std::process::Command;

#[test]
fn selftest_says_why_without_a_gpu_and_exits_0() {
    let out = Command::new(env!("CARGO_BIN_EXE_fo"))
        .args(["selftest", "--size", "4K", "--iters", "1"])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    if !stdout.contains("no GPU to test") {
        // A GPU machine: the comparison ran.
        assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
        assert!(stdout.contains(": 0 mismatching elements"), "{stdout}");
        return;
    }
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(
        stdout.starts_with("fo selftest: no GPU to test: "),
        "{stdout}"
    );
    assert!(
        stdout.trim_end().ends_with("Nothing compared (exit 0)."),
        "{stdout}"
    );
    #[cfg(not(feature = "cuda"))]
    assert!(
        stdout.contains("built without GPU support (rebuild with `--features cuda`)"),
        "{stdout}"
    );
    #[cfg(feature = "cuda")]
    assert!(
        stdout.contains("libcuda") || stdout.contains("cuInit") || stdout.contains("no device"),
        "{stdout}"
    );
    assert!(stderr.is_empty(), "{stderr}");
}

#[test]
fn selftest_refuses_bad_arguments_as_usage_errors() {
    let out = Command::new(env!("CARGO_BIN_EXE_fo"))
        .args(["selftest", "--size", "lots"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
