//! `fo bench clip`: `fo_clip_grad_norm` on host gradients (one rank), the norm alone and
//! norm + scale, against a copy of the same bytes measured in the same run (best of the
//! timed calls), so the ratio says how close the clip is to reading memory.
use std::time::Instant;

use fo::clip::clip_grad_norm;
use fo::comm::Comm;
use fo::{DType, TensorView};

use super::args::Count;
use super::bench_util::{best, fill};

#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:
  fo bench clip
  fo bench clip --size 64M --iters 5")]
pub struct ClipArgs {
    /// Gradient elements (K and M suffixes: 16M = 16 * 2^20).
    #[arg(long, default_value = "16M")]
    pub size: Count,
    /// Timed calls per case (1..=100000); the best is reported.
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub iters: u32,
}

fn time(iters: u32, mut f: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
    let mut t = Vec::new();
    for _ in 0..iters {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64());
    }
    Ok(best(t))
}

pub fn run(a: &ClipArgs) -> Result<(), String> {
    let n = a.size.0;
    // f32 values, their bytes, the gradient and the copy's destination: 16 B/element.
    super::mem::check_memory((n as u64).checked_mul(16), &format!("--size {n}"))?;
    let comm = Comm::local_group(1)
        .pop()
        .ok_or("cannot create a one-rank group")?;
    println!(
        "fo_clip_grad_norm on one rank, {n} elements, best of {} calls:",
        a.iters
    );
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let vals = fill(n, 3, 1.0);
        let f32s: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
        drop(vals);
        let mut g = fo::cast::cast(f32s, DType::F32, dtype, "bench").map_err(|e| e.to_string())?;
        let bytes = g.len();
        let mut dst = super::mem::try_vec(bytes, &format!("--size {n}"), |_| 0u8)?;
        let copy = time(a.iters, || {
            dst.copy_from_slice(std::hint::black_box(&g));
            Ok(())
        })?;
        // SAFETY: a view of `g`, alive and not otherwise used during the calls.
        let t = unsafe { TensorView::host(g.as_mut_ptr(), dtype, &[n as i64], None, "g") }
            .map_err(|e| e.to_string())?;
        let grads = [(t, true)];
        for (label, p, max_norm) in [
            ("norm p=2", 2.0, f64::MAX),
            ("norm p=1", 1.0, f64::MAX),
            ("norm p=inf", f64::INFINITY, f64::MAX),
            ("norm p=2 + scale", 2.0, 0.0),
        ] {
            let secs = time(a.iters, || {
                // SAFETY: the gradient's memory is `g` (see above).
                unsafe { clip_grad_norm(&comm, &grads, max_norm, p, false) }
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            })?;
            println!(
                "  {:<4} {label:<17} {:9.2} ms {:7.2} GB/s read = {:5.2}x a copy of the same bytes ({:.2} GB/s)",
                dtype.to_string(),
                secs * 1e3,
                bytes as f64 / secs / 1e9,
                copy / secs,
                bytes as f64 / copy / 1e9
            );
        }
    }
    Ok(())
}
