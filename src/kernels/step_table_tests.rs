//! The step table's layout and contents, pinned against the kernel's C struct and
//! against the host rule each entry carries.
use std::mem::{align_of, offset_of, size_of};

use super::*;
use crate::optim::math::config::{Algorithm, OptimConfig, StateFormat};
use crate::optim::math::master_split::Half;

/// The numbers `table_layout()` in cpp_tests/test_gpu_kernels_host.cpp asserts for the
/// C++ structs: change one side, and the other fails.
#[test]
fn table_layout_matches_the_kernel() {
    assert_eq!(size_of::<FoRule>(), 68);
    assert_eq!(align_of::<FoRule>(), 4);
    assert_eq!(offset_of!(FoRule, nesterov), 12);
    assert_eq!(offset_of!(FoRule, l2), 16);
    assert_eq!(offset_of!(FoRule, bc2_sqrt), 48);
    assert_eq!(offset_of!(FoRule, wdamp), 64);
    assert_eq!(size_of::<FoStepTensor>(), 96);
    assert_eq!(align_of::<FoStepTensor>(), 8);
    let offsets = [
        offset_of!(FoStepTensor, param),
        offset_of!(FoStepTensor, grad),
        offset_of!(FoStepTensor, error_bits),
        offset_of!(FoStepTensor, m),
        offset_of!(FoStepTensor, m_scales),
        offset_of!(FoStepTensor, v),
        offset_of!(FoStepTensor, v_scales),
        offset_of!(FoStepTensor, numel),
        offset_of!(FoStepTensor, group_begin),
        offset_of!(FoStepTensor, param_dtype),
        offset_of!(FoStepTensor, grad_dtype),
        offset_of!(FoStepTensor, error_bits_width),
        offset_of!(FoStepTensor, m_kind),
        offset_of!(FoStepTensor, v_kind),
        offset_of!(FoStepTensor, _pad),
    ];
    assert_eq!(
        offsets,
        [0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 76, 80, 84, 88, 92]
    );
}

fn cfg(a: Algorithm, f: StateFormat, mw: u32) -> OptimConfig {
    let mut c = OptimConfig::default_for(a);
    c.state_format = f;
    c.master_weight_bits = mw;
    c
}

/// Fresh state as the optimizer creates it, for a parameter of `n` elements.
fn state(c: &OptimConfig, dt: DType, n: usize) -> ParamState {
    let mut opt = crate::optim::Optimizer::new(c.clone()).unwrap();
    let mut buf = vec![0u8; n.max(1) * dt.size()];
    let t = unsafe {
        crate::tensor::TensorView::host(buf.as_mut_ptr(), dt, &[n as i64], None, "p").unwrap()
    };
    unsafe { opt.add_param("p", t, None, 0).unwrap() };
    opt.new_state(0)
}

