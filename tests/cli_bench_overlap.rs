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
    report_every_case(&[]);
}

#[test]
fn bench_overlap_reports_every_case_with_fp32_state() {
    let s = report_every_case(&["--state-format", "fp32"]);
    assert!(s.contains("AdamW, fp32 state"), "{s}");
}

#[test]
fn bench_overlap_with_a_devices_backward_gives_fo_every_core_and_waits() {
    let s = report_every_case(&["--backward", "device", "--backward-share", "0.5"]);
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    assert!(s.contains(&format!("fo's pool {cores} thread(s)")), "{s}");
    assert!(
        s.contains("ms wait per layer on the calling thread (a device's)"),
        "{s}"
    );
    assert!(s.contains("calibrated to 0.50 x the step's"), "{s}");
}

#[test]
fn bench_overlap_with_a_hosts_backward_leaves_a_core_to_it() {
    let s = report_every_case(&["--backward-share", "2"]);
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let pool = cores.saturating_sub(1).max(1);
    assert!(s.contains(&format!("fo's pool {pool} thread(s)")), "{s}");
    assert!(s.contains("sweeps/layer (calibrated to 2.00 x"), "{s}");
}

#[test]
fn bench_overlap_with_a_launch_bound_backward_keeps_the_calling_thread_busy() {
    let s = report_every_case(&["--backward", "launch", "--backward-share", "0.5"]);
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    assert!(s.contains(&format!("fo's pool {cores} thread(s)")), "{s}");
    assert!(
        s.contains("ms of arithmetic per layer on the calling thread (a launch-bound device's)"),
        "{s}"
    );
}

#[test]
fn bench_overlap_backward_ms_sets_backwards_length_whatever_the_pool() {
    for pool in ["1", "2"] {
        let s = report_every_case(&["--backward", "launch", "--pool", pool, "--backward-ms", "4"]);
        // 16 layers: 0.25 ms each.
        assert!(
            s.contains("backward: 0.25 ms of arithmetic per layer"),
            "{pool}: {s}"
        );
    }
}

#[test]
fn bench_overlap_pool_sets_fos_threads_whatever_the_backward() {
    for backward in ["host", "device", "launch"] {
        let s = report_every_case(&["--backward", backward, "--pool", "3"]);
        assert!(s.contains("fo's pool 3 thread(s)"), "{backward}: {s}");
    }
}

/// Runs a tiny benchmark with `extra` flags, checks its report and returns it.
fn report_every_case(extra: &[&str]) -> String {
    let mut args = vec!["--layers", "16", "--layer-size", "4K", "--rounds", "2"];
    args.extend_from_slice(extra);
    let out = fo(&args);
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
    // Each case's overlapped iteration as a ratio to its sequential one.
    assert_eq!(s.matches("] the sequential iter").count(), 3, "{s}");
    // Clipping that triggers rolls back every early step; the others roll back none.
    // How many step early under a triggering clip depends on timing: once the norms that
    // have arrived make the clip certain, later gradients wait for step_end instead.
    let counts: Vec<(u64, u64, u64)> = s
        .lines()
        .filter(|l| l.contains("stepped early"))
        .map(|l| {
            let n = |after: &str| -> u64 {
                let at = l.find(after).unwrap_or_else(|| panic!("{after} in {l}"));
                let rest = l[..at].trim_end();
                rest[rest.rfind(' ').map_or(0, |k| k + 1)..]
                    .parse()
                    .unwrap()
            };
            (n(" params stepped early"), n(" at step_end"), n(" params,"))
        })
        .collect();
    assert_eq!(counts.len(), 3, "{s}");
    for (k, &(early, at_end, rolled)) in counts.iter().enumerate() {
        assert_eq!(early + at_end, 16, "{s}");
        let triggering = k == 2;
        assert_eq!(rolled, if triggering { early } else { 0 }, "{s}");
        if !triggering {
            assert_eq!(early, 16, "nothing defers without a clip that scales: {s}");
        }
    }
    s.into_owned()
}

#[test]
fn bench_overlap_refuses_out_of_range_flags() {
    for (args, needle) in [
        (&["--layers", "8"][..], "--layers"),
        (&["--layer-size", "100"][..], "--layer-size"),
        (&["--rounds", "0"][..], "--rounds"),
        (&["--state-format", "fp16"][..], "--state-format"),
        (&["--backward", "gpu"][..], "--backward"),
        (&["--backward-share", "0.01"][..], "--backward-share"),
        (&["--backward-share", "x"][..], "--backward-share"),
        (&["--pool", "1025"][..], "--pool"),
        (&["--backward-ms", "0"][..], "--backward-ms"),
        (
            &["--backward-ms", "2", "--backward-share", "1"][..],
            "--backward-ms",
        ),
    ] {
        let out = fo(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(needle),
            "{args:?}: {err}"
        );
    }
}
