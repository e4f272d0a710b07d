//! Kill during save: two saver processes (ranks 0 and 1 of one save, saving
//! independently, no communicator) are SIGKILLed at random points over the same
//! directory until 100 saves have had a rank killed mid-way. After every kill the directory must open, verify and hold exactly one
//! whole generation: the previous committed one or the new one, never a mix.
mod ckpt_util;
mod kill_loop;

use std::path::Path;

use kill_loop::{child_args, KillLoop};

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

const LOOP: KillLoop = KillLoop {
    child: "saver_child",
    var: "FO_KILL_SAVER",
    seed: 0x4B11,
    kills: 100,
    require_success: false,
};

/// The child side: runs only when re-executed by the loop below with FO_KILL_SAVER set.
#[test]
fn saver_child() {
    if let Some((dir, rank, g)) = child_args(LOOP.var) {
        save_generation(&dir, rank, g);
    }
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

#[test]
fn saves_killed_at_random_points_leave_the_previous_or_the_new_checkpoint() {
    let dir = ckpt_util::tmp("kill-loop");
    let r = LOOP.run(&dir, &mut |_, _| {}, &mut |d| check(d));
    eprintln!(
        "{} saves (2 ranks each, full save {:?}): {} with a rank SIGKILLed mid-save, every one left a whole generation; {} committed the new one",
        r.saves, r.full, r.killed, r.committed
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
