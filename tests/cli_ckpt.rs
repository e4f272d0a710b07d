//! `fo ckpt inspect|verify|consolidate` on torch's checkpoint and on a broken copy.
use std::path::Path;
use std::process::Command;

fn fo(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fo"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn oracle() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/oracle/ckpt_fsdp_tp_2x2/sharded")
        .display()
        .to_string()
}

#[test]
fn inspect_lists_keys_with_dtype_shape_and_chunks() {
    let (ok, out, err) = fo(&["ckpt", "inspect", &oracle()]);
    assert!(ok, "{err}");
    assert!(out.contains("PyTorch DCP HuggingFace files"), "{out}");
    let line = out
        .lines()
        .find(|l| l.starts_with("mixer.weight "))
        .unwrap();
    assert!(line.contains("BF16") && line.contains("[4, 4]"), "{line}");
    assert!(out.contains("48 keys") && out.contains("portable"), "{out}");
}

#[test]
fn verify_and_consolidate_succeed_and_fail_clearly() {
    let (ok, out, err) = fo(&["ckpt", "verify", &oracle()]);
    assert!(
        ok && out.contains("every element saved exactly once"),
        "{out}{err}"
    );
    let tmp = std::env::temp_dir().join(format!("fo-cli-ckpt-{}", std::process::id()));
    let (ok, out, err) = fo(&[
        "ckpt",
        "consolidate",
        &oracle(),
        tmp.join("full").to_str().unwrap(),
    ]);
    assert!(ok && out.contains("48 keys"), "{out}{err}");
    // A checkpoint with a shard file missing: coverage fails, naming the file.
    std::fs::create_dir_all(tmp.join("broken")).unwrap();
    for r in [1, 2, 4] {
        let f = format!("shard-{r:05}-model-00001-of-00001.safetensors");
        std::fs::copy(Path::new(&oracle()).join(&f), tmp.join("broken").join(&f)).unwrap();
    }
    let (ok, _, err) = fo(&["ckpt", "verify", tmp.join("broken").to_str().unwrap()]);
    assert!(!ok && err.contains("shard-00003"), "{err}");
    let (ok, _, err) = fo(&["ckpt", "frobnicate"]);
    assert!(!ok && err.contains("Usage: fo ckpt"), "{err}");
    std::fs::remove_dir_all(&tmp).unwrap();
}
