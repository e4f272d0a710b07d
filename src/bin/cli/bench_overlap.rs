//! `fo bench overlap`: the host step hidden behind backward. A model of `--layers` equal
//! bf16 layers (AdamW with 24-bit masters and quant8 state, fo's defaults, or fp32 state
//! with `--state-format fp32`: the largest undo records); a "backward" on the
//! calling thread produces each layer's gradient in reverse order with a fixed amount of
//! memory-touching work per layer (calibrated so backward takes about as long as the
//! step), while fo's pool (the other cores) steps. Per round, interleaved: the sequential
//! iteration (backward, then clip if any, then step) and the overlapped one
//! (`step_begin`, `grads_ready` after each layer, `step_end`), with no clipping, clipping
//! that does not trigger and clipping that triggers. Reported: medians [min-max] of the
//! iteration times, and the exposed step (last `grads_ready` returned -> `step_end`
//! returned) as a share of the sequential step.
//!
//! `--backward device` models a backward that runs elsewhere (a GPU's, as with FSDP2 and
//! `CPUOffloadPolicy`): the calling thread only waits while each layer's gradient is
//! made, so fo's pool has every core. `--backward launch` models a GPU's backward bound by
//! the host's kernel launches (measured so on an H200: fo.torch's hooks and torch's
//! launches keep the driving thread busy): the calling thread does a fixed amount of
//! arithmetic per layer, touching no memory, so that what stretches it is only losing its
//! core to fo's pool. `--backward-share` sets backward's length as a share of the step's
//! (every kind), or `--backward-ms` its length; `--pool` sets fo's pool (default: every core
//! but the calling thread's for `host`, every core otherwise).
use std::time::Instant;

use fo::clip::clip_grad_norm;
use fo::comm::Comm;
use fo::optim::overlap::{OverlapOptions, OverlapStats};
use fo::optim::{threads, Algorithm, OptimConfig, Optimizer, StateFormat};
use fo::{DType, TensorView};

use super::args::Count;
use super::bench_util::fill;

#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:
  fo bench overlap
  fo bench overlap --layers 32 --layer-size 512K --rounds 9
  fo bench overlap --state-format fp32
  fo bench overlap --backward device --backward-share 0.5
  fo bench overlap --backward launch --pool 1 --backward-ms 50")]
pub struct OverlapArgs {
    /// Equal layers in the model (16..=4096).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(16..=4096))]
    pub layers: u32,
    /// Elements per layer (K and M suffixes: 1M = 2^20), 1K..=64M.
    #[arg(long, default_value = "1M")]
    pub layer_size: Count,
    /// Interleaved rounds per case (1..=1000); medians and ranges are over them.
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub rounds: u32,
    /// The optimizer state's format: quant8 (8-bit moments, fo's default) or fp32 (f32
    /// moments, torch's layout: the largest undo records).
    #[arg(long, value_enum, default_value_t = Format::Quant8)]
    pub state_format: Format,
    /// Where backward runs: host (the calling thread's work) or device (a wait, as for a
    /// GPU's: fo's pool takes every core).
    #[arg(long, value_enum, default_value_t = Backward::Host, value_name = "WHERE")]
    pub backward: Backward,
    /// Backward's length as a share of the step's (0.05..=20).
    #[arg(long, default_value_t = 1.0, value_parser = share, value_name = "SHARE")]
    pub backward_share: f64,
    /// fo's pool threads (0..=1024; 0: every core but the calling thread's for `--backward
    /// host`, every core for `device` and `launch`).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1024))]
    pub pool: u32,
    /// Backward's length in ms, instead of a share of the step (0.1..=100000): runs at
    /// different `--pool` sizes then face the same backward.
    #[arg(long, value_parser = millis, value_name = "MS", conflicts_with = "backward_share")]
    pub backward_ms: Option<f64>,
}

fn millis(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    if !(0.1..=100_000.0).contains(&v) {
        return Err(format!("{v} is not in 0.1..=100000"));
    }
    Ok(v)
}

fn share(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    if !(0.05..=20.0).contains(&v) {
        return Err(format!("{v} is not in 0.05..=20"));
    }
    Ok(v)
}

