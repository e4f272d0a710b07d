//! Which entry of the step kernel a launch runs. fo_step.cuh compiles one path per common
//! AdamW format (its `fo_step_path`) besides the generic one, and one entry per path; an
//! entry holding one path needs fewer registers (NVRTC 13.2, sm_90: 43 to 60, p5 capped
//! at 48, against 117 for `fo_step_kernel`, which holds every path and picks each row's),
//! so more threads are resident. A launch whose rows all take one path runs that path's entry. The rule is
//! written twice, here and in `fo_step_path_of`; `host_kernel_tests` checks that both give
//! every combination of dtypes, formats and rule kinds the same path.
use super::step_table::{
    FoRule, FoStepTensor, MomentKind, RULE_FAST_ADAM, RULE_FLASH_ADAM, RULE_TORCH_ADAM,
};

/// The paths (`fo_step_path`): 0 is the generic one, run by `fo_step_kernel`.
pub const STEP_PATHS: u32 = 9;

/// `fo_step_path_of`: the path of row `t` under rule `r`.
pub fn row_path(t: &FoStepTensor, r: &FoRule) -> u32 {
    const F32: i32 = 0;
    const BF16: i32 = 2;
    if t.grad_dtype != t.param_dtype {
        return 0;
    }
    let (m, v) = (t.m_kind, t.v_kind);
    let f32_state = m == MomentKind::F32 as i32 && v == MomentKind::F32 as i32;
    let quant8 = m == MomentKind::Q8Signed as i32 && v == MomentKind::Q8Sqrt as i32;
    match (r.kind, t.param_dtype, t.error_bits_width) {
        (RULE_TORCH_ADAM, F32, 0) if f32_state => 1,
        (RULE_TORCH_ADAM, BF16, 0) if f32_state => 2,
        (RULE_FLASH_ADAM, F32, 0) if quant8 => 3,
        (RULE_FLASH_ADAM, BF16, 0) if quant8 => 4,
        (RULE_FLASH_ADAM, BF16, 8) if quant8 => 5,
        (RULE_FAST_ADAM, F32, 0) if quant8 => 6,
        (RULE_FAST_ADAM, BF16, 0) if quant8 => 7,
        (RULE_FAST_ADAM, BF16, 8) if quant8 => 8,
        _ => 0,
    }
}

/// The path a launch over `rows` runs: theirs when they all share one, else 0 (the
/// generic entry, which picks each row's).
pub fn launch_path(rows: &[FoStepTensor], r: &FoRule) -> u32 {
    let mut paths = rows.iter().map(|t| row_path(t, r));
    match paths.next() {
        Some(p) if paths.all(|q| q == p) => p,
        _ => 0,
    }
}

/// The kernel entry of `path`.
pub fn entry_name(path: u32) -> String {
    match path {
        0 => "fo_step_kernel".to_string(),
        p => format!("fo_step_kernel_p{p}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_is_in_the_kernel_source() {
        let src = include_str!("gpu/fo_step.cuh");
        for p in 0..STEP_PATHS {
            assert!(
                src.contains(&format!("FO_STEP_ENTRY({}, ", entry_name(p))),
                "{p}"
            );
        }
        assert!(!src.contains(&format!("FO_STEP_ENTRY({}, ", entry_name(STEP_PATHS))));
    }

    #[test]
    fn a_launch_takes_its_rows_common_path_or_the_generic_entry() {
        let row = |pd: i32, ew: i32| FoStepTensor {
            param_dtype: pd,
            grad_dtype: pd,
            error_bits_width: ew,
            m_kind: MomentKind::Q8Signed as i32,
            v_kind: MomentKind::Q8Sqrt as i32,
            ..FoStepTensor::default()
        };
        let r = FoRule {
            kind: RULE_FLASH_ADAM,
            ..FoRule::default()
        };
        assert_eq!(launch_path(&[row(2, 8), row(2, 8)], &r), 5);
        assert_eq!(launch_path(&[row(2, 8), row(2, 0)], &r), 0);
        assert_eq!(launch_path(&[row(0, 0)], &r), 3);
        assert_eq!(launch_path(&[], &r), 0);
    }
}