#[test]
fn mixed_group_table_has_every_field() {
    // (config, param dtype, grad dtype, numel, step): uneven sizes, every state format,
    // every master width, one empty tensor (left out), SGD with and without momentum.
    let mut sgd_m = cfg(Algorithm::Sgd, StateFormat::Quant8, 0);
    sgd_m.momentum = 0.9;
    sgd_m.nesterov = true;
    // One case a line (rustfmt would spread each over seven).
    #[rustfmt::skip]
    let cases = [
        (cfg(Algorithm::AdamW, StateFormat::Fp32, 0), DType::F32, DType::F32, 100, 3),
        (cfg(Algorithm::AdamW, StateFormat::Quant8, 24), DType::BF16, DType::F16, 33, 1),
        (cfg(Algorithm::Adam, StateFormat::ParamDtype, 32), DType::F16, DType::BF16, 0, 1),
        (cfg(Algorithm::Adam, StateFormat::ParamDtype, 32), DType::F16, DType::BF16, 64, 2),
        (cfg(Algorithm::Lion, StateFormat::Quant8Wide, 0), DType::BF16, DType::BF16, 7, 5),
        (cfg(Algorithm::AdamW, StateFormat::Quant8Wide, 24), DType::BF16, DType::F32, 95, 1),
        (cfg(Algorithm::SgdW, StateFormat::Fp32, 0), DType::F32, DType::F32, 1, 1),
        (sgd_m, DType::F16, DType::F16, 40, 1),
    ];
    let mut states: Vec<ParamState> = cases.iter().map(|c| state(&c.0, c.1, c.3)).collect();
    let entries: Vec<TableEntry> = cases
        .iter()
        .zip(states.iter_mut())
        .enumerate()
        .map(|(i, (c, st))| TableEntry {
            param: 0x1000 * (i as u64 + 1),
            param_dtype: c.1,
            grad: 0x100000 * (i as u64 + 1),
            grad_dtype: c.2,
            numel: c.3,
            state: StatePtrs::of_host(st),
            rule: Rule::new(&c.0, c.4),
            first: c.4 == 1,
        })
        .collect();
    let t = build_table(&entries).unwrap();
    assert_eq!(t.tensors.len(), 7, "the empty tensor is left out");
    // Launches cover consecutive rows; within one, `group_begin` runs from 0 and every
    // row's entry has the launch's rule and `first`.
    let (mut row_of, mut next, mut total) = (vec![usize::MAX; entries.len()], 0, 0);
    for l in &t.launches {
        assert_eq!(l.row, next);
        let mut begin = 0;
        for (k, x) in t.tensors[l.row..l.row + l.count].iter().enumerate() {
            let i = (x.param / 0x1000 - 1) as usize;
            row_of[i] = l.row + k;
            assert_eq!(x.group_begin, begin);
            begin += x.numel.div_ceil(32);
            assert_eq!(l.rule, FoRule::new(&entries[i].rule).unwrap());
            assert_eq!(l.first, entries[i].first);
        }
        assert_eq!(l.total_groups, begin);
        (next, total) = (next + l.count, total + begin);
    }
    assert_eq!(next, 7);
    // Groups: 100 -> 4, 33 -> 2, 64 -> 2, 7 -> 1, 95 -> 3, 1 -> 1, 40 -> 2.
    assert_eq!(total, 15);
    // No two launches have equal keys (equal rules share one launch).
    for (a, la) in t.launches.iter().enumerate() {
        for lb in &t.launches[a + 1..] {
            assert!(rule_bits(&la.rule) != rule_bits(&lb.rule) || la.first != lb.first);
        }
    }
    let kept: Vec<usize> = vec![0, 1, 3, 4, 5, 6, 7];
    let rows: Vec<&FoStepTensor> = kept.iter().map(|&i| &t.tensors[row_of[i]]).collect();
    let kinds: Vec<(i32, i32, i32)> = rows
        .iter()
        .map(|x| (x.m_kind, x.v_kind, x.error_bits_width))
        .collect();
    use MomentKind as K;
    assert_eq!(
        kinds,
        [
            (K::F32 as i32, K::F32 as i32, 0),
            (K::Q8Signed as i32, K::Q8Sqrt as i32, 8),
            (K::F16 as i32, K::F16 as i32, 16),
            (K::Q8Signed as i32, K::None as i32, 0),
            (K::Q8Signed as i32, K::Q8Fourth as i32, 8),
            (K::None as i32, K::None as i32, 0),
            (K::Q8Signed as i32, K::None as i32, 0),
        ]
    );
    for (x, &i) in rows.iter().zip(&kept) {
        let (e, st) = (&entries[i], &states[i]);
        assert_eq!((x.param, x.grad), (e.param, e.grad));
        assert_eq!(x.numel, cases[i].3 as u64);
        assert_eq!(x.param_dtype, cases[i].1.code());
        assert_eq!(x.grad_dtype, cases[i].2.code());
        // Addresses are the state's own buffers; scales only for quantized moments.
        let ptrs = StatePtrs::of_host(&mut st.clone());
        assert_eq!(x.m == 0, st.m.is_none());
        assert_eq!(x.v == 0, st.v.is_none());
        assert_eq!(x.m_scales != 0, matches!(st.m, Some(Moment::Signed { .. })));
        assert_eq!(
            x.v_scales != 0,
            matches!(st.v, Some(Moment::Unsigned { .. }))
        );
        assert_eq!(x.error_bits == 0, ptrs.error_bits_width == 0);
    }
    assert_eq!(rows[1].m, entries[1].state.m.unwrap().data);
    assert_eq!(rows[1].v_scales, entries[1].state.v.unwrap().scales);
    assert_eq!(rows[1].error_bits, entries[1].state.error_bits);
    assert_eq!(t.as_bytes().len(), 7 * 96);
}