/// Where the benchmark's backward runs. (Plain comments on the variants, as `Format`.)
#[derive(Debug, Clone, Copy, PartialEq, clap::ValueEnum)]
pub enum Backward {
    // Memory-touching sweeps on the calling thread.
    Host,
    // A wait on the calling thread: a GPU's backward, which leaves the host cores free.
    Device,
    // Arithmetic on the calling thread, no memory: a GPU's backward bound by launches.
    Launch,
}

/// The state formats the benchmark compares. (Plain comments on the variants: doc
/// comments would switch `--help` to its long layout, one line per default.)
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Format {
    // 8-bit moments, fp16 scale per 32: ~2.1 bytes of state per element.
    Quant8,
    // f32 moments: 8 bytes of state per element.
    Fp32,
}

impl Format {
    fn state_format(self) -> StateFormat {
        match self {
            Format::Quant8 => StateFormat::Quant8,
            Format::Fp32 => StateFormat::Fp32,
        }
    }

    /// Bytes per element of state plus error bits, and again for its undo record.
    fn state_bytes(self) -> u64 {
        match self {
            Format::Quant8 => 2 * 4,
            Format::Fp32 => 2 * 9,
        }
    }
}

/// The model: parameters, gradients (what backward writes) and backward's own buffer.
struct Model {
    opt: Optimizer,
    grads: Vec<Vec<u16>>,
    work: Vec<f32>,
    n: usize,
    /// `--backward device`: each layer's wait (the gradients were written once).
    wait: Option<std::time::Duration>,
    /// `--backward launch`: each layer's rounds of arithmetic (the gradients were written
    /// once).
    spin: Option<u64>,
}

