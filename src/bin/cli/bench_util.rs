//! Measurement helpers of the `fo bench` and `fo selftest` commands: deterministic inputs,
//! the best-of-N timing rule, and one timed optimizer step loop.
use std::time::Instant;

use fo::optim::{OptimConfig, Optimizer, StateFormat};
use fo::{DType, TensorView};

/// Deterministic, well-scaled pseudo-random values (no subnormals, no infinities).
pub fn fill(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

/// The fastest of the timed steps: on a shared machine interference only ever adds time,
/// so the minimum is the most repeatable estimate of what the code itself costs.
pub fn best(v: Vec<f64>) -> f64 {
    v.into_iter().fold(f64::INFINITY, f64::min)
}

/// The bytes of a benchmark's params or grads: bf16 for the compressed step, else f32.
fn param_bytes(v: &[f32], compressed: bool) -> Vec<u8> {
    if compressed {
        v.iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect()
    } else {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
}

/// `best_step` of `cfg` over parameters of `sizes` elements (parameter `i` named
/// `name(i)`), from `fill`'s values: bf16 parameters and gradients for the compressed
/// step (`cfg`'s state format), else f32 ones with fp32 state and no master weights.
pub fn step_time_over(
    mut cfg: OptimConfig,
    sizes: &[usize],
    name: impl Fn(usize) -> String,
    compressed: bool,
    iters: usize,
) -> Result<f64, String> {
    if !compressed {
        cfg.state_format = StateFormat::Fp32;
        cfg.master_weight_bits = 0;
    }
    let dtype = if compressed { DType::BF16 } else { DType::F32 };
    let to_bytes = |v: Vec<f32>| param_bytes(&v, compressed);
    let mut params: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| to_bytes(fill(s, 10 + i as u64, 1.0)))
        .collect();
    let mut grads: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| to_bytes(fill(s, 1000 + i as u64, 0.02)))
        .collect();
    let mut opt = Optimizer::new(cfg).map_err(|e| e.to_string())?;
    let view = |b: &mut Vec<u8>| unsafe {
        TensorView::host(
            b.as_mut_ptr(),
            dtype,
            &[(b.len() / dtype.size()) as i64],
            None,
            "t",
        )
        .map_err(|e| e.to_string())
    };
    for (i, p) in params.iter_mut().enumerate() {
        unsafe {
            opt.add_param(&name(i), view(p)?, None, 0)
                .map_err(|e| e.to_string())?
        };
    }
    let gs: Vec<Option<TensorView>> = grads
        .iter_mut()
        .map(|g| view(g).map(Some))
        .collect::<Result<_, _>>()?;
    best_step(&mut opt, &gs, iters)
}

/// The best of `iters` timed steps, after one untimed warm-up step (it allocates the state).
fn best_step(opt: &mut Optimizer, gs: &[Option<TensorView>], iters: usize) -> Result<f64, String> {
    let mut times = Vec::new();
    for it in 0..=iters {
        let t0 = Instant::now();
        unsafe { opt.step(gs).map_err(|e| e.to_string())? };
        if it > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(best(times))
}
