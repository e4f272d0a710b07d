//! `fo bench ckpt` (tiny sizes: this checks the report, not the speed): fo and the plain
//! baseline measured in the same interleaved rounds, medians, cold reads; the
//! directory is cleaned up. Progress bars never reach a non-terminal stderr.
use std::process::Command;

#[test]
fn bench_ckpt_reports_medians_of_interleaved_rounds_against_the_baseline() {
    let dir = std::env::temp_dir().join(format!("fo-cli-bench-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_fo"))
        .args([
            "bench",
            "ckpt",
            "--size-mib",
            "2",
            "--ranks",
            "3",
            "--rounds",
            "2",
            "--dir",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    let (s, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{s}{err}");
    assert!(
        s.contains("medians of 2 interleaved rounds; reads cold"),
        "{s}"
    );
    for prefix in ["save, 3 ranks", "load, 3 ranks", "load resharded 3->2"] {
        let line = s
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("{prefix}: {s}"));
        assert!(
            line.contains(" fo ") && line.contains("plain") && line.contains("fo/plain"),
            "{line}"
        );
    }
    assert!(s.contains("checkpoint size: portable"), "{s}");
    // stderr: only the one-line description, no progress bar drawn into a pipe.
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(!dir.exists());
    let out = Command::new(env!("CARGO_BIN_EXE_fo"))
        .args(["bench", "ckpt", "--rounds", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn bench_ckpt_async_reports_the_call_against_a_sync_save_and_steps_in_flight() {
    let dir = std::env::temp_dir().join(format!("fo-cli-bench-async-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_fo"))
        .args([
            "bench",
            "ckpt",
            "--async",
            "--size-mib",
            "4",
            "--rounds",
            "2",
        ])
        .args(["--steps", "2", "--staging-mib", "1", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{s}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for prefix in [
        "save call returns",
        " 2 steps",
        "async save end to end",
        "staging high-water",
    ] {
        assert!(s.lines().any(|l| l.starts_with(prefix)), "{prefix}: {s}");
    }
    assert!(
        s.contains("call/sync") && s.contains("of a 1.0 MiB budget"),
        "{s}"
    );
    assert!(!dir.exists());
}

#[test]
fn long_commands_print_nothing_but_their_result_when_stderr_is_not_a_terminal() {
    let src = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/oracle/ckpt_fsdp_tp_2x2/sharded"
    );
    let full = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/oracle/ckpt_fsdp_tp_2x2/full.safetensors"
    );
    let tmp = std::env::temp_dir().join(format!("fo-cli-quiet-{}", std::process::id()));
    let t = tmp.to_str().unwrap();
    for quiet in [false, true] {
        let q: &[&str] = if quiet { &["--quiet"] } else { &[] };
        for args in [
            vec!["ckpt", "verify", src],
            vec!["ckpt", "diff", src, full],
            vec!["ckpt", "consolidate", src, t],
        ] {
            let out = Command::new(env!("CARGO_BIN_EXE_fo"))
                .args(q)
                .args(&args)
                .output()
                .unwrap();
            assert!(out.status.success(), "{args:?}");
            assert!(
                out.stderr.is_empty(),
                "{args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(!out.stdout.is_empty());
        }
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}