/// `rounds` of dependent integer arithmetic on registers: CPU time that only the core
/// running it can give, and that memory traffic does not slow.
fn spin(rounds: u64) -> u64 {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..rounds {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    std::hint::black_box(x)
}

fn bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

impl Model {
    /// One layer's backward: `passes` memory-touching sweeps of its buffer, then its
    /// gradient (a function of the buffer, so the work cannot be skipped).
    fn backward_layer(&mut self, l: usize, passes: usize) {
        if let Some(w) = self.wait {
            // A device's backward: the host thread waits (asleep, so its core is fo's).
            std::thread::sleep(w);
            return;
        }
        if let Some(r) = self.spin {
            spin(r);
            return;
        }
        let w = &mut self.work;
        for _ in 0..passes {
            w.iter_mut().for_each(|x| *x = *x * 0.999_9 + 1e-4);
        }
        let s = 1e-3 * (1.0 + l as f32 / 16.0);
        for (g, x) in self.grads[l].iter_mut().zip(w.iter()) {
            *g = bf16((x - 0.5) * s);
        }
        std::hint::black_box(&self.grads[l]);
    }

    fn grad(&mut self, l: usize) -> TensorView {
        // SAFETY: the gradient buffers live as long as the model and are not resized.
        unsafe {
            TensorView::host(
                self.grads[l].as_mut_ptr() as *mut u8,
                DType::BF16,
                &[self.n as i64],
                None,
                "g",
            )
        }
        .expect("a valid view")
    }
}

fn median_range(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// Median [min, max] of each round's `a` over the same round's `b` (interleaved rounds).
fn ratios(a: &[f64], b: &[f64]) -> (f64, f64, f64) {
    median_range(a.iter().zip(b).map(|(x, y)| x / y).collect())
}

fn fmt_ms(v: &[f64]) -> String {
    let (m, lo, hi) = median_range(v.to_vec());
    format!("{:8.2} ms [{:.2}-{:.2}]", m * 1e3, lo * 1e3, hi * 1e3)
}

#[derive(Default)]
struct Case {
    backward: Vec<f64>,
    seq_step: Vec<f64>,
    seq_iter: Vec<f64>,
    ovl_iter: Vec<f64>,
    exposed: Vec<f64>,
    stats: Vec<OverlapStats>,
}

pub fn run(a: &OverlapArgs) -> Result<(), String> {
    let (layers, n) = (a.layers as usize, a.layer_size.0);
    if !(1024..=64 << 20).contains(&n) {
        return Err(format!("--layer-size {n} is outside 1K..=64M elements"));
    }
    // Per element: param 2 + grad 2 + its undo 2, state and its undo, and backward's 4
    // bytes per layer element.
    let need = (layers as u64 * n as u64)
        .checked_mul(6 + a.state_format.state_bytes())
        .and_then(|b| b.checked_add(4 * n as u64));
    super::mem::check_memory(need, &format!("--layers {layers} --layer-size {n}"))?;
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    // The gradients are not the host's work: written once, before the rounds.
    let device = a.backward != Backward::Host;
    let pool = match (a.pool, a.backward) {
        (0, Backward::Host) => cores.saturating_sub(1).max(1),
        (0, _) => cores,
        (n, _) => n as usize,
    };
    threads::set_num_threads(pool).map_err(|e| e.to_string())?;
    let mut params: Vec<Vec<u16>> = (0..layers)
        .map(|l| fill(n, 10 + l as u64, 1.0).into_iter().map(bf16).collect())
        .collect();
    let mut cfg = OptimConfig::default_for(Algorithm::AdamW);
    cfg.state_format = a.state_format.state_format();
    let mut opt = Optimizer::new(cfg).map_err(|e| e.to_string())?;
    for (l, p) in params.iter_mut().enumerate() {
        // SAFETY: `params` outlives the optimizer (dropped at the end of this function).
        unsafe {
            let t = TensorView::host(
                p.as_mut_ptr() as *mut u8,
                DType::BF16,
                &[n as i64],
                None,
                "p",
            )
            .map_err(|e| e.to_string())?;
            opt.add_param(&format!("layers.{l}.weight"), t, None, 0)
                .map_err(|e| e.to_string())?;
        }
    }
    let mut m = Model {
        opt,
        grads: (0..layers).map(|_| vec![0u16; n]).collect(),
        work: fill(n, 3, 1.0),
        n,
        wait: None,
        spin: None,
    };
    if device {
        // The gradients are written once: a device's backward writes them by DMA, not
        // with the host's cores.
        for l in 0..layers {
            m.backward_layer(l, 1);
        }
    }
    let comm = Comm::local_group(1)
        .pop()
        .ok_or("cannot create a one-rank group")?;
    // Calibration: the step alone, and one backward sweep, so backward ~= step.
    let gs: Vec<Option<TensorView>> = (0..layers).map(|l| Some(m.grad(l))).collect();
    let mut step_t = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        unsafe { m.opt.step(&gs) }.map_err(|e| e.to_string())?;
        step_t.push(t.elapsed().as_secs_f64());
    }
    let step_s = median_range(step_t).0;
    let backward_s = a
        .backward_ms
        .map_or(a.backward_share * step_s, |ms| ms * 1e-3);
    let layer_s = backward_s / layers as f64;
    let (passes, how) = if a.backward == Backward::Launch {
        // Calibrated with the pool idle: the rounds one core does in the layer's time.
        let probe = 1u64 << 22;
        let t = Instant::now();
        spin(probe);
        let rounds = (layer_s / t.elapsed().as_secs_f64() * probe as f64).max(1.0) as u64;
        m.spin = Some(rounds);
        (
            0,
            format!(
                "backward: {:.2} ms of arithmetic per layer on the calling thread (a launch-bound device's)",
                layer_s * 1e3
            ),
        )
    } else if device {
        m.wait = Some(std::time::Duration::from_secs_f64(layer_s));
        (
            0,
            format!(
                "backward: a {:.2} ms wait per layer on the calling thread (a device's)",
                layer_s * 1e3
            ),
        )
    } else {
        let t = Instant::now();
        m.backward_layer(0, 4);
        let sweep = t.elapsed().as_secs_f64() / 4.0;
        let passes = ((layer_s / sweep).round() as usize).max(1);
        (
            passes,
            format!("backward on the calling thread: {passes} sweeps/layer"),
        )
    };
    println!(
        "fo bench overlap: {layers} layers x {n} bf16 elements (AdamW, {} state, 24-bit masters); \
         {cores} cores, fo's pool {} thread(s); {how} (calibrated to {:.2} x the step's {:.1} ms); {} rounds",
        a.state_format.state_format().name(),
        threads::num_threads().map_err(|e| e.to_string())?,
        backward_s / step_s,
        step_s * 1e3,
        a.rounds
    );
    let cases = [
        ("no clipping", 0.0),
        ("clip, not triggering", 1e12),
        ("clip, triggering", 1e-6),
    ];
    let mut results: Vec<Case> = cases.iter().map(|_| Case::default()).collect();
    for _ in 0..a.rounds {
        for (c, &(_, max_norm)) in cases.iter().enumerate() {
            let r = &mut results[c];
            // Sequential: backward, then (clip and) step.
            let t0 = Instant::now();
            for l in (0..layers).rev() {
                m.backward_layer(l, passes);
            }
            let t1 = Instant::now();
            let gs: Vec<Option<TensorView>> = (0..layers).map(|l| Some(m.grad(l))).collect();
            if max_norm > 0.0 {
                let list: Vec<(TensorView, bool)> =
                    (0..layers).map(|l| (m.grad(l), false)).collect();
                unsafe { clip_grad_norm(&comm, &list, max_norm, 2.0, false) }
                    .map_err(|e| e.to_string())?;
            }
            unsafe { m.opt.step(&gs) }.map_err(|e| e.to_string())?;
            let t2 = Instant::now();
            r.backward.push((t1 - t0).as_secs_f64());
            r.seq_step.push((t2 - t1).as_secs_f64());
            r.seq_iter.push((t2 - t0).as_secs_f64());
            // Overlapped: each layer handed over as backward finishes it.
            let t0 = Instant::now();
            let opts = OverlapOptions {
                max_norm,
                ..OverlapOptions::default()
            };
            unsafe { m.opt.step_begin(opts) }.map_err(|e| e.to_string())?;
            for l in (0..layers).rev() {
                m.backward_layer(l, passes);
                let g = m.grad(l);
                unsafe { m.opt.grads_ready(&[l], &[g]) }.map_err(|e| e.to_string())?;
            }
            let t1 = Instant::now();
            let mut st = OverlapStats::default();
            unsafe { m.opt.step_end(Some(&comm), &mut st) }.map_err(|e| e.to_string())?;
            let t2 = Instant::now();
            r.ovl_iter.push((t2 - t0).as_secs_f64());
            r.exposed.push((t2 - t1).as_secs_f64());
            r.stats.push(st);
        }
    }
    for ((label, _), r) in cases.iter().zip(&results) {
        let (seq, _, _) = median_range(r.seq_step.clone());
        let (bwd, _, _) = median_range(r.backward.clone());
        let (p, plo, phi) = ratios(&r.exposed, &r.seq_step);
        let (oi, _, _) = median_range(r.ovl_iter.clone());
        let (q, qlo, qhi) = ratios(&r.ovl_iter, &r.seq_iter);
        let st = r.stats.last().copied().unwrap_or_default();
        println!("{label}:");
        println!("  backward            {}", fmt_ms(&r.backward));
        println!("  sequential step     {}", fmt_ms(&r.seq_step));
        println!("  sequential iter     {}", fmt_ms(&r.seq_iter));
        println!(
            "  overlapped iter     {}  = {:.3}x [{:.3}-{:.3}] the sequential iter, {:.2}x max(backward, step)",
            fmt_ms(&r.ovl_iter),
            q,
            qlo,
            qhi,
            oi / bwd.max(seq)
        );
        println!(
            "  exposed step        {}  = {:.1}% [{:.1}-{:.1}] of the sequential step",
            fmt_ms(&r.exposed),
            p * 100.0,
            plo * 100.0,
            phi * 100.0
        );
        println!(
            "  {} params stepped early, {} at step_end; undo high-water {:.1} MiB; rolled back {} params, {:.1} MiB in {:.2} ms (last round)",
            st.speculative,
            st.deferred,
            st.undo_high_water_bytes as f64 / (1 << 20) as f64,
            st.rolled_back,
            st.rolled_back_bytes as f64 / (1 << 20) as f64,
            st.rollback_ns as f64 / 1e6
        );
    }
    threads::set_num_threads(0).map_err(|e| e.to_string())?;
    drop(m);
    drop(params);
    Ok(())
}
