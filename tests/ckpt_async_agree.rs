//! Ranks that disagree in an async save through a communicator (issue 38, item 2): like
//! the synchronous save, the ranks agree on their argument checks before anything is
//! written, so every rank gets the first failing rank's error at once (not a collective
//! timeout elsewhere, not FO_ERR_INTERNAL), and nothing becomes visible.
mod ckpt_util;
mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ckpt_util::{config, tmp, Rank};
use fo::ckpt::{save_async, Checkpoint, Mode, SaveOptions};
use fo::error::Error;
use fo::optim::StateFormat;
use fo::DType;

fn options(rank: usize, world: usize, id: &str) -> SaveOptions {
    let mut o = SaveOptions::new(rank, world, Mode::Compressed);
    o.save_id = id.into();
    o
}

/// Runs one async save on each of 2 ranks (group timeout 20 s), `args(rank)` giving its
/// directory and options; returns each rank's error (start or wait) and how long it took.
fn two_ranks(
    args: fn(usize, &[PathBuf]) -> (PathBuf, SaveOptions),
    dirs: Vec<PathBuf>,
) -> Vec<(Error, Duration)> {
    common::run_ranks(
        common::group(2, 20.0),
        Duration::from_secs(60),
        move |comm| {
            let r = comm.rank();
            let mut m = Rank::new(2, r, config(StateFormat::Fp32, 0), DType::F32);
            m.step(0);
            let (dir, o) = args(r, &dirs);
            let t0 = Instant::now();
            let e = match save_async(&mut m.opt, &dir, &o, Some(&comm), 0) {
                Ok(mut s) => s.wait(None, Some(&comm)).expect_err("the save succeeded"),
                Err(e) => e,
            };
            (e, t0.elapsed())
        },
    )
}

#[test]
fn ranks_saving_into_different_dirs_fail_every_rank_naming_both() {
    let dirs = vec![tmp("agree-dir-0"), tmp("agree-dir-1")];
    let errs = two_ranks(|r, d| (d[r].clone(), options(r, 2, "s")), dirs.clone());
    for (r, (e, took)) in errs.iter().enumerate() {
        let m = e.to_string();
        assert!(
            matches!(e, Error::InvalidArgument { .. }),
            "rank {r}: {e:?}"
        );
        for d in &dirs {
            assert!(m.contains(&d.display().to_string()), "rank {r}: {m}");
        }
        assert!(*took < Duration::from_secs(10), "rank {r} took {took:?}");
    }
    for d in dirs {
        assert!(!d.exists(), "{} was written", d.display());
    }
}

#[test]
fn one_ranks_invalid_option_is_every_ranks_error_at_once() {
    let dirs = vec![tmp("agree-opt")];
    // Rank 1 claims to be rank 5 of 2: its own check fails before any collective.
    let errs = two_ranks(
        |r, d| (d[0].clone(), options(if r == 1 { 5 } else { 0 }, 2, "s")),
        dirs.clone(),
    );
    for (r, (e, took)) in errs.iter().enumerate() {
        let m = e.to_string();
        assert!(
            matches!(e, Error::InvalidArgument { .. }),
            "rank {r}: {e:?}"
        );
        assert!(
            m.contains("options.rank") && m.contains("(on rank 1)"),
            "rank {r}: {m}"
        );
        assert!(
            *took < Duration::from_secs(10),
            "rank {r} waited {took:?} (a timeout)"
        );
    }
    assert!(Checkpoint::open(&dirs[0]).is_err());
}

#[test]
fn ranks_naming_different_save_ids_or_modes_fail_every_rank() {
    let dirs = vec![tmp("agree-mode")];
    let errs = two_ranks(
        |r, d| {
            let mut o = options(r, 2, "s");
            if r == 1 {
                o.mode = Mode::Portable;
            }
            (d[0].clone(), o)
        },
        dirs.clone(),
    );
    for (r, (e, _)) in errs.iter().enumerate() {
        let m = e.to_string();
        assert!(
            matches!(e, Error::InvalidArgument { .. }) && m.contains("options.mode"),
            "rank {r}: {m}"
        );
    }
    let errs = two_ranks(
        |r, d| (d[0].clone(), options(r, 2, if r == 1 { "t" } else { "s" })),
        dirs.clone(),
    );
    for (r, (e, _)) in errs.iter().enumerate() {
        let m = e.to_string();
        assert!(
            matches!(e, Error::InvalidArgument { .. }) && m.contains("save_id"),
            "rank {r}: {m}"
        );
    }
    assert!(Checkpoint::open(&dirs[0]).is_err());
}
