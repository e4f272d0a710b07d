//! `fo selftest`: on a machine with a GPU, steps every rule x state format on the GPU and
//! on the CPU from the same inputs and counts mismatching elements (parameters and every
//! state buffer, bit for bit: must be 0), then times the GPU step against a
//! device-to-device copy of the same bytes in the same run. Without a GPU (a build
//! without feature `cuda`, no libcuda, no device) it says why and exits 0: there is
//! nothing to compare.
use fo::optim::state::{ErrorBits, Moment, ParamState};
use fo::optim::{Algorithm, OptimConfig, StateFormat};

use super::args::Count;

// The comparison helpers below serve the GPU half (selftest_gpu.rs, feature `cuda`); they
// are compiled and unit-tested in every build, hence `allow(dead_code)` without the feature.

#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:
  fo selftest                     GPU vs CPU bits for every rule x format, then GPU speed
  fo selftest --device 1 --size 16M")]
pub struct SelftestArgs {
    /// The CUDA device to test (>= 0).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i32).range(0..))]
    pub device: i32,
    /// Parameters per throughput case (K and M suffixes), in 64 equal tensors.
    #[arg(long, default_value = "64M")]
    pub size: Count,
    /// Timed steps per throughput case (the best one counts), 1..=100000.
    #[arg(long, default_value_t = 5,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    pub iters: usize,
}

