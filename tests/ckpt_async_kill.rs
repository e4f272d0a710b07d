//! Kill during async saves: two saver processes (ranks 0 and 1 of one save, no
//! communicator: the last rank to finish commits in the background) each step their
//! optimizer, start `save_async`, keep stepping while the writer works, and wait. They
//! are SIGKILLed at random points over the same directory until 100 saves have had a
//! rank killed. After every kill the directory must verify and hold exactly one whole
//! generation, bit-exact: each committed rank file equals a synchronous save of the
//! state that generation's call saw (the previous generation or the new one).
mod ckpt_util;
mod kill_loop;

use std::path::{Path, PathBuf};

use ckpt_util::{config, Rank};
use fo::ckpt::{committed_files, read_commit};
use fo::ckpt::{save_async, save_optimizer, verify, Mode, SaveOptions};
use fo::optim::StateFormat;
use fo::DType;
use kill_loop::{child_args, KillLoop};

fn options(rank: usize, g: u64) -> SaveOptions {
    let mut o = SaveOptions::new(rank, 2, Mode::Compressed);
    o.save_id = format!("gen-{g}");
    o
}

fn rank(r: usize) -> Rank {
    Rank::new(2, r, config(StateFormat::Quant8, 24), DType::BF16)
}

const LOOP: KillLoop = KillLoop {
    child: "async_saver_child",
    var: "FO_KILL_ASYNC_SAVER",
    seed: 0x5A5E,
    kills: 100,
    require_success: true,
};

/// The child side: generation `g` is the state after `g` steps, saved asynchronously
/// while steps `g`, `g + 1`, `g + 2` run.
#[test]
fn async_saver_child() {
    let Some((dir, r, g)) = child_args(LOOP.var) else {
        return;
    };
    let dir: &Path = &dir;
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
    // Only the generation the directory holds and the one being saved may be found.
    let mut expected: Vec<(u64, Vec<Vec<u8>>)> = Vec::new();
    let r = {
        let expected = std::cell::RefCell::new(&mut expected);
        LOOP.run(
            &dir,
            &mut |g, last| {
                let mut e = expected.borrow_mut();
                e.retain(|(h, _)| *h == last);
                e.push((g, reference.files(g)));
            },
            &mut |d| {
                let e = expected.borrow();
                check(d, &|g| {
                    e.iter()
                        .find(|(h, _)| *h == g)
                        .map(|(_, f)| f.clone())
                        .unwrap_or_else(|| panic!("generation {g} was never saved here"))
                })
            },
        )
    };
    eprintln!(
        "{} async saves (2 ranks each, full run {:?}): {} with a rank SIGKILLed, every one left a whole generation bit-exact; {} committed the new one",
        r.saves, r.full, r.killed, r.committed
    );
    for d in [dir, reference.dir] {
        std::fs::remove_dir_all(d).unwrap();
    }
}
