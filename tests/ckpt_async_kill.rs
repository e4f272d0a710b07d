//! Kill during async saves: two saver processes (ranks 0 and 1 of one save, no
//! communicator: the last rank to finish commits in the background) each step their
//! optimizer, start `save_async`, keep stepping while the writer works, and wait. They
//! are SIGKILLed at random points over the same directory until 100 saves have had a
//! rank killed. After every kill the directory must verify and hold exactly one whole
//! generation, bit-exact: each committed rank file equals a synchronous save of the
//! state that generation's call saw (the previous generation or the new one).
mod ckpt_util;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ckpt_util::{config, Rank};
use fo::ckpt::commit::{committed_files, read_commit};
use fo::ckpt::{save_async, save_optimizer, verify, Mode, SaveOptions};
use fo::optim::StateFormat;
use fo::DType;

fn options(rank: usize, g: u64) -> SaveOptions {
    let mut o = SaveOptions::new(rank, 2, Mode::Compressed);
    o.save_id = format!("gen-{g}");
    o
}

fn rank(r: usize) -> Rank {
    Rank::new(2, r, config(StateFormat::Quant8, 24), DType::BF16)
}

/// The child side: generation `g` is the state after `g` steps, saved asynchronously
/// while steps `g`, `g + 1`, `g + 2` run.
#[test]
fn async_saver_child() {
    let Ok(v) = std::env::var("FO_KILL_ASYNC_SAVER") else {
        return;
    };
    let p: Vec<&str> = v.split(':').collect();
    let (dir, r, g): (&Path, usize, u64) = (
        Path::new(p[0]),
        p[1].parse().unwrap(),
        p[2].parse().unwrap(),
    );
    let mut me = rank(r);
    for t in 0..g as usize {
        me.step(t);
    }
    let mut save = save_async(&mut me.opt, dir, &options(r, g), None, 4096).unwrap();
    for t in 0..3 {
        me.step(g as usize + t);
    }
    save.wait(None, None).unwrap();
}

fn spawn(dir: &Path, rank: usize, g: u64) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "async_saver_child", "--test-threads", "1"])
        .env(
            "FO_KILL_ASYNC_SAVER",
            format!("{}:{rank}:{g}", dir.display()),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// A synchronous save of generation `g` by both ranks: the bytes of each rank file.
struct Reference {
    ranks: [Rank; 2],
    at: u64,
    dir: PathBuf,
}

impl Reference {
    fn files(&mut self, g: u64) -> Vec<Vec<u8>> {
        assert!(g >= self.at, "generations only grow");
        while self.at < g {
            for r in &mut self.ranks {
                r.step(self.at as usize);
            }
            self.at += 1;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        for (r, rk) in self.ranks.iter().enumerate() {
            save_optimizer(&rk.opt, &self.dir, &options(r, g)).unwrap();
        }
        let c = read_commit(&self.dir).unwrap().unwrap();
        committed_files(&self.dir, &c)
            .unwrap()
            .iter()
            .map(|p| std::fs::read(p).unwrap())
            .collect()
    }
}

/// The generation the directory holds, after checking it whole and bit-exact.
fn check(dir: &Path, expect: &dyn Fn(u64) -> Vec<Vec<u8>>) -> u64 {
    verify(dir, &mut |_, _| {}).unwrap();
    let c = read_commit(dir).unwrap().expect("a commit record");
    let g: u64 = c.save_id.strip_prefix("gen-").unwrap().parse().unwrap();
    let files: Vec<Vec<u8>> = committed_files(dir, &c)
        .unwrap()
        .iter()
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    assert!(
        files == expect(g),
        "generation {g} is not the state its call saw"
    );
    g
}

#[test]
fn async_saves_killed_at_random_points_leave_the_previous_or_the_new_checkpoint_bit_exact() {
    let dir = ckpt_util::tmp("async-kill-loop");
    let mut reference = Reference {
        ranks: [rank(0), rank(1)],
        at: 0,
        dir: ckpt_util::tmp("async-kill-ref"),
    };
    let start = Instant::now();
    let mut both = [spawn(&dir, 0, 1), spawn(&dir, 1, 1)];
    for c in &mut both {
        assert!(c.wait().unwrap().success());
    }
    let full = start.elapsed();
    let mut expected = vec![(1u64, reference.files(1))];
    let lookup = |exp: &Vec<(u64, Vec<Vec<u8>>)>| {
        let exp = exp.clone();
        move |g: u64| {
            exp.iter()
                .find(|(h, _)| *h == g)
                .map(|(_, f)| f.clone())
                .unwrap_or_else(|| panic!("generation {g} was never saved here"))
        }
    };
    assert_eq!(check(&dir, &lookup(&expected)), 1);
    let mut rng = 0x5A5E_u64;
    let mut next = |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n.max(1)
    };
    let (mut last, mut killed, mut committed) = (1u64, 0usize, 0usize);
    let span = (full.as_micros() as u64).max(1000);
    let mut g = 1u64;
    while killed < 100 {
        g += 1;
        assert!(g < 400, "only {killed} kills landed in {g} saves");
        let mut kids = [spawn(&dir, 0, g), spawn(&dir, 1, g)];
        let t0 = Instant::now();
        let at = [
            Duration::from_micros(next(span)),
            Duration::from_micros(next(span)),
        ];
        // Only the previous generation and this one may be found.
        expected.retain(|(h, _)| *h == last);
        expected.push((g, reference.files(g)));
        let mut was_killed = false;
        for (c, t) in kids.iter_mut().zip(at) {
            while t0.elapsed() < t && c.try_wait().unwrap().is_none() {
                std::thread::sleep(Duration::from_micros(200));
            }
            if c.try_wait().unwrap().is_none() {
                c.kill().unwrap(); // SIGKILL
                was_killed = true;
            } else {
                // A child that finished must have succeeded.
                assert!(c.wait().unwrap().success(), "saver of {g} failed");
            }
            c.wait().unwrap();
        }
        killed += was_killed as usize;
        let now = check(&dir, &lookup(&expected));
        assert!(
            now == last || now == g,
            "after killing save {g}: generation {now}, previous {last}"
        );
        committed += (now == g) as usize;
        last = now;
    }
    eprintln!(
        "{} async saves (2 ranks each, full run {full:?}): {killed} with a rank SIGKILLed, every one left a whole generation bit-exact; {committed} committed the new one",
        g - 1
    );
    for d in [dir, reference.dir] {
        std::fs::remove_dir_all(d).unwrap();
    }
}
