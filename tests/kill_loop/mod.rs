//! The SIGKILL loop shared by `ckpt_kill.rs` and `ckpt_async_kill.rs`: two saver
//! processes (ranks 0 and 1, this test binary re-executed to run one child test) save
//! generation after generation into one directory and are killed at random points until
//! enough saves had a rank killed; after every save the directory must hold the previous
//! generation or the new one, whole (the caller's `check` says which and how strictly).
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How the loop re-executes this binary: `child` is the child test's name, `var` the
/// environment variable that carries `dir:rank:generation` to it.
pub struct KillLoop {
    pub child: &'static str,
    pub var: &'static str,
    /// The xorshift seed of the kill times.
    pub seed: u64,
    /// Saves that must have had a rank killed.
    pub kills: usize,
    /// A child that finished before its kill time must have exited successfully.
    pub require_success: bool,
}

/// What a loop did, for its report.
pub struct Report {
    pub saves: u64,
    pub killed: usize,
    pub committed: usize,
    /// One whole save of generation 1 (both ranks), unkilled.
    pub full: Duration,
}

/// In a child process: the `dir`, rank and generation it was given (None: this is the
/// test run itself, not a child).
pub fn child_args(var: &str) -> Option<(PathBuf, usize, u64)> {
    let v = std::env::var(var).ok()?;
    let p: Vec<&str> = v.split(':').collect();
    Some((
        PathBuf::from(p[0]),
        p[1].parse().unwrap(),
        p[2].parse().unwrap(),
    ))
}

impl KillLoop {
    fn spawn(&self, dir: &Path, rank: usize, g: u64) -> Child {
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", self.child, "--test-threads", "1"])
            .env(self.var, format!("{}:{rank}:{g}", dir.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    }

    /// Saves generation 1 whole, then generations 2.. with both ranks killed at random
    /// times within one and a half whole saves' duration, until `kills` saves had a
    /// rank killed. `expect(g, last)` runs before generation `g`'s savers start (`last`: the
    /// generation the directory holds); `check(dir)` after every save returns the
    /// generation the directory holds, which must be `last` or `g`.
    ///
    /// "One whole save's duration" is re-measured from every save that ran to the end
    /// unkilled: the first save (a cold start of the binary) can take several times as
    /// long as the later ones, and kill times drawn over that span mostly fell after the
    /// savers had exited (CI saw 89 kills land in 400 saves).
    pub fn run(
        &self,
        dir: &Path,
        expect: &mut dyn FnMut(u64, u64),
        check: &mut dyn FnMut(&Path) -> u64,
    ) -> Report {
        let start = Instant::now();
        let mut both = [self.spawn(dir, 0, 1), self.spawn(dir, 1, 1)];
        for c in &mut both {
            assert!(c.wait().unwrap().success(), "saver of generation 1 failed");
        }
        let full = start.elapsed();
        expect(1, 0);
        assert_eq!(check(dir), 1);
        let mut rng = self.seed;
        let mut next = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n.max(1)
        };
        let (mut last, mut killed, mut committed) = (1u64, 0usize, 0usize);
        let mut span = (full.as_micros() as u64).max(1000);
        let mut g = 1u64;
        while killed < self.kills {
            g += 1;
            assert!(g < 400, "only {killed} kills landed in {g} saves");
            // The reference work runs before the savers start, so that it neither
            // delays the kill times nor competes with the savers for the cores.
            expect(g, last);
            let at = [
                Duration::from_micros(next(span)),
                Duration::from_micros(next(span)),
            ];
            let mut kids = [self.spawn(dir, 0, g), self.spawn(dir, 1, g)];
            let t0 = Instant::now();
            let mut was_killed = false;
            for (c, t) in kids.iter_mut().zip(at) {
                while t0.elapsed() < t && c.try_wait().unwrap().is_none() {
                    std::thread::sleep(Duration::from_micros(200));
                }
                if c.try_wait().unwrap().is_none() {
                    c.kill().unwrap(); // SIGKILL
                    was_killed = true;
                } else if self.require_success {
                    assert!(c.wait().unwrap().success(), "saver of {g} failed");
                }
                c.wait().unwrap();
            }
            if !was_killed {
                // Both savers finished before their kill times: this is how long a
                // whole save takes now. Kill times are drawn over half as long again,
                // so that the end of a save (its commit) is hit as often as its start,
                // and the span cannot ratchet down to the quickest save seen.
                span = (t0.elapsed().as_micros() as u64 * 3 / 2).max(1000);
            } else {
                // Saves can also grow slower (a loaded machine): widen the span a
                // little at every kill, so that the late phases keep being hit until
                // an unkilled save measures the duration again.
                span += span / 20;
            }
            killed += was_killed as usize;
            let now = check(dir);
            assert!(
                now == last || now == g,
                "after killing save {g}: generation {now}, previous {last}"
            );
            committed += (now == g) as usize;
            last = now;
        }
        Report {
            saves: g - 1,
            killed,
            committed,
            full,
        }
    }
}
