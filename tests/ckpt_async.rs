//! Async saves (`fo::ckpt::save_async`): the files are byte-identical to a synchronous
//! save of the state as of the call while steps, set_state and loads run during the
//! save; the copy-on-write pool stays within its budget; failures surface at wait and
//! leave the previous checkpoint; the optimizer's lifecycle waits for the writer.
mod ckpt_util;
mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::time::{Duration, Instant};

use ckpt_util::{config, global, spec, tmp, Buf};
use fo::ckpt::stage_dir;
use fo::ckpt::{
    load, local_shard, save_async, save_async_held, save_optimizer, save_optimizer_comm,
    Checkpoint, LoadOptions, Mode, ParamsAs, SaveOptions,
};
use fo::error::Error;
use fo::optim::{OptimConfig, Optimizer, StateFormat};
use fo::shard::ShardSpec;
use fo::tensor::TensorView;
use fo::{DType, Tensor};

/// Uneven shards on 2 and 4 ranks (1001 rows, 517 rows, a strided shard, a replicated
/// norm), large enough that the writer is still at work when the next step starts.
const BIG: [(&str, &[usize], &str); 6] = [
    ("emb.weight", &[1001, 67], "S0"),
    ("fc1.weight", &[517, 129], "S0"),
    ("fc1.bias", &[517], "S0"),
    ("fc2.weight", &[333, 65], "SS0:2"),
    ("norm.weight", &[67], "R"),
    ("head.weight", &[129, 97], "S0"),
];

struct Big {
    opt: Optimizer,
    params: Vec<Buf>,
    specs: Vec<ShardSpec>,
    dtype: DType,
}

impl Big {
    fn new(world: usize, rank: usize, cfg: &OptimConfig, dtype: DType) -> Big {
        let mut opt = Optimizer::new(cfg.clone()).unwrap();
        let (mut params, mut specs) = (Vec::new(), Vec::new());
        for (k, (fqn, shape, pl)) in BIG.iter().enumerate() {
            let s = spec(shape, pl, world, rank);
            let mut b = Buf::new(local_shard(&global(dtype, shape, k as f32), &s));
            unsafe { opt.add_param(fqn, b.view(), Some(s.clone()), 0).unwrap() };
            params.push(b);
            specs.push(s);
        }
        Big {
            opt,
            params,
            specs,
            dtype,
        }
    }

    fn step(&mut self, t: usize) {
        self.step_some(t, &|_| true)
    }

    /// A step where only the parameters `which` selects have gradients (the others are
    /// left alone, as a frozen layer is).
    fn step_some(&mut self, t: usize, which: &dyn Fn(usize) -> bool) {
        let mut grads: Vec<Buf> = BIG
            .iter()
            .zip(&self.specs)
            .enumerate()
            .map(|(k, ((_, shape, _), s))| {
                Buf::new(local_shard(
                    &global(self.dtype, shape, 100.0 + (t * 10 + k) as f32),
                    s,
                ))
            })
            .collect();
        let views: Vec<Option<TensorView>> = grads
            .iter_mut()
            .enumerate()
            .map(|(k, g)| which(k).then(|| g.view()))
            .collect();
        unsafe { self.opt.step(&views).unwrap() };
    }

    /// Overwrites parameter `i`'s `exp_avg` (a set_state during the save).
    fn set_exp_avg(&mut self, i: usize, seed: f32) {
        let shape = self.specs[i].local_shape().to_vec();
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|j| (j as f32 * 0.37 + seed).cos() * 1e-3)
            .collect();
        let t = Tensor::from_f32(shape, &v).unwrap();
        self.opt.set_states(i, &[("exp_avg".into(), t)]).unwrap();
    }
}

fn options(rank: usize, world: usize, id: &str) -> SaveOptions {
    let mut o = SaveOptions::new(rank, world, Mode::Compressed);
    o.save_id = id.into();
    o.params = Some(ParamsAs::Stored);
    o
}

/// Every visible file of `a` equals `b`'s, byte for byte (and they name the same files).
fn assert_same_files(a: &Path, b: &Path) {
    let list = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| !n.starts_with('.'))
            .collect();
        v.sort();
        v
    };
    let names = list(a);
    assert_eq!(
        names,
        list(b),
        "{} and {} hold different files",
        a.display(),
        b.display()
    );
    assert!(names.iter().any(|n| n.ends_with(".safetensors")));
    for n in names {
        let (x, y) = (
            std::fs::read(a.join(&n)).unwrap(),
            std::fs::read(b.join(&n)).unwrap(),
        );
        assert!(
            x == y,
            "{n} differs between {} and {}",
            a.display(),
            b.display()
        );
    }
}

