//! `fo bench step`: optimizer-step throughput (parameters/s and effective GB/s) for fp32
//! AdamW and bf16 + quant8 + 24-bit-master AdamW, next to a ceiling measured in the same
//! run: a loop with AdamW's memory pattern (read 4 f32 streams, write 3) and no math.
use std::time::Instant;

use fo::optim::{set_num_threads, threads, Algorithm, OptimConfig};
use rayon::prelude::*;

use super::args::{non_empty_csv, positive_f64, Bounded, Count, Csv, MAX_RANKS};
use super::bench_arith::ALGS;
use super::bench_util::{best, fill, step_time_over};

/// Thread counts: 1..=1024, the optimizer pool's limit.
type Threads = Bounded<1, MAX_RANKS>;

fn alg_list(s: &str) -> Result<Csv<String>, String> {
    let v: Csv<String> = non_empty_csv(s)?;
    for a in &v.0 {
        if !ALGS.contains(&a.to_lowercase().as_str()) {
            return Err(format!(
                "unknown algorithm {a:?}: expected one of {}",
                ALGS.join(", ")
            ));
        }
    }
    Ok(v)
}

fn arith_list(s: &str) -> Result<Csv<String>, String> {
    let v: Csv<String> = non_empty_csv(s)?;
    for m in &v.0 {
        fo::optim::Arithmetic::from_name(m)
            .map_err(|_| format!("unknown arithmetic {m:?}: expected exact or fast"))?;
    }
    Ok(v)
}

/// Bytes moved per parameter: fp32 AdamW reads p, g, m, v and writes p, m, v (4 bytes
/// each); the compressed step reads bf16 p and g, int8 m, uint8 v, int8 error bits and
/// writes p, m, v, error bits, plus 2 fp16 scales per 32 elements each way.
const FP32_BYTES: f64 = 28.0;
const COMPRESSED_BYTES: f64 = 2.0 + 2.0 + 3.0 + 2.0 + 3.0 + 2.0 * 4.0 / 32.0;

