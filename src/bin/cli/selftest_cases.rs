//! What `fo selftest` compares: the rule x state format matrix, and the bit-for-bit count
//! of mismatching elements between two parameters' states (GPU against CPU).
//!
//! These serve the GPU half (selftest_gpu.rs, feature `cuda`); they are compiled and
//! unit-tested in every build, hence `allow(dead_code)` without the feature.
use fo::optim::math::state::{ErrorBits, Moment, ParamState};
use fo::optim::{Algorithm, OptimConfig, StateFormat};

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
    use fo::optim::math::state::Root;

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
        let a = st(Some(Moment::F32(vec![0.0, 1.0, f32::NAN].into())));
        assert_eq!(
            state_mismatches(&a, &a.clone()),
            0,
            "NaN equals its own bits"
        );
        let b = st(Some(Moment::F32(vec![-0.0, 1.0, f32::NAN].into())));
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
