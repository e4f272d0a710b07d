//! `fo bench step`'s arithmetic table: exact vs fast arithmetic for AdamW, Adam, Lion and
//! SGD (momentum) on bf16 params + bf16 grads + quant8 state + 24-bit masters, as ratios
//! to a same-run memory ceiling with the compressed step's byte pattern and to torch's
//! fused fp32 AdamW (`torch.optim.AdamW(fused=True)` on CPU, in a subprocess with the
//! same thread count and parameter count) when a python with torch is given.
use std::time::Instant;

use fo::optim::{set_num_threads, threads, Algorithm, Arithmetic, OptimConfig};
use rayon::prelude::*;

use super::bench_util::{best, fill, step_time_over};

/// The algorithms of the arithmetic table, as `fo bench step --algs` spells them.
pub const ALGS: [&str; 4] = ["adamw", "adam", "lion", "sgd"];

/// Bytes per parameter of the compressed step: bf16 p (read + write), bf16 g (read),
/// int8 m, uint8 v, int8 error bits (read + write each), and fp16 scales of m and v
/// (2 bytes per 32 elements each, read + write).
pub const BYTES12: f64 = 2.0 + 2.0 + 2.0 + 2.0 + 2.0 + 2.0 + 2.0 * 2.0 * 2.0 / 32.0;

/// What the table measures.
pub struct Opts {
    pub n: usize,
    pub threads: Vec<usize>,
    pub iters: usize,
    /// A python with torch (`--torch PY`, else `FO_TORCH_PYTHON`).
    pub torch: Option<String>,
    /// Algorithms to run (`--algs adamw,adam,lion,sgd`, all by default).
    pub algs: Vec<String>,
    /// Arithmetic modes to run (`--arithmetic exact,fast`).
    pub modes: Vec<Arithmetic>,
}

/// Seconds per pass of a no-math loop with the compressed step's memory pattern.
fn ceiling12(n: usize, iters: usize) -> Result<f64, String> {
    let pool = threads::pool().map_err(|e| e.to_string())?;
    let bf = |seed| -> Vec<u16> {
        fill(n, seed, 1.0)
            .iter()
            .map(|x| (x.to_bits() >> 16) as u16)
            .collect()
    };
    let bytes = |seed| -> Vec<u8> {
        fill(n, seed, 1.0)
            .iter()
            .map(|x| (x.to_bits() >> 12) as u8)
            .collect()
    };
    let (mut p, g) = (bf(1), bf(2));
    let (mut m, mut v, mut e) = (bytes(3), bytes(4), bytes(5));
    let (mut ms, mut vs) = (bf(6)[..n / 32].to_vec(), bf(7)[..n / 32].to_vec());
    const C: usize = 2048;
    let mut times = Vec::new();
    for it in 0..=iters {
        let t0 = Instant::now();
        pool.install(|| {
            p.par_chunks_mut(C)
                .zip(g.par_chunks(C))
                .zip(m.par_chunks_mut(C))
                .zip(v.par_chunks_mut(C))
                .zip(e.par_chunks_mut(C))
                .zip(ms.par_chunks_mut(C / 32).zip(vs.par_chunks_mut(C / 32)))
                .for_each(|(((((p, g), m), v), e), (ms, vs))| {
                    // Every stream is read and written (g read only), values rotated so
                    // nothing can be elided.
                    for i in 0..p.len() {
                        let (mi, vi, ei) = (m[i], v[i], e[i]);
                        p[i] ^= g[i];
                        m[i] = vi;
                        v[i] = ei;
                        e[i] = mi;
                    }
                    for (a, b) in ms.iter_mut().zip(vs.iter_mut()) {
                        std::mem::swap(a, b);
                    }
                })
        });
        std::hint::black_box((&p, &m, &v, &e));
        if it > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(best(times))
}

/// Seconds per step of `alg` over n params (one tensor) in the given format.
fn step_time(
    n: usize,
    alg: Algorithm,
    compressed: bool,
    arith: Arithmetic,
    iters: usize,
) -> Result<f64, String> {
    let mut cfg = OptimConfig::default_for(alg);
    if alg == Algorithm::Sgd {
        cfg.momentum = 0.9;
    }
    cfg.arithmetic = arith;
    step_time_over(cfg, &[n], |_| "w".into(), compressed, iters)
}

const TORCH_SCRIPT: &str = "
import sys, time, torch
n, iters, threads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
p = torch.nn.Parameter(torch.rand(n) - 0.5)
p.grad = (torch.rand(n) - 0.5) * 0.02
opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
opt.step()
best = float('inf')
for _ in range(iters):
    t0 = time.perf_counter(); opt.step(); best = min(best, time.perf_counter() - t0)
print(best)
";

/// torch's fused fp32 AdamW step time (best of `iters`), or why not.
fn torch_time(py: &str, n: usize, iters: usize, threads: usize) -> Result<f64, String> {
    let out = std::process::Command::new(py)
        .args([
            "-c",
            TORCH_SCRIPT,
            &n.to_string(),
            &iters.to_string(),
            &threads.to_string(),
        ])
        .output()
        .map_err(|e| format!("cannot run {py}: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!("{py} failed: {}", err.lines().last().unwrap_or("")));
    }
    let s = String::from_utf8_lossy(&out.stdout);
    s.trim().parse().map_err(|_| format!("{py} printed {s:?}"))
}

fn row(label: &str, n: usize, secs: f64, ceiling: f64, torch: Option<f64>) {
    let rate = n as f64 / secs;
    let vs_torch = torch.map_or("       -".to_string(), |t| format!("{:>7.2}x", t / secs));
    println!(
        "  {label:<34} {:>8.1} M params/s {:>6.2}x ceiling12 {vs_torch} torch",
        rate / 1e6,
        ceiling / secs
    );
}

pub fn run(o: &Opts) -> Result<(), String> {
    println!(
        "exact vs fast arithmetic, bf16 params/grads + quant8 + 24-bit masters, {} params, best of {} steps",
        o.n, o.iters
    );
    println!(
        "(ceiling12: same-run no-math loop over the compressed step's {BYTES12} B/param; torch: fused fp32 AdamW)"
    );
    let algs = [
        ("AdamW", Algorithm::AdamW),
        ("Adam", Algorithm::Adam),
        ("Lion", Algorithm::Lion),
        ("SGD momentum 0.9", Algorithm::Sgd),
    ];
    for &t in &o.threads {
        set_num_threads(t).map_err(|e| e.to_string())?;
        println!("threads {t}");
        let torch = match &o.torch {
            Some(py) => match torch_time(py, o.n, o.iters, t) {
                Ok(s) => Some(s),
                Err(e) => {
                    println!("  torch: {e}");
                    None
                }
            },
            None => None,
        };
        let c = ceiling12(o.n, o.iters)?;
        row("ceiling12 (no math)", o.n, c, c, torch);
        if let Some(ts) = torch {
            row("torch AdamW(fused=True) fp32", o.n, ts, c, torch);
        }
        let s = step_time(o.n, Algorithm::AdamW, false, Arithmetic::Exact, o.iters)?;
        row("fo fp32 AdamW", o.n, s, c, torch);
        for ((name, a), short) in algs.into_iter().zip(ALGS) {
            if !o.algs.iter().any(|x| x.eq_ignore_ascii_case(short)) {
                continue;
            }
            for &arith in &o.modes {
                let s = step_time(o.n, a, true, arith, o.iters)?;
                row(&format!("{name} {}", arith.name()), o.n, s, c, torch);
            }
        }
    }
    set_num_threads(0).map_err(|e| e.to_string())
}
