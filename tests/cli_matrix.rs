//! The command line never loses a user's data and never accepts nonsense (issue 22): every
//! command that writes (`ckpt convert`, `ckpt consolidate`, `bench ckpt`, `demo`) is tried
//! with an existing destination, a write error, a read-only destination and an interrupt;
//! every command with zero / negative / huge / NaN numbers and unknown names; every
//! command that prints with a full stdout. Each must leave no partial output, touch no file
//! it did not create, and end with one line `fo: ...` and exit 1 (runtime) or clap's
//! message and exit 2 (usage).
//!
//! Write errors are injected without any hook in fo: the child runs under RLIMIT_FSIZE
//! (with SIGXFSZ ignored), so its file writes fail with EFBIG ("File too large") past a
//! few bytes, as a full disk fails them with ENOSPC. stdout errors use /dev/full. The
//! read-only destination is a read-only tmpfs where mounting works (root in a
//! container), else a chmod 555 directory (not root), else that case says it is skipped.
use std::collections::BTreeMap;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const FO: &str = env!("CARGO_BIN_EXE_fo");

fn oracle(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/oracle")
        .join(rel)
}

/// A scratch directory, removed at the end of the test.
struct Tmp(PathBuf);

impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tmp(name: &str) -> Tmp {
    let d = std::env::temp_dir().join(format!("fo-cli-matrix-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Tmp(d)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Every path under `dir` (directories as empty entries) with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().map(|e| e.unwrap()) {
            let p = e.path();
            if e.file_type().unwrap().is_dir() {
                out.insert(p.join(""), vec![]);
                todo.push(p);
            } else {
                out.insert(p.clone(), std::fs::read(&p).unwrap_or_default());
            }
        }
    }
    out
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().map(|e| e.unwrap()) {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn fo(args: &[&str]) -> Output {
    Command::new(FO).args(args).output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A failure of the expected kind: runtime (1) ends stderr with its one error line
/// `fo: ...` (the only one; a benchmark's description or a `note:` may come before);
/// usage (2) is clap's message, `error: ...` naming `needle`, nothing on stdout.
fn assert_fails(out: &Output, code: i32, needle: &str, what: &str) {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{what}: {err}");
    assert!(!err.contains("panicked"), "{what}: {err}");
    assert!(err.contains(needle), "{what}: {needle:?} not in {err}");
    if code == 1 {
        let last = err.lines().last().unwrap_or("");
        assert!(
            last.starts_with("fo: ") && last.contains(needle),
            "{what}: {err}"
        );
        assert_eq!(
            err.lines().filter(|l| l.starts_with("fo: ")).count(),
            1,
            "{what}: {err}"
        );
    } else {
        assert!(err.starts_with("error: "), "{what}: {err}");
        assert!(out.stdout.is_empty(), "{what}");
    }
}

/// The four commands that write, each into `dst`, small enough to run in a second.
fn writers(src: &Path, dst: &Path) -> Vec<(&'static str, Vec<String>)> {
    let (src, dst) = (s(src).to_string(), s(dst).to_string());
    let v = |a: &[&str]| a.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    vec![
        (
            "convert",
            v(&["ckpt", "convert", &src, &dst, "--ranks", "2"]),
        ),
        ("consolidate", v(&["ckpt", "consolidate", &src, &dst])),
        (
            "bench ckpt",
            v(&[
                "bench",
                "ckpt",
                "--size-mib",
                "1",
                "--rounds",
                "1",
                "--ranks",
                "2",
                "--dir",
                &dst,
            ]),
        ),
        (
            "demo",
            v(&["demo", "--steps", "12", "--ranks", "2", "--out", &dst]),
        ),
    ]
}

#[test]
fn existing_destinations_are_refused_and_left_untouched() {
    let t = tmp("existing");
    let src = t.0.join("src");
    copy_dir(&oracle("ckpt_fsdp2_4ranks/sharded"), &src);
    let dst = t.0.join("dst");
    std::fs::create_dir(&dst).unwrap();
    std::fs::write(dst.join("notes.txt"), b"the user's").unwrap();
    let file = t.0.join("file");
    std::fs::write(&file, b"a file").unwrap();
    let before = snapshot(&t.0);
    for target in [&dst, &file] {
        for (name, args) in writers(&src, target) {
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = fo(&a);
            assert_fails(
                &out,
                1,
                s(target),
                &format!("{name} into {}", target.display()),
            );
            assert_eq!(snapshot(&t.0), before, "{name} changed files");
        }
    }
    // SRC itself, a directory inside it, and (with --force) a directory holding it.
    for (dst, force) in [
        (src.clone(), true),
        (src.join("sub"), false),
        (t.0.clone(), true),
    ] {
        for cmd in ["convert", "consolidate"] {
            let mut a = vec!["ckpt", cmd, s(&src), s(&dst)];
            if force {
                a.push("--force");
            }
            assert_fails(
                &fo(&a),
                1,
                "source",
                &format!("{cmd} into {}", dst.display()),
            );
            assert_eq!(snapshot(&t.0), before, "{cmd} into {}", dst.display());
        }
    }
    // An existing empty directory is a fine destination; filled, it is refused.
    for cmd in ["convert", "consolidate"] {
        let d = t.0.join(format!("empty-{cmd}"));
        std::fs::create_dir(&d).unwrap();
        let out = fo(&["ckpt", cmd, s(&src), s(&d)]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let filled = snapshot(&d);
        assert_fails(&fo(&["ckpt", cmd, s(&src), s(&d)]), 1, "--force", cmd);
        assert_eq!(snapshot(&d), filled);
    }
}

#[test]
fn bench_ckpt_removes_only_what_it_wrote() {
    let t = tmp("bench-dir");
    let dir = t.0.join("bench");
    let args = |keep: bool| {
        let mut a = vec![
            "bench",
            "ckpt",
            "--size-mib",
            "1",
            "--rounds",
            "1",
            "--ranks",
            "2",
        ];
        if keep {
            a.push("--keep");
        }
        a.extend(["--dir", s(&dir)]);
        a
    };
    let out = fo(&args(true));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // A directory an earlier --keep run left may be reused; a file the user put there
    // since survives the next run's cleanup, and so does the directory it did not create.
    std::fs::write(dir.join("user.txt"), b"mine").unwrap();
    let out = fo(&args(false));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("user.txt")]);
    // An empty directory the user made stays, empty.
    let empty = t.0.join("empty");
    std::fs::create_dir(&empty).unwrap();
    let out = fo(&[
        "bench",
        "ckpt",
        "--size-mib",
        "1",
        "--rounds",
        "1",
        "--dir",
        s(&empty),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(empty.is_dir() && std::fs::read_dir(&empty).unwrap().next().is_none());
    // Sizes print with a unit that fits: 1 MiB, not "0.00 GiB".
    let err = text(&out.stderr);
    assert!(err.contains("= 1.00 MiB"), "{err}");
}

/// Runs `args` with file writes limited to `bytes` (EFBIG past it, SIGXFSZ ignored).
fn with_write_limit(args: &[String], bytes: u64) -> Output {
    let mut c = Command::new(FO);
    c.args(args);
    // SAFETY: async-signal-safe calls only, between fork and exec.
    unsafe {
        c.pre_exec(move || {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let r = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &r) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    c.output().unwrap()
}

#[test]
fn write_errors_leave_no_partial_output() {
    let t = tmp("efbig");
    let src = oracle("ckpt_fsdp2_4ranks/sharded");
    let before = snapshot(&t.0);
    for (name, args) in writers(&src, &t.0.join("out/nested")) {
        let out = with_write_limit(&args, 1024);
        assert_fails(&out, 1, "File too large", name);
        assert_eq!(snapshot(&t.0), before, "{name} left something behind");
    }
}

/// A directory nothing can be written into, or None (with the reason) where this
/// machine cannot make one.
struct ReadOnly {
    dir: PathBuf,
    mounted: bool,
}

impl Drop for ReadOnly {
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new("umount").arg(&self.dir).status();
        } else {
            let _ = std::fs::set_permissions(
                &self.dir,
                std::os::unix::fs::PermissionsExt::from_mode(0o755),
            );
        }
    }
}

fn read_only(dir: PathBuf) -> Result<ReadOnly, String> {
    std::fs::create_dir_all(&dir).unwrap();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o555))
            .unwrap();
        return Ok(ReadOnly {
            dir,
            mounted: false,
        });
    }
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", s(&dir)])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|st| st.success());
    if ok {
        Ok(ReadOnly { dir, mounted: true })
    } else {
        Err("root without permission to mount a read-only tmpfs".into())
    }
}

#[test]
fn read_only_destinations_fail_cleanly() {
    let t = tmp("ro");
    let ro = match read_only(t.0.join("ro")) {
        Ok(r) => r,
        Err(why) => {
            eprintln!("read-only destinations not tried: {why}");
            return;
        }
    };
    let src = oracle("ckpt_fsdp2_4ranks/sharded");
    for (name, args) in writers(&src, &ro.dir.join("out")) {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = fo(&a);
        assert_eq!(out.status.code(), Some(1), "{name}: {}", text(&out.stderr));
        assert_fails(&out, 1, s(&ro.dir), name);
        assert!(
            std::fs::read_dir(&ro.dir).unwrap().next().is_none(),
            "{name}"
        );
    }
}

/// Staging entries (`.NAME.<verb>-PID`) beside DST.
fn stages(parent: &Path, name: &str) -> Vec<String> {
    std::fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!(".{name}.")))
        .collect()
}

