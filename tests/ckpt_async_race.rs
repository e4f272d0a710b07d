//! Two async saves into one directory (issue 38, item 1): a loop that saves every N
//! steps into `latest/` starts the next save before it waits for the previous one. Run
//! many times, both ways (with and without a step between the calls), without and with a
//! communicator, from one optimizer and from two: every wait's status is truthful (OK
//! only for a save that was committed, and a later save only ever replaces it), and the
//! directory ends holding the newest committed save, byte for byte, and loads.
mod ckpt_util;
mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use ckpt_util::{config, global, spec, tmp, Buf};
use fo::ckpt::{
    load, local_shard, save_async, save_optimizer, Checkpoint, LoadOptions, Mode, ParamsAs,
    SaveOptions,
};
use fo::error::Error;
use fo::optim::{Optimizer, StateFormat};
use fo::shard::ShardSpec;
use fo::tensor::TensorView;
use fo::DType;

/// Large enough that a writer is still committing when the next save starts.
const SHAPES: [(&str, &[usize]); 3] = [
    ("emb.weight", &[2003, 64]),
    ("fc.weight", &[517, 129]),
    ("fc.bias", &[517]),
];

struct Model {
    opt: Optimizer,
    /// The registered parameters' memory: it must outlive `opt` (dropped after it).
    _params: Vec<Buf>,
    specs: Vec<ShardSpec>,
}

impl Model {
    fn new(world: usize, rank: usize) -> Model {
        let mut opt = Optimizer::new(config(StateFormat::Quant8, 24)).unwrap();
        let (mut params, mut specs) = (Vec::new(), Vec::new());
        for (k, (fqn, shape)) in SHAPES.iter().enumerate() {
            let s = spec(shape, "S0", world, rank);
            let mut b = Buf::new(local_shard(&global(DType::BF16, shape, k as f32), &s));
            unsafe { opt.add_param(fqn, b.view(), Some(s.clone()), 0).unwrap() };
            params.push(b);
            specs.push(s);
        }
        Model {
            opt,
            _params: params,
            specs,
        }
    }

    fn step(&mut self, t: usize) {
        let mut grads: Vec<Buf> = SHAPES
            .iter()
            .zip(&self.specs)
            .enumerate()
            .map(|(k, ((_, shape), s))| {
                Buf::new(local_shard(
                    &global(DType::BF16, shape, 100.0 + (t * 10 + k) as f32),
                    s,
                ))
            })
            .collect();
        let views: Vec<Option<TensorView>> = grads.iter_mut().map(|g| Some(g.view())).collect();
        unsafe { self.opt.step(&views).unwrap() };
    }
}

fn options(rank: usize, world: usize, id: &str) -> SaveOptions {
    let mut o = SaveOptions::new(rank, world, Mode::Compressed);
    o.save_id = id.into();
    o.params = Some(ParamsAs::Stored);
    o
}

/// The committed files of a checkpoint, as bytes (what a load reads).
fn committed_bytes(dir: &Path) -> Vec<Vec<u8>> {
    let ck =
        Checkpoint::open(dir).unwrap_or_else(|e| panic!("{} does not open: {e}", dir.display()));
    ck.files.iter().map(|f| std::fs::read(f).unwrap()).collect()
}

/// `dir` holds save `id` (whose synchronous twin is in `reference`), byte for byte, and
/// a fresh optimizer loads it.
fn assert_holds(dir: &Path, id: &str, reference: &Path, world: usize, rank: usize) {
    let ck =
        Checkpoint::open(dir).unwrap_or_else(|e| panic!("{} does not open: {e}", dir.display()));
    let got = ck.meta.as_ref().unwrap().save_id.clone();
    drop(ck);
    assert_eq!(
        got,
        id,
        "{} holds save {got:?}, not the newest {id:?}",
        dir.display()
    );
    assert!(
        committed_bytes(dir) == committed_bytes(reference),
        "{} holds save {id:?}, but not its bytes",
        dir.display()
    );
    let mut fresh = Model::new(world, rank);
    load(&mut fresh.opt, dir, &LoadOptions::default()).unwrap();
}

