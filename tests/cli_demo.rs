//! `fo demo` is the README's main job and checks itself: a short run must pass every
//! check, and bad flags must fail with the reason.
use std::process::Command;

#[test]
fn short_demo_passes_its_own_checks() {
    let dir = std::env::temp_dir().join(format!("fo-demo-test-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_fo"))
        .args([
            "demo", "--steps", "12", "--ranks", "3", "--seed", "7", "--out",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("all 8 checks passed"), "{stdout}");
    assert!(
        stdout.contains("[ok] overlapped step (clipping through step_end) follows the sequential run bit for bit")
            && stdout.contains("exposed step time (last gradient ready -> step done)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("restart on 3 ranks (same sharding) is identical"),
        "{stdout}"
    );
    // --out keeps the checkpoints: a compressed and a portable one, and the consolidation.
    for sub in ["compressed", "portable", "consolidated"] {
        assert!(dir.join(sub).is_dir(), "{sub} missing");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn rejects_flags_it_cannot_honour() {
    let out = Command::new(env!("CARGO_BIN_EXE_fo"))
        .args(["demo", "--ranks", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("'1'") && err.contains("--ranks") && err.contains("2..=64"),
        "{err}"
    );
    // Fewer steps than the loss needs to fall by the checked 10%: refused up front.
    let out = Command::new(env!("CARGO_BIN_EXE_fo"))
        .args(["demo", "--steps", "4"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--steps") && err.contains("12..="), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_fo"))
        .args(["demo", "--steps", "x"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--steps"));
}