/// A 24 MiB fo checkpoint on 4 ranks (converting it takes long enough to interrupt).
fn big_checkpoint(root: &Path) -> PathBuf {
    let dir = root.join("big");
    let out = fo(&[
        "bench",
        "ckpt",
        "--save-only",
        "--keep",
        "--size-mib",
        "24",
        "--ranks",
        "4",
        "--rounds",
        "1",
        "--dir",
        s(&dir),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    dir
}

#[test]
fn interrupted_runs_leave_no_partial_output() {
    let t = tmp("sigint");
    let big = big_checkpoint(&t.0);
    let before = snapshot(&big);
    // Delays spread over each command's run, varied per test process ("random-ish").
    let jitter = (std::process::id() % 7) as u64;
    let mut interrupted = 0;
    for (i, delay) in [2u64, 10, 30, 80, 200].into_iter().enumerate() {
        let out_name = format!("out{i}");
        let dst = t.0.join(&out_name);
        let cmds: Vec<(&str, Vec<String>, libc::c_int)> = vec![
            (
                "convert",
                ["ckpt", "convert", s(&big), s(&dst), "--ranks", "3"]
                    .map(String::from)
                    .to_vec(),
                libc::SIGINT,
            ),
            (
                "consolidate",
                ["ckpt", "consolidate", s(&big), s(&dst)]
                    .map(String::from)
                    .to_vec(),
                libc::SIGTERM,
            ),
            (
                "bench ckpt",
                [
                    "bench",
                    "ckpt",
                    "--size-mib",
                    "8",
                    "--rounds",
                    "1",
                    "--dir",
                    s(&dst),
                ]
                .map(String::from)
                .to_vec(),
                libc::SIGINT,
            ),
            (
                "demo",
                ["demo", "--steps", "12", "--ranks", "2", "--out", s(&dst)]
                    .map(String::from)
                    .to_vec(),
                libc::SIGINT,
            ),
        ];
        for (name, args, sig) in cmds {
            let child = Command::new(FO)
                .args(&args)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            std::thread::sleep(Duration::from_millis(delay + jitter));
            // SAFETY: signalling our own child.
            unsafe { libc::kill(child.id() as i32, sig) };
            let out = child.wait_with_output().unwrap();
            let err = text(&out.stderr);
            if out.status.success() {
                // Finished first: the output is whole (the demo and bench keep nothing
                // at a path they created unless asked).
                if name == "convert" || name == "consolidate" {
                    let v = fo(&["ckpt", "verify", s(&dst)]);
                    assert_eq!(v.status.code(), Some(0), "{name}: {}", text(&v.stderr));
                }
            } else {
                assert_eq!(
                    out.status.signal(),
                    Some(sig),
                    "{name} after {delay} ms: {err}"
                );
                assert!(!err.contains("panicked"), "{name}: {err}");
                // A signal after the publishing rename finds the output already the
                // user's: whole, and kept (`cli/cleanup.rs`). Before it, nothing is left.
                let published = (name == "convert" || name == "consolidate") && dst.exists();
                if published {
                    let v = fo(&["ckpt", "verify", s(&dst)]);
                    assert_eq!(v.status.code(), Some(0), "{name}: {}", text(&v.stderr));
                    std::fs::remove_dir_all(&dst).unwrap();
                }
                assert!(
                    !dst.exists(),
                    "{name} after {delay} ms left {}",
                    dst.display()
                );
                interrupted += 1;
            }
            assert!(
                stages(&t.0, &out_name).is_empty(),
                "{name} after {delay} ms left {:?}",
                stages(&t.0, &out_name)
            );
            let _ = std::fs::remove_dir_all(&dst);
        }
    }
    assert_eq!(snapshot(&big), before, "the source changed");
    assert!(
        interrupted >= 8,
        "only {interrupted} runs were caught mid-way"
    );
}

/// A pid no process has (a child that has exited and been reaped).
fn dead_pid() -> u32 {
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

#[test]
fn killed_runs_are_cleaned_up_by_the_next() {
    let t = tmp("sigkill");
    let big = big_checkpoint(&t.0);
    let dst = t.0.join("out");
    // SIGKILL once the staging directory holds data: nothing can clean up then.
    let mut child = Command::new(FO)
        .args(["ckpt", "convert", s(&big), s(&dst), "--ranks", "3"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let stage = t.0.join(format!(".out.convert-{}", child.id()));
    while !stage.exists() && start.elapsed() < Duration::from_secs(30) {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(stage.exists(), "the convert was not caught mid-way");
    // The next run for the same DST removes it (its process is gone), and says so.
    let out = fo(&[
        "ckpt",
        "convert",
        s(&big),
        s(&dst),
        "--ranks",
        "2",
        "--force",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(!stage.exists() && stages(&t.0, "out").is_empty());
    // A DST moved aside by a run killed before its replacement arrived is restored, and
    // then (no --force) not replaced.
    let kept = snapshot(&dst);
    let aside = t.0.join(format!(".out.convert-{}.old", dead_pid()));
    std::fs::rename(&dst, &aside).unwrap();
    let out = fo(&["ckpt", "convert", s(&big), s(&dst), "--ranks", "3"]);
    assert_fails(&out, 1, "--force", "convert after a killed replace");
    assert!(
        text(&out.stderr).contains("restored"),
        "{}",
        text(&out.stderr)
    );
    assert!(!aside.exists());
    let now: BTreeMap<_, _> = snapshot(&dst);
    assert_eq!(
        now.values().collect::<Vec<_>>(),
        kept.values().collect::<Vec<_>>()
    );
    // A live process's staging directory is left alone.
    let live = t.0.join(format!(".out.convert-{}", std::process::id()));
    std::fs::create_dir(&live).unwrap();
    let out = fo(&[
        "ckpt",
        "convert",
        s(&big),
        s(&dst),
        "--ranks",
        "3",
        "--force",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(live.exists());
}

#[test]
fn nonsense_numbers_and_unknown_names_are_refused_before_anything_runs() {
    let t = tmp("bounds");
    let src = oracle("ckpt_fsdp2_4ranks/sharded");
    let src = s(&src);
    let out = t.0.join("out");
    let o = s(&out);
    let usage: &[(&[&str], &str)] = &[
        (&["demo", "--ranks", "0"], "--ranks"),
        (&["demo", "--ranks", "65"], "--ranks"),
        (&["demo", "--steps", "4"], "--steps"),
        (&["demo", "--steps", "-1"], "--steps"),
        (&["demo", "--steps", "99999999999999999999"], "--steps"),
        (&["demo", "--seed", "nan"], "--seed"),
        (&["bench", "step", "--sizes", "0"], "--sizes"),
        (&["bench", "step", "--sizes", ""], "--sizes"),
        (&["bench", "step", "--sizes", "-1"], "--sizes"),
        (&["bench", "step", "--sizes", "99999999999999M"], "--sizes"),
        (&["bench", "step", "--threads", "0"], "--threads"),
        (&["bench", "step", "--threads", "1,2000"], "--threads"),
        (&["bench", "step", "--tensors", "0"], "--tensors"),
        (&["bench", "step", "--iters", "0"], "--iters"),
        (
            &["bench", "step", "--iters-params", "nan"],
            "--iters-params",
        ),
        (&["bench", "step", "--iters-params", "-1"], "--iters-params"),
        (
            &["bench", "step", "--iters-params", "inf"],
            "--iters-params",
        ),
        (&["bench", "step", "--algs", "foo,bar"], "foo"),
        (&["bench", "step", "--arithmetic", "slow"], "slow"),
        (&["bench", "step", "--only", "fp64"], "fp64"),
        (&["bench", "broadcast", "--ranks", "0"], "--ranks"),
        (&["bench", "broadcast", "--ranks", "2000"], "--ranks"),
        (&["bench", "broadcast", "--size-mib", "0"], "--size-mib"),
        (&["bench", "broadcast", "--tensors", "0"], "--tensors"),
        (&["bench", "ckpt", "--ranks", "0", "--dir", o], "--ranks"),
        (&["bench", "ckpt", "--ranks", "2000", "--dir", o], "--ranks"),
        (
            &["bench", "ckpt", "--size-mib", "0", "--dir", o],
            "--size-mib",
        ),
        (
            &["bench", "ckpt", "--size-mib", "-1", "--dir", o],
            "--size-mib",
        ),
        (&["bench", "ckpt", "--rounds", "0", "--dir", o], "--rounds"),
        (&["bench", "clip", "--size", "0"], "--size"),
        (&["bench", "clip", "--iters", "0"], "--iters"),
        (&["bench", "clip", "--size", "99999999999999M"], "--size"),
        (&["selftest", "--iters", "0"], "--iters"),
        (&["selftest", "--size", "0"], "--size"),
        (&["selftest", "--device", "-1"], "--device"),
        (&["ckpt", "convert", src, o, "--ranks", "0"], "--ranks"),
        (&["ckpt", "convert", src, o, "--ranks", "100000"], "--ranks"),
        (&["ckpt", "convert", src, o, "--to", "fp8"], "fp8"),
        (
            &["ckpt", "convert", src, o, "--placements", "Q1"],
            "--placements",
        ),
        (&["ckpt", "diff", src, src, "--rtol", "-1"], "--rtol"),
        (&["ckpt", "diff", src, src, "--rtol", "nan"], "--rtol"),
        (&["ckpt", "diff", src, src, "--atol", "inf"], "--atol"),
        (
            &[
                "shard",
                "--shape",
                "10",
                "--mesh",
                "x",
                "--placements",
                "S0",
            ],
            "--mesh",
        ),
        (
            &[
                "shard",
                "--shape",
                "10",
                "--mesh",
                "2",
                "--placements",
                "Z0",
            ],
            "--placements",
        ),
        (&["completions", "tcsh"], "tcsh"),
        (&["ckpt", "frobnicate"], "frobnicate"),
        (&["frobnicate"], "frobnicate"),
    ];
    for (args, needle) in usage {
        assert_fails(&fo(args), 2, needle, &format!("{args:?}"));
    }
    let runtime: &[(&[&str], &str)] = &[
        (
            &["ckpt", "convert", src, o, "--placements", "S5"],
            "--placements S5",
        ),
        (&["ckpt", "convert", src, o, "--mesh", "2,0"], "--mesh 2,0"),
        (
            &["ckpt", "convert", src, o, "--mesh", "64,64"],
            "--mesh 64,64",
        ),
        (
            &["ckpt", "convert", src, o, "--mesh", "2,2", "--ranks", "3"],
            "--ranks 3",
        ),
        (
            &[
                "ckpt",
                "convert",
                src,
                o,
                "--mesh",
                "2,2",
                "--placements",
                "S0",
            ],
            "--placements S0",
        ),
        (&["bench", "clip", "--size", "1048576M"], "--size"),
        (&["bench", "step", "--sizes", "1048576M"], "--sizes"),
        (
            &["bench", "step", "--sizes", "1K", "--tensors", "2000"],
            "--tensors 2000",
        ),
        (
            &["bench", "broadcast", "--size-mib", "1073741824"],
            "--size-mib",
        ),
        (
            &["bench", "ckpt", "--size-mib", "1073741824", "--dir", o],
            "--size-mib",
        ),
        (&["ckpt", "inspect", "/nonexistent/fo"], "/nonexistent/fo"),
        (
            &[
                "ckpt",
                "verify",
                &format!("{src}/shard-00001-model-00001-of-00001.safetensors"),
            ],
            "give its directory",
        ),
    ];
    for (args, needle) in runtime {
        assert_fails(&fo(args), 1, needle, &format!("{args:?}"));
    }
    assert!(!out.exists(), "a refused command created {o}");
}

#[test]
fn a_full_stdout_is_a_one_line_error_not_a_panic() {
    if !Path::new("/dev/full").exists() {
        eprintln!("no /dev/full here: not tried");
        return;
    }
    let t = tmp("devfull");
    let src = oracle("ckpt_fsdp2_4ranks/sharded");
    let full = oracle("ckpt_fsdp2_4ranks/full.safetensors");
    let cases: Vec<Vec<String>> = vec![
        vec![
            "shard",
            "--shape",
            "10",
            "--mesh",
            "2",
            "--placements",
            "S0",
        ],
        vec!["ckpt", "inspect", s(&src)],
        vec!["ckpt", "inspect", s(&full)],
        vec!["ckpt", "verify", s(&src)],
        vec!["ckpt", "diff", s(&src), s(&full)],
        vec!["ckpt", "convert", s(&src), s(&t.0.join("c"))],
        vec!["ckpt", "consolidate", s(&src), s(&t.0.join("k"))],
        vec!["completions", "bash"],
        vec!["selftest", "--size", "4K", "--iters", "1"],
    ]
    .into_iter()
    .map(|v| v.into_iter().map(String::from).collect())
    .collect();
    for args in cases {
        let out = Command::new(FO)
            .args(&args)
            .stdout(std::fs::File::create("/dev/full").unwrap())
            .output()
            .unwrap();
        assert_fails(&out, 1, "No space left on device", &format!("{args:?}"));
    }
}