/// One optimizer, no communicator: the second save starts before the first is waited
/// for. Both waits are OK and the directory holds the second save.
fn race_without_comm(step_between: bool, runs: usize) {
    let tag = if step_between { "step" } else { "nostep" };
    let (dir, ra, rb) = (
        tmp(&format!("race-{tag}")),
        tmp(&format!("race-{tag}-ra")),
        tmp(&format!("race-{tag}-rb")),
    );
    let mut m = Model::new(1, 0);
    for run in 0..runs {
        let (a, b) = (format!("a{run}"), format!("b{run}"));
        m.step(2 * run);
        save_optimizer(&m.opt, &ra, &options(0, 1, &a)).unwrap();
        let mut first = save_async(&mut m.opt, &dir, &options(0, 1, &a), None, 0).unwrap();
        if step_between {
            m.step(2 * run + 1);
        }
        save_optimizer(&m.opt, &rb, &options(0, 1, &b)).unwrap();
        let second = save_async(&mut m.opt, &dir, &options(0, 1, &b), None, 0);
        let mut second = second.unwrap_or_else(|e| panic!("run {run}: second save refused: {e}"));
        let (wa, wb) = (first.wait(None, None), second.wait(None, None));
        assert!(wa.is_ok() && wb.is_ok(), "run {run}: waits {wa:?} {wb:?}");
        assert_holds(&dir, &b, &rb, 1, 0);
    }
    for d in [dir, ra, rb] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn a_second_save_into_the_same_dir_commits_after_the_first_with_a_step_between() {
    race_without_comm(true, 25);
}

#[test]
fn a_second_save_into_the_same_dir_commits_after_the_first_without_a_step_between() {
    race_without_comm(false, 25);
}

/// Two optimizers of one process (two models saved into one `latest/`), each from its
/// own thread: the later save waits for the earlier one's commit, so the directory holds
/// the later one.
#[test]
fn saves_of_two_optimizers_into_one_dir_commit_in_the_order_they_started() {
    let (dir, ra, rb) = (tmp("race-two"), tmp("race-two-ra"), tmp("race-two-rb"));
    let (mut m1, mut m2) = (Model::new(1, 0), Model::new(1, 0));
    for run in 0..15 {
        let (a, b) = (format!("a{run}"), format!("b{run}"));
        m1.step(run);
        m2.step(run + 1000);
        save_optimizer(&m1.opt, &ra, &options(0, 1, &a)).unwrap();
        save_optimizer(&m2.opt, &rb, &options(0, 1, &b)).unwrap();
        let mut first = save_async(&mut m1.opt, &dir, &options(0, 1, &a), None, 0).unwrap();
        let d2 = dir.clone();
        let (opt2, b2) = (&mut m2.opt, &b);
        let wb = std::thread::scope(|s| {
            s.spawn(move || {
                let mut second = save_async(opt2, &d2, &options(0, 1, b2), None, 0)?;
                second.wait(None, None)
            })
            .join()
            .unwrap()
        });
        let wa = first.wait(None, None);
        assert!(wa.is_ok() && wb.is_ok(), "run {run}: waits {wa:?} {wb:?}");
        assert_holds(&dir, &b, &rb, 1, 0);
    }
    for d in [dir, ra, rb] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// What a rank's second save (started before its first was waited for) came to.
fn second_with_comm(
    m: &mut Model,
    dir: &Path,
    comm: &fo::comm::Comm,
    a: &str,
    b: &str,
    step_between: Option<usize>,
) -> (Result<(), Error>, Option<Result<(), Error>>) {
    let (r, w) = (comm.rank(), comm.world_size());
    let mut first = save_async(&mut m.opt, dir, &options(r, w, a), Some(comm), 0).unwrap();
    if let Some(t) = step_between {
        m.step(t);
    }
    let second = save_async(&mut m.opt, dir, &options(r, w, b), Some(comm), 0);
    let wa = first.wait(None, Some(comm));
    let wb = match second {
        Ok(mut s) => Some(s.wait(None, Some(comm))),
        Err(e) => return (wa, Some(Err(e))),
    };
    (wa, wb)
}

/// Through a communicator the first save commits at its wait, on the caller's thread:
/// the second save cannot run that commit for it, so it is refused (FO_ERR_BUSY naming
/// the save in flight) on every rank, and the directory holds the first save. Started
/// again after the first's wait, it commits. Repeated, with and without a step between.
#[test]
fn a_second_save_through_a_communicator_before_the_first_wait_is_refused_as_busy() {
    for world in [1, 2] {
        let dir = tmp(&format!("race-comm-{world}"));
        let refs: Vec<PathBuf> = (0..2)
            .map(|k| tmp(&format!("race-comm-{world}-r{k}")))
            .collect();
        let (d, rf) = (dir.clone(), refs.clone());
        common::run_ranks(
            common::group(world, 60.0),
            Duration::from_secs(300),
            move |comm| {
                let (r, w) = (comm.rank(), comm.world_size());
                let mut m = Model::new(w, r);
                for run in 0..12 {
                    let (a, b) = (format!("a{run}"), format!("b{run}"));
                    m.step(3 * run);
                    fo::ckpt::save_optimizer_comm(&m.opt, &rf[0], &options(r, w, &a), &comm)
                        .unwrap();
                    let step = (run % 2 == 0).then_some(3 * run + 1);
                    let (wa, wb) = second_with_comm(&mut m, &d, &comm, &a, &b, step);
                    assert!(wa.is_ok(), "rank {r} run {run}: first wait {wa:?}");
                    match wb {
                        Some(Err(Error::Busy(msg))) => assert!(msg.contains(&a), "{msg}"),
                        other => panic!("rank {r} run {run}: second save {other:?}, not busy"),
                    }
                    comm.barrier().unwrap();
                    if r == 0 {
                        assert_holds(&d, &a, &rf[0], w, r);
                    }
                    comm.barrier().unwrap();
                    // After the first's wait, the second save goes through and replaces it.
                    m.step(3 * run + 2);
                    fo::ckpt::save_optimizer_comm(&m.opt, &rf[1], &options(r, w, &b), &comm)
                        .unwrap();
                    let mut s =
                        save_async(&mut m.opt, &d, &options(r, w, &b), Some(&comm), 0).unwrap();
                    s.wait(None, Some(&comm)).unwrap();
                    comm.barrier().unwrap();
                    if r == 0 {
                        assert_holds(&d, &b, &rf[1], w, r);
                    }
                    comm.barrier().unwrap();
                }
            },
        );
        std::fs::remove_dir_all(dir).unwrap();
        for d in refs {
            std::fs::remove_dir_all(d).unwrap();
        }
    }
}
