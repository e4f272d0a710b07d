//! `fo bench ckpt --async`: an fp32 AdamW optimizer (one rank, 8 params) whose state is
//! `--size-mib`, saved synchronously and asynchronously in interleaved rounds
//! (alternating which goes first). Reported as medians: the async call's return time
//! against the synchronous save's time; `--steps` steps with the save in flight against
//! the same steps alone; the staging pool's high-water mark against its budget.
use std::path::Path;
use std::time::Instant;

use fo::ckpt::{save_async, save_optimizer, Mode, SaveOptions};
use fo::optim::{Algorithm, OptimConfig, Optimizer, StateFormat};
use fo::{DType, TensorView};

use super::bench_ckpt::{median, BenchCkptArgs};
use super::bench_dir::BenchDir;
use super::bench_util::fill;

const TENSORS: usize = 8;

fn view(b: &mut [f32]) -> Result<TensorView, String> {
    // SAFETY: the buffers outlive the optimizer (dropped after it in `run`).
    unsafe {
        TensorView::host(
            b.as_mut_ptr() as *mut u8,
            DType::F32,
            &[b.len() as i64],
            None,
            "t",
        )
    }
    .map_err(|e| e.to_string())
}

fn steps(opt: &mut Optimizer, gs: &[Option<TensorView>], n: usize) -> Result<f64, String> {
    let t0 = Instant::now();
    for _ in 0..n {
        unsafe { opt.step(gs) }.map_err(|e| e.to_string())?;
    }
    Ok(t0.elapsed().as_secs_f64())
}

fn fresh(dir: &Path) -> Result<(), String> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))
}

pub fn run(a: &BenchCkptArgs) -> Result<(), String> {
    // fp32 AdamW keeps exp_avg and exp_avg_sq: 8 bytes of state per parameter.
    let numel = (((a.size_mib as usize) << 20) / 8 / TENSORS).max(1);
    let state_bytes = (numel * TENSORS * 8) as u64;
    // In memory: params and grads (as large as the state), the state, the staging pool.
    let what = format!("--size-mib {}", a.size_mib);
    // The default pool (0) is as large as the state when memory allows.
    let pool = match a.staging_mib {
        0 => state_bytes,
        mib => (mib as u64) << 20,
    };
    super::mem::check_memory(
        state_bytes.checked_mul(2).and_then(|b| b.checked_add(pool)),
        &what,
    )?;
    let target = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    super::mem::check_disk(&target, state_bytes.checked_mul(2), &what)?;
    let (bench_dir, guards) = BenchDir::open(a.dir.as_deref(), 1, a.seed)?;
    let result = bench(a, &bench_dir.dir, numel, state_bytes);
    if !a.keep || result.is_err() {
        bench_dir.remove()?;
    }
    drop(guards);
    result
}

fn bench(a: &BenchCkptArgs, dir: &Path, numel: usize, state_bytes: u64) -> Result<(), String> {
    let mut cfg = OptimConfig::default_for(Algorithm::AdamW);
    cfg.state_format = StateFormat::Fp32;
    cfg.master_weight_bits = 0;
    let mut params: Vec<Vec<f32>> = (0..TENSORS)
        .map(|i| fill(numel, 10 + i as u64, 1.0))
        .collect();
    let mut grads: Vec<Vec<f32>> = (0..TENSORS)
        .map(|i| fill(numel, 1000 + i as u64, 0.02))
        .collect();
    let mut opt = Optimizer::new(cfg).map_err(|e| e.to_string())?;
    for (i, p) in params.iter_mut().enumerate() {
        unsafe { opt.add_param(&format!("layers.{i}.weight"), view(p)?, None, 0) }
            .map_err(|e| e.to_string())?;
    }
    let gs: Vec<Option<TensorView>> = grads
        .iter_mut()
        .map(|g| view(g).map(Some))
        .collect::<Result<_, _>>()?;
    steps(&mut opt, &gs, 1)?; // creates the state
    let budget = (a.staging_mib as usize) << 20;
    eprintln!(
        "fo bench ckpt --async: fp32 AdamW, {TENSORS} params x {numel} f32, state {:.2} GiB, {} steps in flight, dir {}",
        state_bytes as f64 / (1u64 << 30) as f64,
        a.steps,
        dir.display()
    );
    let (sync_dir, async_dir) = (dir.join("sync"), dir.join("async"));
    let (mut sync, mut call, mut total, mut alone, mut inflight) =
        (vec![], vec![], vec![], vec![], vec![]);
    let mut first = vec![];
    let (mut high, mut budget_seen, mut copies) = (0u64, 0u64, 0u64);
    for round in 0..a.rounds {
        let o = |id: &str| {
            let mut o = SaveOptions::new(0, 1, Mode::Compressed);
            o.save_id = format!("{id}-{round}");
            o
        };
        let sync_side = |opt: &mut Optimizer, sync: &mut Vec<f64>, alone: &mut Vec<f64>| {
            fresh(&sync_dir)?;
            let t0 = Instant::now();
            save_optimizer(opt, &sync_dir, &o("sync")).map_err(|e| e.to_string())?;
            sync.push(t0.elapsed().as_secs_f64());
            alone.push(steps(opt, &gs, a.steps as usize)?);
            Ok::<_, String>(())
        };
        let mut async_side = |opt: &mut Optimizer| {
            fresh(&async_dir)?;
            let t0 = Instant::now();
            let mut s = save_async(opt, &async_dir, &o("async"), None, budget)
                .map_err(|e| e.to_string())?;
            call.push(t0.elapsed().as_secs_f64());
            let f = steps(opt, &gs, 1)?;
            first.push(f);
            inflight.push(f + steps(opt, &gs, a.steps as usize - 1)?);
            s.wait(None, None).map_err(|e| e.to_string())?;
            total.push(t0.elapsed().as_secs_f64());
            let st = s.stats();
            (high, budget_seen) = (high.max(st.staging_high_water), st.staging_budget);
            copies += st.copies;
            Ok::<_, String>(())
        };
        if round % 2 == 0 {
            sync_side(&mut opt, &mut sync, &mut alone)?;
            async_side(&mut opt)?;
        } else {
            async_side(&mut opt)?;
            sync_side(&mut opt, &mut sync, &mut alone)?;
        }
    }
    let (s, c, t, al, inf) = (
        median(&sync),
        median(&call),
        median(&total),
        median(&alone),
        median(&inflight),
    );
    println!(
        "save call returns      async {:>9.3} ms   sync save {:>9.3} ms   call/sync {:.4}%",
        c * 1e3,
        s * 1e3,
        100.0 * c / s
    );
    println!(
        "{:>2} steps              in flight {:>7.3} s   alone {:>7.3} s   extra {:+.3} s = {:+.1}% of the sync save",
        a.steps,
        inf,
        al,
        inf - al,
        100.0 * (inf - al) / s
    );
    println!(
        "   of which the first   {:>7.3} s (it copies what the writer has not taken yet)",
        median(&first)
    );
    println!("async save end to end  {t:.3} s (call to wait's return, steps included)");
    println!(
        "staging high-water     {:.1} MiB of a {:.1} MiB budget ({} parameter copies over {} rounds)",
        high as f64 / (1u64 << 20) as f64,
        budget_seen as f64 / (1u64 << 20) as f64,
        copies,
        a.rounds
    );
    drop(opt);
    drop(params);
    Ok(())
}
