//! `fo demo`: a real small training run that exercises the whole library, then checks
//! its own results (non-zero exit when a check fails, so it doubles as a test).
//!
//! 1. reference: N ranks train a bf16 MLP FSDP2-style (AdamW, quant8 state, 24-bit
//!    masters), saving compressed and portable checkpoints halfway;
//! 2. restart on N ranks from the compressed checkpoint (same sharding: must be identical);
//! 3. restart on N-1 ranks, resharding the compressed checkpoint on load;
//! 4. restart on N-1 ranks from the consolidated portable checkpoint, which rank 0 reads
//!    and `broadcast_state_dict` scatters (each rank receives only its shard);
//! 5. the reference run again with the overlapped step (`step_begin`, gradients handed
//!    over layer by layer, `step_end` clipping): the same bits, and the exposed step time.
mod mlp;
mod rank;
mod restore;

use std::path::{Path, PathBuf};
use std::time::Instant;

use fo::comm::Comm;
use fo::Result;
use rank::{Rank, Setup};
use restore::Start;

/// What one phase's rank 0 reports back.
struct Trace {
    losses: Vec<f64>,
    step_ms: f64,
    /// Mean time from the last gradient ready to the step done (the whole clip + step
    /// when sequential; what `step_end` still had to do when overlapped).
    exposed_ms: f64,
    state_bytes_per_param: f64,
    broadcast: Option<restore::BroadcastReport>,
}

#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:
  fo demo                               4 ranks, 200 steps, checkpoints in a temporary directory
  fo demo --ranks 3 --steps 12 --out /tmp/fo-demo --keep")]
pub struct DemoArgs {
    /// In-process ranks of the reference run, 2..=64 (restarts use ranks - 1).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u8).range(2..=64))]
    pub ranks: u8,
    /// Optimizer steps, 12..=100000 (checkpoints are saved halfway; fewer steps cannot
    /// show the loss falling by the 10% the demo checks).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(12..=100_000))]
    pub steps: u32,
    /// Seed of the data and initial weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Directory for the checkpoints (kept), new or empty; default a temporary one,
    /// removed at the end. A failed or interrupted demo removes what it wrote there.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Keep the temporary checkpoint directory.
    #[arg(long)]
    pub keep: bool,
}

pub fn run(a: &DemoArgs) -> Result<(), String> {
    let (ranks, steps, seed) = (a.ranks as usize, a.steps as usize, a.seed);
    let (out, temp) = match &a.out {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("fo-demo-{}", std::process::id())),
            true,
        ),
    };
    if std::fs::read_dir(&out).is_ok_and(|mut d| d.next().is_some()) {
        return Err(format!(
            "--out {}: not empty; give a new or empty directory",
            out.display()
        ));
    }
    if out.exists() && !out.is_dir() {
        return Err(format!(
            "--out {}: exists and is not a directory",
            out.display()
        ));
    }
    // What this run creates: the directory (and missing parents), or, in an existing
    // empty one, its three subdirectories. A failure or an interruption removes them.
    let mut top = None;
    let mut p = out.as_path();
    while !p.as_os_str().is_empty() && !p.exists() {
        top = Some(p.to_path_buf());
        p = p.parent().unwrap_or(std::path::Path::new(""));
    }
    let ours: Vec<PathBuf> = match &top {
        Some(t) => vec![t.clone()],
        None => ["compressed", "portable", "consolidated"]
            .iter()
            .map(|n| out.join(n))
            .collect(),
    };
    let guards: Vec<_> = ours.iter().map(|p| super::cleanup::register(p)).collect();
    std::fs::create_dir_all(&out)
        .map_err(|e| format!("--out {}: cannot create it: {e}", out.display()))?;
    let result = demo(ranks, steps, seed, &out);
    if result.is_err() || (temp && !a.keep) {
        for p in &ours {
            super::cleanup::remove_path(p);
        }
    } else {
        println!("checkpoints kept in {}", out.display());
    }
    drop(guards);
    result
}

