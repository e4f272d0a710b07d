//! The command line's contract: per-command help with examples, --version, exit status 2
//! for any usage error (unknown flag, bad value, missing argument), shell completions.
use std::process::{Command, Output};

fn fo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fo"))
        .args(args)
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn every_command_has_its_own_help_with_examples() {
    for cmd in [
        &["shard"][..],
        &["demo"],
        &["ckpt", "inspect"],
        &["ckpt", "verify"],
        &["ckpt", "consolidate"],
        &["bench", "step"],
        &["bench", "broadcast"],
        &["bench", "ckpt"],
        &["bench", "clip"],
        &["selftest"],
        &["completions"],
    ] {
        let out = fo(&[cmd, &["--help"]].concat());
        let help = text(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{cmd:?}: {}", text(&out.stderr));
        assert!(
            help.contains(&format!("Usage: fo {}", cmd.join(" "))),
            "{cmd:?}: {help}"
        );
        let example = format!("  fo {}", cmd.join(" "));
        assert!(
            help.contains("Examples:") && help.contains(&example),
            "{cmd:?}: {help}"
        );
    }
    // `fo bench --help` is the bench's own help, not the whole usage.
    let help = text(&fo(&["bench", "--help"]).stdout);
    assert!(
        help.contains("Usage: fo bench") && help.contains("broadcast") && !help.contains("shard"),
        "{help}"
    );
    let help = text(&fo(&["bench", "step", "--help"]).stdout);
    assert!(
        help.contains("--sizes") && help.contains("--only") && !help.contains("--size-mib"),
        "{help}"
    );
}

#[test]
fn version_is_the_crate_version() {
    let out = fo(&["--version"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        text(&out.stdout).trim(),
        format!("fo {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn usage_errors_exit_2_and_name_the_problem() {
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "shard",
                "--shape",
                "10",
                "--mesh",
                "2",
                "--placements",
                "S0",
                "--bogus",
            ],
            "--bogus",
        ),
        (&["shard", "--shape", "10", "--mesh", "2"], "--placements"),
        (
            &[
                "shard",
                "--shape",
                "10,x",
                "--mesh",
                "2",
                "--placements",
                "S0",
            ],
            "\"x\"",
        ),
        (&["demo", "--steps", "x"], "--steps"),
        (&["demo", "--keep=yes"], "--keep"),
        (&["bench", "step", "--only", "fp64"], "fp64"),
        (&["bench", "step", "--sizes", "16Q"], "16Q"),
        (&["bench", "ckpt", "--size-mib", "-1"], "-1"),
        (&["bench", "frobnicate"], "frobnicate"),
        (&["ckpt", "verify"], "<DIR>"),
        (&["ckpt", "consolidate", "a", "b", "c"], "'c'"),
        (&["completions", "tcsh"], "tcsh"),
        (&["frobnicate"], "frobnicate"),
        (&[], "Usage: fo"),
    ];
    for (args, needle) in cases {
        let out = fo(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn failures_that_are_not_usage_errors_exit_1() {
    let out = fo(&[
        "shard",
        "--shape",
        "10",
        "--mesh",
        "2",
        "--placements",
        "S1",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).starts_with("fo: "),
        "{}",
        text(&out.stderr)
    );
    let out = fo(&["ckpt", "verify", "/nonexistent/fo-ckpt"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("/nonexistent/fo-ckpt"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn completions_cover_every_shell_and_every_command() {
    for (shell, marker) in [
        ("bash", "complete -F"),
        ("zsh", "#compdef fo"),
        ("fish", "complete -c fo"),
    ] {
        let out = fo(&["completions", shell]);
        assert_eq!(out.status.code(), Some(0), "{shell}");
        let s = text(&out.stdout);
        assert!(s.contains(marker), "{shell}: {}", &s[..s.len().min(300)]);
        for word in [
            "shard",
            "consolidate",
            "broadcast",
            "placements",
            "size-mib",
        ] {
            assert!(s.contains(word), "{shell} completion lacks {word}");
        }
    }
}

#[test]
fn a_closed_pipe_is_not_a_crash() {
    // `fo completions bash | head -1`: the reader goes away before fo writes.
    let mut child = Command::new(env!("CARGO_BIN_EXE_fo"))
        .args(["completions", "bash"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert!(
        !text(&out.stderr).contains("panicked"),
        "{}",
        text(&out.stderr)
    );
    // The same for any command's println!: `fo ckpt diff A B | head -1`.
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/oracle/ckpt_fsdp_tp_2x2/sharded"
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_fo"))
        .args(["ckpt", "diff", dir, dir])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert!(
        !text(&out.stderr).contains("panicked"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn quiet_is_accepted_everywhere_and_flags_keep_their_spellings() {
    // --quiet is global: before or after the subcommand; `--flag=value` still works.
    for args in [
        &[
            "-q",
            "shard",
            "--shape=10,7",
            "--mesh=2,3",
            "--placements=SS0:3,S0",
        ][..],
        &[
            "shard",
            "--shape",
            "10,7",
            "--mesh",
            "2,3",
            "--placements",
            "SS0:3,S0",
            "--quiet",
        ],
    ] {
        let out = fo(args);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert_eq!(text(&out.stdout).lines().count(), 8);
    }
}