pub fn run(a: &SelftestArgs) -> Result<(), String> {
    if let Some(why) = no_gpu() {
        println!("fo selftest: no GPU to test: {why}. Nothing compared (exit 0).");
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    return super::selftest_gpu::run(a);
    #[cfg(not(feature = "cuda"))]
    unreachable!("no_gpu() is Some without the cuda feature: {a:?}")
}

/// Why this process has no GPU to test (the machine or the build, not a failure of fo).
fn no_gpu() -> Option<String> {
    #[cfg(not(feature = "cuda"))]
    return Some("this fo was built without GPU support (rebuild with `--features cuda`)".into());
    #[cfg(feature = "cuda")]
    super::selftest_gpu::no_gpu()
}

/// The rules the self-test runs: every algorithm and the options that change its
/// arithmetic (L2 vs decoupled decay, momentum, dampening, Nesterov).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) fn rules() -> Vec<(&'static str, OptimConfig)> {
    let base = |a: Algorithm, lr: f64, wd: f64| {
        let mut c = OptimConfig::default_for(a);
        (c.lr, c.initial_lr, c.weight_decay) = (lr, lr, wd);
        c
    };
    let mut sgd_m = base(Algorithm::Sgd, 1e-2, 0.0);
    (sgd_m.momentum, sgd_m.dampening) = (0.9, 0.1);
    let mut nesterov = base(Algorithm::Sgd, 1e-2, 5e-3);
    (nesterov.momentum, nesterov.nesterov) = (0.8, true);
    let mut sgdw = base(Algorithm::SgdW, 1e-2, 0.1);
    sgdw.momentum = 0.9;
    vec![
        ("adamw", base(Algorithm::AdamW, 1e-2, 0.1)),
        ("adam_l2", base(Algorithm::Adam, 1e-2, 0.5)),
        ("sgd", base(Algorithm::Sgd, 1e-2, 0.0)),
        ("sgd_momentum_dampening", sgd_m),
        ("sgd_nesterov_l2", nesterov),
        ("sgdw_momentum", sgdw),
        ("lion", base(Algorithm::Lion, 1e-3, 0.1)),
    ]
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) const FORMATS: [StateFormat; 4] = [
    StateFormat::Fp32,
    StateFormat::ParamDtype,
    StateFormat::Quant8,
    StateFormat::Quant8Wide,
];

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn diff<T: Copy, B: PartialEq>(a: &[T], b: &[T], bits: impl Fn(T) -> B) -> usize {
    if a.len() != b.len() {
        return a.len().max(b.len());
    }
    a.iter()
        .zip(b)
        .filter(|(x, y)| bits(**x) != bits(**y))
        .count()
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn moment_mismatches(a: &Option<Moment>, b: &Option<Moment>) -> usize {
    let f16 = |x: half::f16| x.to_bits();
    match (a, b) {
        (None, None) => 0,
        (Some(Moment::F32(x)), Some(Moment::F32(y))) => diff(x, y, f32::to_bits),
        (Some(Moment::Half(h, x)), Some(Moment::Half(k, y))) if h == k => diff(x, y, |v| v),
        (
            Some(Moment::Signed { codes, scales }),
            Some(Moment::Signed {
                codes: c,
                scales: s,
            }),
        ) => diff(codes, c, |v| v) + diff(scales, s, f16),
        (
            Some(Moment::Unsigned {
                codes,
                scales,
                root,
            }),
            Some(Moment::Unsigned {
                codes: c,
                scales: s,
                root: r,
            }),
        ) if root == r => diff(codes, c, |v| v) + diff(scales, s, f16),
        // Different formats: every element differs.
        (x, y) => {
            let n = |m: &Option<Moment>| m.as_ref().map_or(0, Moment::numel);
            n(x).max(n(y)).max(1)
        }
    }
}

/// Elements that differ between two states, bit for bit (a step counter or a
/// momentum-validity flag that differs counts as one).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) fn state_mismatches(a: &ParamState, b: &ParamState) -> usize {
    let errs = match (&a.error_bits, &b.error_bits) {
        (None, None) => 0,
        (Some(ErrorBits::I8(x)), Some(ErrorBits::I8(y))) => diff(x, y, |v| v),
        (Some(ErrorBits::I16(x)), Some(ErrorBits::I16(y))) => diff(x, y, |v| v),
        (x, y) => {
            let n = |e: &Option<ErrorBits>| e.as_ref().map_or(0, |e| e.nbytes());
            n(x).max(n(y)).max(1)
        }
    };
    moment_mismatches(&a.m, &b.m)
        + moment_mismatches(&a.v, &b.v)
        + errs
        + usize::from(a.step != b.step)
        + usize::from(a.m_valid != b.m_valid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fo::optim::state::Root;

    fn st(m: Option<Moment>) -> ParamState {
        ParamState {
            step: 2,
            m,
            v: None,
            error_bits: Some(ErrorBits::I8(vec![1, 2, 3])),
            m_valid: true,
        }
    }

    #[test]
    fn mismatches_count_elements_bit_for_bit() {
        let a = st(Some(Moment::F32(vec![0.0, 1.0, f32::NAN])));
        assert_eq!(
            state_mismatches(&a, &a.clone()),
            0,
            "NaN equals its own bits"
        );
        let b = st(Some(Moment::F32(vec![-0.0, 1.0, f32::NAN])));
        assert_eq!(state_mismatches(&a, &b), 1, "-0 is not 0");
        let mut c = b.clone();
        c.step = 3;
        c.error_bits = Some(ErrorBits::I8(vec![1, 2, 4]));
        assert_eq!(state_mismatches(&b, &c), 2);
        let q = |code: u8| {
            st(Some(Moment::Unsigned {
                codes: vec![code; 40],
                scales: vec![half::f16::ONE; 2],
                root: Root::Sqrt,
            }))
        };
        assert_eq!(state_mismatches(&q(3), &q(4)), 40);
        assert_eq!(
            state_mismatches(&q(3), &a),
            40,
            "different formats differ everywhere"
        );
    }

    #[test]
    fn every_algorithm_and_format_is_covered() {
        let r = rules();
        for a in Algorithm::ALL {
            assert!(r.iter().any(|(_, c)| c.algorithm == a), "{a:?}");
        }
        assert!(r.iter().all(|(_, c)| c.validate().is_ok()));
        assert_eq!(FORMATS.len(), 4);
    }
}
