//! Which parameters to keep on the host, by Megatron's HybridDeviceOptimizer rule.

/// Visits parameters in order and offloads while the offloaded numel is below
/// `fraction × total`; the parameter that crosses the threshold is included.
/// `fraction` is clamped to [0, 1]; a NaN fraction offloads nothing.
pub fn plan_offload(numels: &[usize], fraction: f64) -> Vec<bool> {
    // Sums in u128: sizes near i64::MAX must not wrap (a wrapped total plans nonsense).
    let total: u128 = numels.iter().map(|&n| n as u128).sum();
    let limit = if fraction.is_nan() {
        0.0
    } else {
        fraction.clamp(0.0, 1.0)
    } * total as f64;
    let mut offloaded = 0u128;
    numels
        .iter()
        .map(|&n| {
            let take = (offloaded as f64) < limit;
            if take {
                offloaded += n as u128;
            }
            take
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_near_i64_max_do_not_wrap_the_total() {
        let big = i64::MAX as usize;
        assert_eq!(plan_offload(&[3, big, big], 0.5), vec![true, true, false]);
        assert_eq!(plan_offload(&[big, big, big], 1.0), vec![true, true, true]);
    }

    #[test]
    fn crossing_param_is_included_and_later_ones_are_not() {
        assert_eq!(
            plan_offload(&[10, 10, 10, 10], 0.5),
            vec![true, true, false, false]
        );
        assert_eq!(
            plan_offload(&[10, 10, 10, 10], 0.3),
            vec![true, true, false, false]
        );
        assert_eq!(
            plan_offload(&[10, 10, 10, 10], 0.25),
            vec![true, false, false, false]
        );
        assert_eq!(
            plan_offload(&[10, 10, 10, 10], 0.2),
            vec![true, false, false, false]
        );
        assert_eq!(plan_offload(&[5, 100, 1], 0.01), vec![true, false, false]);
        assert_eq!(plan_offload(&[5, 100, 1], 0.0), vec![false, false, false]);
        assert_eq!(plan_offload(&[5, 100, 1], 1.0), vec![true, true, true]);
        assert_eq!(plan_offload(&[], 0.5), Vec::<bool>::new());
    }
}
