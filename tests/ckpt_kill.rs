//! Kill during save: two saver processes (ranks 0 and 1 of one save, saving
//! independently, no communicator) are SIGKILLed at random points over the same
//! directory until 100 saves have had a rank killed mid-way. After every kill the directory must open, verify and hold exactly one
//! whole generation: the previous committed one or the new one, never a mix.
mod ckpt_util;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fo::ckpt::{local_shard, save_rank, verify, Checkpoint, PackOptions, Packed, StateEntry};
use fo::shard::{Placement, ShardSpec};
use fo::Tensor;

const ROWS: usize = 2048;
const COLS: usize = 128;

fn global(generation: u64) -> Tensor {
    let v: Vec<f32> = (0..ROWS * COLS)
        .map(|i| (i as u64 * 31 + generation * 1_000_003) as f32)
        .collect();
    Tensor::from_f32(vec![ROWS, COLS], &v).unwrap()
}

fn spec(rank: usize) -> ShardSpec {
    ShardSpec::new(
        vec![ROWS, COLS],
        vec![2],
        vec![rank],
        vec![Placement::Shard(0)],
    )
    .unwrap()
}

/// One rank's save of generation `g` (what each child process runs).
fn save_generation(dir: &Path, rank: usize, g: u64) {
    let g_t = global(g);
    let mut entries = vec![StateEntry::new(
        "state.w.exp_avg",
        local_shard(&g_t, &spec(rank)),
        Some(spec(rank)),
    )];
    entries.push(StateEntry::new(
        "state.w.step",
        Tensor::from_f32(vec![], &[g as f32]).unwrap(),
        None,
    ));
    let mut o = PackOptions::new(rank, 2);
    o.save_id = format!("gen-{g}");
    save_rank(dir, &Packed::new(entries, o).unwrap()).unwrap();
}

/// The child side: runs only when re-executed by the loop below with FO_KILL_SAVER set.
#[test]
fn saver_child() {
    let Ok(v) = std::env::var("FO_KILL_SAVER") else {
        return;
    };
    let p: Vec<&str> = v.split(':').collect();
    save_generation(
        Path::new(p[0]),
        p[1].parse().unwrap(),
        p[2].parse().unwrap(),
    );
}

fn spawn(dir: &Path, rank: usize, g: u64) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "saver_child", "--test-threads", "1"])
        .env("FO_KILL_SAVER", format!("{}:{rank}:{g}", dir.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// The generation the directory holds, after checking it whole.
fn check(dir: &Path) -> u64 {
    verify(dir, &mut |_, _| {}).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    let g = ck.read_full("state.w.step").unwrap().to_f32().unwrap()[0] as u64;
    assert!(
        ck.read_full("state.w.exp_avg").unwrap() == global(g),
        "generation {g} is not whole"
    );
    assert_eq!(ck.meta.as_ref().unwrap().save_id, format!("gen-{g}"));
    g
}

fn tmpdir() -> PathBuf {
    ckpt_util::tmp("kill-loop")
}

#[test]
fn saves_killed_at_random_points_leave_the_previous_or_the_new_checkpoint() {
    let dir = tmpdir();
    let start = Instant::now();
    let mut both = [spawn(&dir, 0, 1), spawn(&dir, 1, 1)];
    for c in &mut both {
        assert!(c.wait().unwrap().success());
    }
    let full = start.elapsed();
    assert_eq!(check(&dir), 1);
    let mut rng = 0x4B11_u64;
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
        let mut was_killed = false;
        for (c, t) in kids.iter_mut().zip(at) {
            while t0.elapsed() < t && c.try_wait().unwrap().is_none() {
                std::thread::sleep(Duration::from_micros(200));
            }
            if c.try_wait().unwrap().is_none() {
                c.kill().unwrap(); // SIGKILL
                was_killed = true;
            }
            c.wait().unwrap();
        }
        killed += was_killed as usize;
        let now = check(&dir);
        assert!(
            now == last || now == g,
            "after killing save {g}: generation {now}, previous {last}"
        );
        committed += (now == g) as usize;
        last = now;
    }
    eprintln!(
        "{} saves (2 ranks each, full save {full:?}): {killed} with a rank SIGKILLed mid-save, every one left a whole generation; {committed} committed the new one",
        g - 1
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
