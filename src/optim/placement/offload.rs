//! Which parameters to keep on the host, by Megatron's HybridDeviceOptimizer rule.
use crate::error::{Error, Result};

/// Visits parameters in order and offloads while the offloaded numel is below
/// `fraction × total`; the parameter that crosses the threshold is included.
/// A `fraction` outside [0, 1] (or NaN) is an error: clamping would hide a caller's
/// mistake (say a percentage) behind a plausible plan.
pub fn plan_offload(numels: &[usize], fraction: f64) -> Result<Vec<bool>> {
    if !(0.0..=1.0).contains(&fraction) {
        return Err(Error::invalid(
            "fraction",
            format!("{fraction} is outside [0, 1]"),
        ));
    }
    // Sums in u128: sizes near i64::MAX must not wrap (a wrapped total plans nonsense).
    let total: u128 = numels.iter().map(|&n| n as u128).sum();
    let limit = fraction * total as f64;
    let mut offloaded = 0u128;
    Ok(numels
        .iter()
        .map(|&n| {
            let take = (offloaded as f64) < limit;
            if take {
                offloaded += n as u128;
            }
            take
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_near_i64_max_do_not_wrap_the_total() {
        let big = i64::MAX as usize;
        assert_eq!(
            plan_offload(&[3, big, big], 0.5).unwrap(),
            vec![true, true, false]
        );
        assert_eq!(
            plan_offload(&[big, big, big], 1.0).unwrap(),
            vec![true, true, true]
        );
    }

    #[test]
    fn crossing_param_is_included_and_later_ones_are_not() {
        let cases: [(&[usize], f64, &[bool]); 8] = [
            (&[10, 10, 10, 10], 0.5, &[true, true, false, false]),
            (&[10, 10, 10, 10], 0.3, &[true, true, false, false]),
            (&[10, 10, 10, 10], 0.25, &[true, false, false, false]),
            (&[10, 10, 10, 10], 0.2, &[true, false, false, false]),
            (&[5, 100, 1], 0.01, &[true, false, false]),
            (&[5, 100, 1], 0.0, &[false, false, false]),
            (&[5, 100, 1], 1.0, &[true, true, true]),
            (&[], 0.5, &[]),
        ];
        for (numels, fraction, want) in cases {
            assert_eq!(
                plan_offload(numels, fraction).unwrap(),
                want,
                "{numels:?} at {fraction}"
            );
        }
    }

    #[test]
    fn fractions_outside_0_1_are_refused_not_clamped() {
        for f in [1.5, -0.1, f64::NAN, f64::INFINITY] {
            let e = plan_offload(&[1], f).unwrap_err();
            assert!(
                matches!(&e, crate::error::Error::InvalidArgument { name, .. } if name == "fraction"),
                "{f}: {e}"
            );
            assert!(e.to_string().contains("is outside [0, 1]"), "{e}");
        }
    }
}