/// Seconds per pass of the no-math AdamW memory pattern over n elements.
fn ceiling(n: usize, iters: usize) -> Result<f64, String> {
    let pool = threads::pool().map_err(|e| e.to_string())?;
    let (mut p, g, mut m, mut v) = (
        fill(n, 1, 1.0),
        fill(n, 2, 1.0),
        fill(n, 3, 1.0),
        fill(n, 4, 1.0),
    );
    let mut times = Vec::new();
    for it in 0..=iters {
        let t0 = Instant::now();
        pool.install(|| {
            p.par_chunks_mut(4096)
                .zip(g.par_chunks(4096))
                .zip(m.par_chunks_mut(4096))
                .zip(v.par_chunks_mut(4096))
                .for_each(|(((p, g), m), v)| {
                    for i in 0..p.len() {
                        // p is read (as the optimizer reads it), m and v swap through it.
                        let (pi, mi, vi) = (p[i], m[i], v[i]);
                        p[i] = g[i];
                        m[i] = vi;
                        v[i] = if mi == pi { pi } else { mi };
                    }
                })
        });
        std::hint::black_box(&p);
        if it > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(best(times))
}

/// Seconds per optimizer step over `n` parameters split into `tensors` tensors.
fn step_time(n: usize, tensors: usize, compressed: bool, iters: usize) -> Result<f64, String> {
    let mut cfg = OptimConfig::default_for(Algorithm::AdamW);
    cfg.lr = 1e-3;
    let sizes: Vec<usize> = (0..tensors)
        .map(|i| n / tensors + usize::from(i < n % tensors))
        .collect();
    let name = |i| format!("layers.{i}.weight");
    step_time_over(cfg, &sizes, name, compressed, iters)
}

fn row(label: &str, n: usize, secs: f64, bytes: f64, ceiling_rate: f64) {
    let rate = n as f64 / secs;
    println!(
        "  {label:<36} {:>9.1} M params/s {:>7.1} GB/s {:>7.2}x ceiling",
        rate / 1e6,
        rate * bytes / 1e9,
        rate / ceiling_rate
    );
}

#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:
  fo bench step                              1M, 16M, 64M params on 1 and 2 threads, then exact vs fast
  fo bench step --sizes 16M --threads 2 --only compressed
  fo bench step --only arith --torch ~/.cache/fo/torch-venv/bin/python --threads 1,2")]
pub struct StepArgs {
    /// Parameter counts, comma-separated (K and M suffixes) [default: 1M,16M,64M; the
    /// arithmetic table uses the largest, 16M unless given].
    #[arg(long, value_name = "N,..", value_parser = non_empty_csv::<Count>)]
    pub sizes: Option<Csv<Count>>,
    /// Thread counts (1..=1024) to run each size on, comma-separated [default: 1,2; the
    /// arithmetic table: 1].
    #[arg(long, value_name = "T,..", value_parser = non_empty_csv::<Threads>)]
    pub threads: Option<Csv<Threads>>,
    /// The largest size is also run split into this many tensors (1: not split).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub tensors: u32,
    /// Parameters stepped per case in total (sets the number of timed steps, 3..=50).
    #[arg(long, default_value_t = 6.4e8, value_parser = positive_f64)]
    pub iters_params: f64,
    /// Run only one table (profiling one kernel): fp32, compressed, or arith (exact vs fast).
    #[arg(long, default_value = "all", value_parser = ["all", "fp32", "compressed", "arith"])]
    pub only: String,
    /// A python with torch for the fused fp32 AdamW baseline [default: $FO_TORCH_PYTHON].
    #[arg(long, value_name = "PYTHON")]
    pub torch: Option<String>,
    /// Arithmetic table: best of this many timed steps (1..=100000).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub iters: u32,
    /// Arithmetic table: algorithms, comma-separated (adamw, adam, lion, sgd).
    #[arg(long, default_value = "adamw,adam,lion,sgd", value_name = "A,..", value_parser = alg_list)]
    pub algs: Csv<String>,
    /// Arithmetic table: modes, comma-separated (exact, fast).
    #[arg(long, default_value = "exact,fast", value_name = "M,..", value_parser = arith_list)]
    pub arithmetic: Csv<String>,
}

pub fn run(a: &StepArgs) -> Result<(), String> {
    let sizes: Vec<usize> = match &a.sizes {
        Some(s) => s.0.iter().map(|c| c.0).collect(),
        None => vec![1 << 20, 16 << 20, 64 << 20],
    };
    let thread_counts: Vec<usize> = a
        .threads
        .as_ref()
        .map_or(vec![1, 2], |t| t.0.iter().map(|x| x.0).collect());
    let tensors = a.tensors as usize;
    let budget = a.iters_params;
    let only = a.only.as_str();
    let largest = sizes.iter().copied().max().unwrap_or(1);
    if tensors > largest {
        return Err(format!(
            "--tensors {tensors}: more tensors than the largest --sizes value ({largest} params)"
        ));
    }
    // fp32 AdamW holds params, grads and two moments (16 B/param) plus its fill buffers.
    let flag = a.sizes.as_ref().map_or("fo bench step".to_string(), |_| {
        format!("--sizes {largest}")
    });
    super::mem::check_memory((largest as u64).checked_mul(20), &flag)?;
    if only == "arith" {
        return super::bench_arith::run(&arith_opts(a, &sizes)?);
    }
    let (fp32, comp) = (only != "compressed", only != "fp32");
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("fo bench step on {cpu} ({cores} cores available)");
    println!("AdamW, best step time; params/s, effective GB/s, and the ratio to the ceiling measured just before");
    println!("(ceiling: same-run loop reading 4 f32 streams and writing 3, no math; fp32 moves {FP32_BYTES} B/param, compressed {COMPRESSED_BYTES} B/param)");
    for &t in &thread_counts {
        set_num_threads(t).map_err(|e| e.to_string())?;
        for &n in &sizes {
            // Enough steps for a stable estimate without long runs: ~budget params in total.
            let iters = ((budget / n as f64) as usize).clamp(3, 50);
            println!("threads {t}, {n} params ({iters} timed steps, best of them)");
            let largest = n == *sizes.iter().max().unwrap() && tensors > 1;
            let mut cases: Vec<(String, usize, bool)> = Vec::new();
            if fp32 {
                cases.push(("fp32 AdamW, 1 tensor".into(), 1, false));
                if largest {
                    cases.push((format!("fp32 AdamW, {tensors} tensors"), tensors, false));
                }
            }
            if comp {
                cases.push(("bf16+quant8+24-bit AdamW, 1 tensor".into(), 1, true));
                if largest {
                    cases.push((
                        format!("bf16+quant8+24 AdamW, {tensors} tensors"),
                        tensors,
                        true,
                    ));
                }
            }
            for (label, k, compressed) in cases {
                // The ceiling is re-measured right before each case, so each ratio compares
                // two measurements taken under the same machine conditions.
                let c = ceiling(n, iters)?;
                let cr = n as f64 / c;
                row("  ceiling (4 reads + 3 writes, f32)", n, c, FP32_BYTES, cr);
                let bytes = if compressed {
                    COMPRESSED_BYTES
                } else {
                    FP32_BYTES
                };
                row(&label, n, step_time(n, k, compressed, iters)?, bytes, cr);
            }
        }
    }
    set_num_threads(0).map_err(|e| e.to_string())?;
    if only == "all" {
        super::bench_arith::run(&arith_opts(a, &sizes)?)?;
    }
    Ok(())
}

/// The arithmetic table's options: the largest `--sizes` (16M unless given), `--threads`
/// (1 unless given), `--torch PY` (else `FO_TORCH_PYTHON`), `--iters N` (best of N).
fn arith_opts(a: &StepArgs, sizes: &[usize]) -> Result<super::bench_arith::Opts, String> {
    Ok(super::bench_arith::Opts {
        n: if a.sizes.is_some() {
            sizes.iter().copied().max().unwrap_or(1 << 24)
        } else {
            1 << 24
        },
        threads: a
            .threads
            .as_ref()
            .map_or(vec![1], |t| t.0.iter().map(|x| x.0).collect()),
        iters: a.iters as usize,
        modes: a
            .arithmetic
            .0
            .iter()
            .map(|m| fo::optim::Arithmetic::from_name(m).map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?,
        algs: a.algs.0.clone(),
        torch: a
            .torch
            .clone()
            .or_else(|| std::env::var("FO_TORCH_PYTHON").ok()),
    })
}