/// Per rank: a synchronous save into `sync`, then an async save of the same state into
/// `asy` while two steps, a set_state and a load run; returns the parameters copied.
fn save_both_ways(world: usize, cfg: &OptimConfig, dtype: DType, budget: usize, tag: &str) -> u64 {
    let (sync, asy) = (
        tmp(&format!("async-sync-{tag}")),
        tmp(&format!("async-{tag}")),
    );
    let mut ranks: Vec<Big> = (0..world).map(|r| Big::new(world, r, cfg, dtype)).collect();
    for b in &mut ranks {
        b.step(0);
        b.step(1);
    }
    let mut copies = 0;
    for (r, b) in ranks.iter_mut().enumerate() {
        save_optimizer(&b.opt, &sync, &options(r, world, "s")).unwrap();
        // Rank 0's writer is held until its steps are done, so at least one step always
        // meets a save in flight (the others race their writers, as in training).
        let mut save = match r {
            0 => save_async_held(&mut b.opt, &asy, &options(r, world, "s"), None, budget),
            _ => save_async(&mut b.opt, &asy, &options(r, world, "s"), None, budget),
        }
        .unwrap();
        b.step(2);
        b.set_exp_avg(0, r as f32);
        b.step(3);
        if r == world - 1 {
            // A load while a save is in flight changes state the save still reads (the
            // sync save is committed once the last rank has written it).
            load(&mut b.opt, &sync, &LoadOptions::default()).unwrap();
        }
        b.set_exp_avg(BIG.len() - 1, 7.0);
        save.hold_writer(false);
        save.wait(None, None).unwrap();
        let st = save.stats();
        assert!(st.staging_high_water <= st.staging_budget, "{st:?}");
        assert_eq!(st.bytes_written, st.bytes_total, "{st:?}");
        copies += st.copies;
    }
    assert_same_files(&asy, &sync);
    for d in [sync, asy] {
        std::fs::remove_dir_all(d).unwrap();
    }
    copies
}

#[test]
fn async_save_is_byte_identical_to_a_sync_save_while_steps_and_set_state_run() {
    let mut copies = 0;
    for (format, bits, dtype, name) in [
        (StateFormat::Quant8, 24, DType::BF16, "q8m24"),
        (StateFormat::Fp32, 0, DType::F32, "fp32"),
        (StateFormat::Fp32, 24, DType::BF16, "fp32m24"),
    ] {
        for world in [2, 4] {
            copies += save_both_ways(
                world,
                &config(format, bits),
                dtype,
                0,
                &format!("{name}-{world}"),
            );
        }
    }
    // The steps ran while the writer was at work: the snapshot copied state for them.
    assert!(copies > 0, "no step ever met a save in flight");
}

/// Steps without pause (alternately half the parameters, then all) from the moment an
/// async save starts until its writer is done, many times over with pools from tiny
/// (every copy waits for the writer) to the default: each file is the state at its call,
/// byte for byte. The writer reads the live state of parameters the step does not touch
/// while the step holds the optimizer mutably (the aliasing invariant on
/// `live_reader::LiveReader`).
#[test]
fn steps_running_without_pause_during_many_saves_never_change_what_they_write() {
    let mut stepped_during = 0;
    for (format, bits, dtype) in [
        (StateFormat::Quant8, 24, DType::BF16),
        (StateFormat::Fp32, 0, DType::F32),
    ] {
        let cfg = config(format, bits);
        let mut b = Big::new(1, 0, &cfg, dtype);
        b.step(0);
        let mut t = 1;
        for (round, budget) in [4096, 200_000, 0, 4096, 1 << 20, 0].into_iter().enumerate() {
            let id = format!("r{round}");
            let (sync, asy) = (
                tmp(&format!("async-stress-sync-{round}")),
                tmp(&format!("async-stress-{round}")),
            );
            save_optimizer(&b.opt, &sync, &options(0, 1, &id)).unwrap();
            let mut save = save_async(&mut b.opt, &asy, &options(0, 1, &id), None, budget).unwrap();
            while !save.is_done() {
                let half = t % 2;
                b.step_some(t, &|k| t % 3 == 0 || k % 2 == half);
                t += 1;
                stepped_during += 1;
            }
            save.wait(None, None).unwrap();
            let st = save.stats();
            assert!(st.staging_high_water <= st.staging_budget, "{st:?}");
            assert_same_files(&asy, &sync);
            for d in [sync, asy] {
                std::fs::remove_dir_all(d).unwrap();
            }
        }
    }
    assert!(stepped_during > 0, "no step ran while a save was in flight");
}

