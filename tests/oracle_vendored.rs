//! `tests/oracle/` must stay a byte-for-byte copy of `../shared/oracle/` (when present).
use std::path::{Path, PathBuf};

fn files(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(root).unwrap().to_path_buf());
            }
        }
    }
    out.sort();
    out
}

#[test]
fn vendored_oracle_equals_shared_oracle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let vendored = root.join("tests/oracle");
    let shared = root.join("../shared/oracle");
    assert!(
        vendored.join("shard_cases.json").exists(),
        "tests/oracle is missing"
    );
    if !shared.exists() {
        eprintln!("../shared/oracle not present: nothing to compare against");
        return;
    }
    let (a, b) = (files(&vendored), files(&shared));
    assert_eq!(
        a, b,
        "tests/oracle and ../shared/oracle hold different file lists"
    );
    for f in &a {
        let (x, y) = (
            std::fs::read(vendored.join(f)).unwrap(),
            std::fs::read(shared.join(f)).unwrap(),
        );
        assert!(
            x == y,
            "tests/oracle/{} differs from ../shared/oracle/{}",
            f.display(),
            f.display()
        );
    }
}