/// One launch per distinct (rule, first): a group stepped together is one launch; a
/// parameter a step behind (it had no gradient once) gets its own, its rows after.
#[test]
fn entries_with_one_rule_share_one_launch() {
    let c = cfg(Algorithm::AdamW, StateFormat::Quant8, 24);
    let mut st: Vec<ParamState> = (0..3).map(|_| state(&c, DType::BF16, 40)).collect();
    let entry = |k: usize, st: &mut ParamState, step: u64| TableEntry {
        param: 0x1000 * (k as u64 + 1),
        param_dtype: DType::BF16,
        grad: 0x100000,
        grad_dtype: DType::BF16,
        numel: 40 + k,
        state: StatePtrs::of_host(st),
        rule: Rule::new(&c, step),
        first: step == 1,
    };
    let together: Vec<TableEntry> = st
        .iter_mut()
        .enumerate()
        .map(|(k, s)| entry(k, s, 4))
        .collect();
    let t = build_table(&together).unwrap();
    assert_eq!(t.launches.len(), 1);
    assert_eq!((t.launches[0].count, t.launches[0].total_groups), (3, 6));
    let behind: Vec<TableEntry> = st
        .iter_mut()
        .enumerate()
        .map(|(k, s)| entry(k, s, if k == 1 { 3 } else { 4 }))
        .collect();
    let t = build_table(&behind).unwrap();
    let params: Vec<u64> = t.tensors.iter().map(|x| x.param).collect();
    assert_eq!(params, [0x1000, 0x3000, 0x2000]);
    let l: Vec<(usize, usize, u64)> = t
        .launches
        .iter()
        .map(|l| (l.row, l.count, l.total_groups))
        .collect();
    assert_eq!(l, [(0, 2, 4), (2, 1, 2)]);
    assert_eq!(t.launches[1].rule, FoRule::new(&Rule::new(&c, 3)).unwrap());
    assert_eq!(t.tensors[2].group_begin, 0);
}

#[test]
fn rule_scalars_come_from_rule_new() {
    let mut c = cfg(Algorithm::Adam, StateFormat::Fp32, 0);
    c.weight_decay = 0.25;
    c.lr = 0.01;
    let r = FoRule::new(&Rule::new(&c, 3)).unwrap();
    let bc1 = 1.0 - 0.9f64.powi(3);
    let bc2 = 1.0 - 0.999f64.powi(3);
    assert_eq!((r.kind, r.has_l2, r.l2), (RULE_TORCH_ADAM, 1, 0.25));
    assert_eq!(r.lr, (-(0.01 / bc1)) as f32, "torch adam carries -lr/bc1");
    assert_eq!(r.bc2_sqrt, bc2.sqrt() as f32);
    assert_eq!((r.w1, r.b2, r.decay), (0.1f64 as f32, 0.999, 1.0));

    let c = cfg(Algorithm::AdamW, StateFormat::Quant8, 24);
    let r = FoRule::new(&Rule::new(&c, 2)).unwrap();
    assert_eq!(
        (r.kind, r.has_l2, r.b1, r.lr),
        (RULE_FLASH_ADAM, 0, 0.9, 1e-3)
    );
    assert_eq!(r.bc1, 1.0 - (0.9f32 as f64).powf(2.0) as f32);
    assert_eq!(r.decay, 1.0 - (1e-2 * 1e-3) as f32);
    assert_eq!(r.bc2_sqrt, 0.0, "unused fields stay 0");

    let mut c = cfg(Algorithm::Sgd, StateFormat::Fp32, 0);
    c.momentum = 0.5;
    c.dampening = 0.25;
    let r = FoRule::new(&Rule::new(&c, 1)).unwrap();
    assert_eq!(
        (r.kind, r.has_momentum, r.momentum),
        (RULE_TORCH_SGD, 1, 0.5)
    );
    assert_eq!((r.wdamp, r.lr, r.nesterov), (0.75, -1e-3, 0));

    let r = FoRule::new(&Rule::new(&cfg(Algorithm::SgdW, StateFormat::Quant8, 0), 1)).unwrap();
    assert_eq!((r.kind, r.has_momentum, r.lr), (RULE_FLASH_SGD, 0, 1e-3));

    let c = cfg(Algorithm::Lion, StateFormat::Fp32, 0);
    let r = FoRule::new(&Rule::new(&c, 1)).unwrap();
    assert_eq!(
        (r.kind, r.b1, r.b2, r.lr),
        (RULE_TORCH_LION, 0.9, 0.99, -1e-3)
    );
    let r = FoRule::new(&Rule::new(&cfg(Algorithm::Lion, StateFormat::Quant8, 0), 1)).unwrap();
    assert_eq!((r.kind, r.w2, r.lr), (RULE_FLASH_LION, 1.0 - 0.99f32, 1e-3));
}

