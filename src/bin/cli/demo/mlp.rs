//! The demo's model: a 2-layer MLP (`fc1` -> ReLU -> `fc2`) learning a fixed random
//! teacher network on synthetic inputs, with hand-written forward and backward passes.
//! Sizes are chosen so no weight divides evenly by 3 or 4 ranks, and so `fc2` (5 rows)
//! leaves rank 3 of 4 an empty shard.

/// SplitMix64: a tiny deterministic generator, so every run and rank count sees the
/// same data for the same global sample index.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

pub const INPUT: usize = 64;
pub const HIDDEN: usize = 509;
pub const OUTPUT: usize = 5;

/// Parameter names and shapes, in registration order (torch's FQNs).
pub const PARAMS: [(&str, &[usize]); 4] = [
    ("fc1.weight", &[HIDDEN, INPUT]),
    ("fc1.bias", &[HIDDEN]),
    ("fc2.weight", &[OUTPUT, HIDDEN]),
    ("fc2.bias", &[OUTPUT]),
];

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Initial parameters (f32; the demo stores them as bf16), scaled like torch's Linear init.
pub fn init_params(seed: u64) -> Vec<Vec<f32>> {
    let mut rng = Rng::new(seed);
    PARAMS
        .iter()
        .map(|(name, shape)| {
            let fan_in = if name.starts_with("fc1") {
                INPUT
            } else {
                HIDDEN
            };
            let bound = 1.0 / (fan_in as f64).sqrt();
            (0..numel(shape))
                .map(|_| ((rng.uniform() * 2.0 - 1.0) * bound) as f32)
                .collect()
        })
        .collect()
}

/// Input and target of one global sample: the same for any rank count.
pub fn sample(seed: u64, step: usize, index: usize, teacher: &[Vec<f32>]) -> (Vec<f32>, Vec<f32>) {
    let mut rng = Rng::new(seed.wrapping_mul(1_000_003) ^ ((step as u64) << 20) ^ index as u64);
    let x: Vec<f32> = (0..INPUT).map(|_| rng.normal() as f32).collect();
    let (y, _) = forward(teacher, &x);
    (x, y)
}

/// Returns the output and the hidden pre-activations (for backward).
fn forward(p: &[Vec<f32>], x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (w1, b1, w2, b2) = (&p[0], &p[1], &p[2], &p[3]);
    let pre: Vec<f32> = (0..HIDDEN)
        .map(|j| b1[j] + (0..INPUT).map(|i| w1[j * INPUT + i] * x[i]).sum::<f32>())
        .collect();
    let y = (0..OUTPUT)
        .map(|k| {
            b2[k]
                + (0..HIDDEN)
                    .map(|j| w2[k * HIDDEN + j] * pre[j].max(0.0))
                    .sum::<f32>()
        })
        .collect();
    (y, pre)
}

/// Adds to `grads` the gradient of `scale * sum_k (y_k - t_k)^2 / OUTPUT` and returns
/// the unscaled squared-error term, for one sample.
pub fn backward(p: &[Vec<f32>], x: &[f32], t: &[f32], scale: f32, grads: &mut [Vec<f32>]) -> f64 {
    let (y, pre) = forward(p, x);
    let dy: Vec<f32> = (0..OUTPUT)
        .map(|k| scale * 2.0 * (y[k] - t[k]) / OUTPUT as f32)
        .collect();
    let loss: f64 = (0..OUTPUT)
        .map(|k| ((y[k] - t[k]) as f64).powi(2))
        .sum::<f64>()
        / OUTPUT as f64;
    let mut dh = vec![0f32; HIDDEN];
    for k in 0..OUTPUT {
        grads[3][k] += dy[k];
        for j in 0..HIDDEN {
            grads[2][k * HIDDEN + j] += dy[k] * pre[j].max(0.0);
            dh[j] += dy[k] * p[2][k * HIDDEN + j];
        }
    }
    for j in 0..HIDDEN {
        if pre[j] <= 0.0 {
            continue;
        }
        grads[1][j] += dh[j];
        for i in 0..INPUT {
            grads[0][j * INPUT + i] += dh[j] * x[i];
        }
    }
    loss
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backward_matches_finite_differences() {
        let p = init_params(3);
        let teacher = init_params(99);
        let (x, t) = sample(5, 0, 0, &teacher);
        let mut g: Vec<Vec<f32>> = p.iter().map(|v| vec![0.0; v.len()]).collect();
        backward(&p, &x, &t, 1.0, &mut g);
        let loss_at = |q: &[Vec<f32>]| {
            let mut scratch: Vec<Vec<f32>> = q.iter().map(|v| vec![0.0; v.len()]).collect();
            backward(q, &x, &t, 1.0, &mut scratch)
        };
        for (pi, idx) in [(0usize, 7usize), (1, 3), (2, 40), (3, 1)] {
            let h = 1e-3f32;
            let mut plus = p.clone();
            plus[pi][idx] += h;
            let mut minus = p.clone();
            minus[pi][idx] -= h;
            let fd = (loss_at(&plus) - loss_at(&minus)) / (2.0 * h as f64);
            let an = g[pi][idx] as f64;
            assert!(
                (fd - an).abs() <= 1e-2 * an.abs().max(1e-2),
                "param {pi}[{idx}]: fd {fd} vs analytic {an}"
            );
        }
    }

    #[test]
    fn samples_do_not_depend_on_who_draws_them() {
        let teacher = init_params(1);
        assert_eq!(sample(7, 3, 11, &teacher), sample(7, 3, 11, &teacher));
        assert_ne!(sample(7, 3, 11, &teacher).0, sample(7, 3, 12, &teacher).0);
    }
}