#[test]
fn held_writer_makes_every_step_copy_first_and_the_file_is_still_the_call_state() {
    let cfg = config(StateFormat::Quant8, 24);
    let (sync, asy) = (tmp("async-held-sync"), tmp("async-held"));
    let mut b = Big::new(2, 1, &cfg, DType::BF16);
    b.step(0);
    save_optimizer(&b.opt, &sync, &options(1, 2, "h")).unwrap();
    let mut other = Big::new(2, 0, &cfg, DType::BF16);
    other.step(0);
    save_optimizer(&other.opt, &sync, &options(0, 2, "h")).unwrap();
    let mut save = save_async_held(&mut b.opt, &asy, &options(1, 2, "h"), None, 0).unwrap();
    b.step(1);
    b.set_exp_avg(2, 3.0);
    // Every parameter this rank writes was copied before the step (norm.weight is
    // replicated: rank 0 writes it, so rank 1's save never needs it).
    assert_eq!(
        save.stats().copies,
        BIG.len() as u64 - 1,
        "{:?}",
        save.stats()
    );
    assert!(!save.is_done());
    save.hold_writer(false);
    save.wait(None, None).unwrap();
    save_optimizer(&other.opt, &asy, &options(0, 2, "h")).unwrap();
    assert_same_files(&asy, &sync);
    for d in [sync, asy] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn staging_never_exceeds_its_budget_and_a_full_pool_waits_for_the_writer() {
    let cfg = config(StateFormat::Fp32, 0);
    let (sync, asy) = (tmp("async-budget-sync"), tmp("async-budget"));
    let mut b = Big::new(1, 0, &cfg, DType::F32);
    b.step(0);
    save_optimizer(&b.opt, &sync, &options(0, 1, "b")).unwrap();
    // One param's largest state (emb.weight: 1001x67 f32 param + exp_avg + exp_avg_sq)
    // fits; two do not.
    let budget = 1001 * 67 * 4 * 3 + 64;
    let mut save = save_async_held(&mut b.opt, &asy, &options(0, 1, "b"), None, budget).unwrap();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let save = &save;
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            save.hold_writer(false);
        });
        b.step(1); // fills the pool, then waits for the writer to drain it
    });
    assert!(
        t0.elapsed() >= Duration::from_millis(150),
        "the step did not wait"
    );
    save.wait(None, None).unwrap();
    let st = save.stats();
    assert!(st.copies > 0 && st.staging_high_water > 0, "{st:?}");
    assert!(st.staging_high_water <= budget as u64, "{st:?}");
    assert_eq!(st.staging_budget, budget as u64);
    assert_same_files(&asy, &sync);
    for d in [sync, asy] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn the_default_budget_holds_every_copy_so_no_step_waits_for_the_writer() {
    let cfg = config(StateFormat::Quant8, 24);
    let (sync, asy) = (tmp("async-default-sync"), tmp("async-default"));
    let mut b = Big::new(1, 0, &cfg, DType::BF16);
    b.step(0);
    save_optimizer(&b.opt, &sync, &options(0, 1, "d")).unwrap();
    let state: u64 = (0..b.opt.num_params())
        .map(|i| b.opt.state_bytes(i).unwrap() as u64)
        .sum();
    // The writer is held: a step that had to wait for it would never finish.
    let mut save = save_async_held(&mut b.opt, &asy, &options(0, 1, "d"), None, 0).unwrap();
    let (stepped, released) = (AtomicBool::new(false), AtomicBool::new(false));
    std::thread::scope(|s| {
        let (save, stepped, released) = (&save, &stepped, &released);
        s.spawn(move || {
            let t0 = Instant::now();
            while !stepped.load(SeqCst) && t0.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(5));
            }
            released.store(true, SeqCst);
            save.hold_writer(false);
        });
        b.step(1);
        assert!(
            !released.load(SeqCst),
            "the step waited for the held writer"
        );
        stepped.store(true, SeqCst);
    });
    save.wait(None, None).unwrap();
    let st = save.stats();
    // Every parameter was copied before the writer took anything: the pool held every
    // copy the save could need (the stored state, plus the bf16 elements its masters are
    // rebuilt from), which is the default budget.
    assert_eq!(st.copies, b.opt.num_params() as u64, "{st:?}");
    assert_eq!(st.staging_high_water, st.staging_budget, "{st:?}");
    let elements: u64 = (0..b.opt.num_params())
        .map(|i| b.opt.param(i).nbytes() as u64)
        .sum();
    assert_eq!(st.staging_budget, state + elements, "{st:?}");
    assert_same_files(&asy, &sync);
    for d in [sync, asy] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn a_background_write_error_surfaces_at_wait_and_leaves_the_previous_checkpoint() {
    let cfg = config(StateFormat::Quant8, 24);
    let dir = tmp("async-fault");
    let mut b = Big::new(1, 0, &cfg, DType::BF16);
    b.step(0);
    save_optimizer(&b.opt, &dir, &options(0, 1, "first")).unwrap();
    let before: Vec<u8> =
        std::fs::read(dir.join("shard-00001-model-00001-of-00001.safetensors")).unwrap();
    // The save's staging directory cannot be created: a file holds its name.
    let blocked = stage_dir(&dir, "second");
    std::fs::write(&blocked, b"in the way").unwrap();
    b.step(1);
    let mut save = save_async(&mut b.opt, &dir, &options(0, 1, "second"), None, 0).unwrap();
    b.step(2);
    let e = save.wait(Some(Duration::from_secs(60)), None).unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");
    assert!(
        e.to_string().contains(&blocked.display().to_string()),
        "{e}"
    );
    // Waiting again reports the same failure.
    assert_eq!(
        save.wait(None, None).unwrap_err().to_string(),
        e.to_string()
    );
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.meta.as_ref().unwrap().save_id, "first");
    fo::ckpt::verify(&dir, &mut |_, _| {}).unwrap();
    assert_eq!(
        std::fs::read(dir.join("shard-00001-model-00001-of-00001.safetensors")).unwrap(),
        before
    );
    let mut fresh = Big::new(1, 0, &cfg, DType::BF16);
    load(&mut fresh.opt, &dir, &LoadOptions::default()).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_wait_times_out_while_the_writer_is_held_and_succeeds_later() {
    let cfg = config(StateFormat::Fp32, 0);
    let dir = tmp("async-timeout");
    let mut b = Big::new(1, 0, &cfg, DType::F32);
    b.step(0);
    let mut save = save_async_held(&mut b.opt, &dir, &options(0, 1, "t"), None, 0).unwrap();
    let e = save
        .wait(Some(Duration::from_millis(50)), None)
        .unwrap_err();
    assert!(matches!(e, Error::Timeout(_)), "{e}");
    assert!(e.to_string().contains("still being written"), "{e}");
    save.hold_writer(false);
    save.wait(Some(Duration::from_secs(60)), None).unwrap();
    assert_eq!(Checkpoint::open(&dir).unwrap().meta.unwrap().save_id, "t");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn add_param_is_refused_and_dropping_the_optimizer_waits_while_a_save_reads_it() {
    let cfg = config(StateFormat::Fp32, 0);
    let (sync, asy) = (tmp("async-life-sync"), tmp("async-life"));
    let mut b = Big::new(1, 0, &cfg, DType::F32);
    b.step(0);
    save_optimizer(&b.opt, &sync, &options(0, 1, "l")).unwrap();
    let mut save = save_async_held(&mut b.opt, &asy, &options(0, 1, "l"), None, 0).unwrap();
    let mut extra = Buf::new(global(DType::F32, &[8], 1.0));
    let e = unsafe { b.opt.add_param("late", extra.view(), None, 0) }.unwrap_err();
    assert!(e.to_string().contains("async checkpoint save"), "{e}");
    let Big { opt, params, .. } = b;
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let save = &save;
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            save.hold_writer(false);
        });
        drop(opt); // waits for the writer to let go of the state
    });
    assert!(
        t0.elapsed() >= Duration::from_millis(150),
        "the drop did not wait"
    );
    save.wait(None, None).unwrap();
    drop(params);
    assert_same_files(&asy, &sync);
    for d in [sync, asy] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn a_second_save_waits_for_the_first_and_both_hold_their_call_state() {
    let cfg = config(StateFormat::Quant8, 24);
    let dirs: Vec<_> = ["a", "b", "sa", "sb"]
        .iter()
        .map(|n| tmp(&format!("async-two-{n}")))
        .collect();
    let mut b = Big::new(1, 0, &cfg, DType::BF16);
    b.step(0);
    save_optimizer(&b.opt, &dirs[2], &options(0, 1, "x")).unwrap();
    let mut first = save_async(&mut b.opt, &dirs[0], &options(0, 1, "x"), None, 0).unwrap();
    b.step(1);
    save_optimizer(&b.opt, &dirs[3], &options(0, 1, "y")).unwrap();
    let mut second = save_async(&mut b.opt, &dirs[1], &options(0, 1, "y"), None, 0).unwrap();
    b.step(2);
    second.wait(None, None).unwrap();
    first.wait(None, None).unwrap();
    assert_same_files(&dirs[0], &dirs[2]);
    assert_same_files(&dirs[1], &dirs[3]);
    for d in dirs {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn async_saves_through_a_communicator_commit_at_wait_like_the_sync_save() {
    for world in [2, 4] {
        let (sync, asy) = (
            tmp(&format!("async-comm-sync-{world}")),
            tmp(&format!("async-comm-{world}")),
        );
        let (s2, a2) = (sync.clone(), asy.clone());
        common::run_ranks(
            common::group(world, 60.0),
            Duration::from_secs(120),
            move |comm| {
                let r = comm.rank();
                let cfg = config(StateFormat::Quant8, 24);
                let mut b = Big::new(world, r, &cfg, DType::BF16);
                b.step(0);
                save_optimizer_comm(&b.opt, &s2, &options(r, world, "c"), &comm).unwrap();
                let mut save =
                    save_async(&mut b.opt, &a2, &options(r, world, "c"), Some(&comm), 0).unwrap();
                b.step(1);
                b.set_exp_avg(1, 2.0);
                // Not committed before the wait: the commit collective runs there.
                save.wait(None, Some(&comm)).unwrap();
            },
        );
        assert_same_files(&asy, &sync);
        // A failure on one rank fails every rank's wait, and nothing is committed.
        let blocked = stage_dir(&asy, "d");
        std::fs::write(&blocked, b"in the way").unwrap();
        let a3 = asy.clone();
        let errs = common::run_ranks(
            common::group(world, 60.0),
            Duration::from_secs(120),
            move |comm| {
                let r = comm.rank();
                let mut b = Big::new(world, r, &config(StateFormat::Fp32, 0), DType::F32);
                b.step(0);
                let mut save =
                    save_async(&mut b.opt, &a3, &options(r, world, "d"), Some(&comm), 0).unwrap();
                b.step(1);
                save.wait(None, Some(&comm)).unwrap_err().to_string()
            },
        );
        for e in &errs {
            assert!(e.contains(&blocked.display().to_string()), "{e}");
        }
        assert_eq!(Checkpoint::open(&asy).unwrap().meta.unwrap().save_id, "c");
        for d in [sync, asy] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }
}

#[test]
fn lent_state_is_copied_at_the_call_so_writes_through_a_share_never_reach_the_save() {
    let cfg = config(StateFormat::Fp32, 0);
    let (sync, asy) = (tmp("async-lent-sync"), tmp("async-lent"));
    let mut b = Big::new(1, 0, &cfg, DType::F32);
    b.step(0);
    save_optimizer(&b.opt, &sync, &options(0, 1, "l")).unwrap();
    // A borrower (fo.torch's state_dict()) holds exp_avg of param 1 live.
    let share = b.opt.share_state(1, "exp_avg").unwrap();
    let mut save = save_async_held(&mut b.opt, &asy, &options(0, 1, "l"), None, 0).unwrap();
    assert!(save.stats().device_staged > 0, "{:?}", save.stats());
    // Written behind fo's back while the writer has not read anything yet.
    // SAFETY: the share keeps the buffer alive; nothing else runs on the optimizer.
    unsafe { std::slice::from_raw_parts_mut(share.as_ptr(), share.len()).fill(7.0) };
    save.hold_writer(false);
    save.wait(None, None).unwrap();
    assert_same_files(&asy, &sync);
    drop(share);
    for d in [sync, asy] {
        std::fs::remove_dir_all(d).unwrap();
    }
}
