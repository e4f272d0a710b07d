//! `fo bench overlap` (tiny sizes: this checks the report and the bounds, not the speed):
//! every case reports the sequential and overlapped iterations and the exposed step;
//! out-of-range flags are refused, naming the flag.
use std::process::{Command, Output};

fn fo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fo"))
        .args(["bench", "overlap"])
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn bench_overlap_reports_every_case() {
    let out = fo(&["--layers", "16", "--layer-size", "4K", "--rounds", "2"]);
    let (s, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{s}{err}");
    for case in ["no clipping:", "clip, not triggering:", "clip, triggering:"] {
        assert!(s.contains(case), "{s}");
    }
    assert_eq!(s.matches("exposed step").count(), 3, "{s}");
    assert_eq!(s.matches("overlapped iter").count(), 3, "{s}");
    // Clipping that triggers rolls back every early step; the others roll back none.
    assert!(s.contains("rolled back 16 params"), "{s}");
    assert_eq!(s.matches("rolled back 0 params").count(), 2, "{s}");
}

#[test]
fn bench_overlap_refuses_out_of_range_flags() {
    for (args, needle) in [
        (&["--layers", "8"][..], "--layers"),
        (&["--layer-size", "100"][..], "--layer-size"),
        (&["--rounds", "0"][..], "--rounds"),
    ] {
        let out = fo(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(needle),
            "{args:?}: {err}"
        );
    }
}