fn demo(ranks: usize, steps: usize, seed: u64, out: &Path) -> Result<(), String> {
    let numels: Vec<usize> = mlp::PARAMS.iter().map(|(_, s)| mlp::numel(s)).collect();
    let offloaded = fo::optim::plan_offload(&numels, 0.5).map_err(|e| e.to_string())?;
    let setup = Setup {
        seed,
        steps,
        batch: 64,
        lr: 1e-2,
        max_norm: 1.0,
        overlap: false,
        offloaded: offloaded.clone(),
    };
    let half = steps / 2;
    let e = |e: fo::Error| e.to_string();

    println!(
        "fo demo: 2-layer MLP (bf16 params {:?}), {ranks} ranks, {steps} steps, seed {seed}",
        numels
    );
    println!("AdamW with quant8 state and 24-bit master weights; offload planner (fraction 0.5) puts on the host:");
    for ((name, shape), off) in mlp::PARAMS.iter().zip(&offloaded) {
        println!(
            "  {name:<11} {:<9} {}",
            format!("{shape:?}"),
            if *off {
                "host (offloaded)"
            } else {
                "device group"
            }
        );
    }
    println!("(no GPU here: both groups step on the host; the split is what a hybrid optimizer would use)\n");

    println!("[1/5] reference run on {ranks} ranks, checkpoint at step {half}");
    let reference = phase(
        ranks,
        &setup,
        Start::Fresh(mlp::init_params(seed)),
        0..steps,
        Some((half, out)),
    )
    .map_err(e)?;
    println!("[2/5] restart on {ranks} ranks from the compressed checkpoint (same sharding)");
    let same = phase(
        ranks,
        &setup,
        Start::Checkpoint(out.join("compressed")),
        half..steps,
        None,
    )
    .map_err(e)?;
    println!(
        "[3/5] restart on {} ranks from the compressed checkpoint (resharded on load)",
        ranks - 1
    );
    let resharded = phase(
        ranks - 1,
        &setup,
        Start::Checkpoint(out.join("compressed")),
        half..steps,
        None,
    )
    .map_err(e)?;
    println!(
        "[4/5] restart on {} ranks: rank 0 reads the consolidated checkpoint, broadcast_state_dict scatters",
        ranks - 1
    );
    let consolidated = out.join("consolidated");
    fo::ckpt::consolidate(&out.join("portable"), &consolidated, &mut |_, _| {}).map_err(e)?;
    let broadcast = phase(
        ranks - 1,
        &setup,
        Start::Broadcast(consolidated),
        half..steps,
        None,
    )
    .map_err(e)?;
    println!("[5/5] the reference run again with the overlapped step (gradients handed over layer by layer)");
    let overlap_setup = Setup {
        overlap: true,
        ..setup.clone()
    };
    let overlapped = phase(
        ranks,
        &overlap_setup,
        Start::Fresh(mlp::init_params(seed)),
        0..steps,
        None,
    )
    .map_err(e)?;

    let mut checks = summary::report(
        &setup, ranks, out, &reference, &same, &resharded, &broadcast,
    )?;
    summary::report_overlap(&mut checks, &reference, &overlapped);
    if checks.iter().all(|(ok, _)| *ok) {
        println!("\nall {} checks passed", checks.len());
        Ok(())
    } else {
        let failed: Vec<&str> = checks
            .iter()
            .filter(|(ok, _)| !ok)
            .map(|(_, s)| s.as_str())
            .collect();
        Err(format!(
            "{} of {} checks failed: {}",
            failed.len(),
            checks.len(),
            failed.join("; ")
        ))
    }
}

mod summary;

/// Runs `world` ranks (one thread each) over `steps`, starting from `start`; every rank's
/// trace comes back, in rank order. With `save`, every rank checkpoints before step `save.0`.
fn phase(
    world: usize,
    setup: &Setup,
    start: Start,
    steps: std::ops::Range<usize>,
    save: Option<(usize, &Path)>,
) -> Result<Vec<Trace>> {
    let comms = Comm::local_group(world);
    let results: Vec<Result<Trace>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (start, steps) = (&start, steps.clone());
                s.spawn(move || run_rank(comm, setup, start, steps, save))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(fo::Error::Internal("a rank panicked".into())))
            })
            .collect()
    });
    results.into_iter().collect()
}

fn run_rank(
    comm: Comm,
    setup: &Setup,
    start: &Start,
    steps: std::ops::Range<usize>,
    save: Option<(usize, &Path)>,
) -> Result<Trace> {
    let init = match start {
        Start::Fresh(p) => p.clone(),
        _ => mlp::init_params(setup.seed), // overwritten by the restore below
    };
    let mut rank = Rank::new(comm, setup, &init)?;
    let broadcast = restore::restore(&mut rank, start)?;
    let report_every = (setup.steps / 10).max(1);
    let mut losses = Vec::new();
    let mut step_time = 0f64;
    let mut exposed = 0f64;
    let mut timed = 0usize;
    for step in steps {
        if let Some((at, dir)) = save {
            if step == at {
                restore::save_checkpoints(&rank, dir)?;
            }
        }
        let ts = Instant::now();
        let (loss, norm, exposed_s) = rank.step(setup, step)?;
        step_time += ts.elapsed().as_secs_f64();
        exposed += exposed_s;
        timed += 1;
        losses.push(loss);
        if rank.comm.rank() == 0 && (step % report_every == 0 || step + 1 == setup.steps) {
            println!(
                "  step {:>4}/{}  loss {:.6}  grad norm {:.4}  lr {:.2e}  step time {:.2} ms",
                step + 1,
                setup.steps,
                loss,
                norm,
                setup.lr_at(step),
                ts.elapsed().as_secs_f64() * 1e3
            );
        }
    }
    let numel = rank.local_numel().max(1);
    Ok(Trace {
        losses,
        step_ms: step_time * 1e3 / timed.max(1) as f64,
        exposed_ms: exposed * 1e3 / timed.max(1) as f64,
        state_bytes_per_param: rank.opt.total_state_bytes() as f64 / numel as f64,
        broadcast,
    })
}