/// The fast arithmetic's rules reach the kernel as its own kinds (their states coded the
/// fast way), with Adam's folded scalars; fp32 state steps torch's rule under both.
#[test]
fn fast_rules_take_the_fast_kinds() {
    let fast = |a: Algorithm, f: StateFormat| {
        let mut c = cfg(a, f, 24);
        c.arithmetic = crate::optim::Arithmetic::Fast;
        (FoRule::new(&Rule::new(&c, 3)).unwrap(), Rule::new(&c, 3))
    };
    let (r, rule) = fast(Algorithm::AdamW, StateFormat::Quant8);
    let Rule::Fast(crate::optim::math::rule::fast::FastRule::Adam(u)) = rule else {
        panic!("{rule:?}")
    };
    assert_eq!(
        (r.kind, r.lr, r.bc2_sqrt, r.eps, r.b1, r.decay),
        (
            RULE_FAST_ADAM,
            u.step,
            u.inv_sqrt_bc2,
            u.eps,
            u.betas.b1,
            u.decay
        )
    );
    assert_eq!((r.bc1, r.bc2), (0.0, 0.0), "unused fields stay 0");
    assert_eq!(
        fast(Algorithm::Sgd, StateFormat::Quant8).0.kind,
        RULE_FAST_SGD
    );
    assert_eq!(
        fast(Algorithm::Lion, StateFormat::ParamDtype).0.kind,
        RULE_FAST_LION
    );
    assert_eq!(
        fast(Algorithm::AdamW, StateFormat::Fp32).0.kind,
        RULE_TORCH_ADAM
    );
}

#[test]
fn non_float_dtypes_are_refused() {
    let c = cfg(Algorithm::Sgd, StateFormat::Fp32, 0);
    let mut st = state(&c, DType::F32, 4);
    let e = build_table(&[TableEntry {
        param: 8,
        param_dtype: DType::F64,
        grad: 16,
        grad_dtype: DType::F32,
        numel: 4,
        state: StatePtrs::of_host(&mut st),
        rule: Rule::new(&c, 1),
        first: true,
    }])
    .unwrap_err()
    .to_string();
    assert!(e.contains("table entry 0: param: dtype F64"), "{e}");
}

#[test]
fn moment_kinds_follow_the_stored_format() {
    assert_eq!(
        MomentKind::of(&Moment::F32(Vec::new().into())),
        MomentKind::F32
    );
    assert_eq!(
        MomentKind::of(&Moment::Half(Half::BF16, vec![])),
        MomentKind::BF16
    );
    assert_eq!(
        MomentKind::of(&Moment::Half(Half::F16, vec![])),
        MomentKind::F16
    );
    assert_eq!(
        MomentKind::of(&Moment::zeros_signed(3)),
        MomentKind::Q8Signed
    );
    assert_eq!(
        MomentKind::of(&Moment::zeros_unsigned(3, Root::Sqrt)),
        MomentKind::Q8Sqrt
    );
    assert_eq!(
        MomentKind::of(&Moment::zeros_unsigned(3, Root::Fourth)),
        MomentKind::Q8Fourth
    );
}

#[test]
fn state_layout_is_what_new_state_creates() {
    use crate::optim::math::config::Arithmetic;
    let algos = Algorithm::ALL;
    let formats = [
        StateFormat::Fp32,
        StateFormat::ParamDtype,
        StateFormat::Quant8,
        StateFormat::Quant8Wide,
    ];
    let kind = |m: &Option<Moment>| m.as_ref().map_or(MomentKind::None, MomentKind::of);
    let mut checked = 0;
    for a in algos {
        for f in formats {
            for dt in [DType::F32, DType::BF16, DType::F16] {
                for mw in [0, 24, 32] {
                    for momentum in [0.0, 0.9] {
                        if dt == DType::F32 && mw != 0 {
                            continue;
                        }
                        let mut c = cfg(a, f, mw);
                        c.momentum = momentum;
                        c.arithmetic = Arithmetic::Exact;
                        let st = state(&c, dt, 77);
                        let l = StateLayout::of(&c, dt);
                        let w = StatePtrs::of_host(&mut st.clone()).error_bits_width;
                        assert_eq!(
                            (l.m, l.v, l.error_bits_width),
                            (kind(&st.m), kind(&st.v), w)
                        );
                        assert_eq!(l.nbytes(77), st.nbytes(), "{a:?} {f:?} {dt} mw{mw}");
                        checked += 1;
                    }
                }
            }
        }
    }
    assert_eq!(checked, 5 * 4 * 7 * 2);
}
