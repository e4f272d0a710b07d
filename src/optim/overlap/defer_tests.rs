//! Once the clip is certain to scale, the overlapped step stops stepping early (each such
//! step would be rolled back and taken again) and keeps the bits of clip-then-step.
use super::tests::{cfg_for, model, snapshot, Grads, Rng, SHAPES, SHARD};
use super::{OverlapOptions, OverlapStats};
use crate::clip::clip_grad_norm;
use crate::comm::Comm;
use crate::dtype::DType;
use crate::optim::math::config::Algorithm;
use crate::tensor::TensorView;

/// Hands the gradients over one at a time, each after the previous one's task is back
/// (so the clip norm's shares measured so far are known when the next arrives).
unsafe fn one_by_one(
    m: &mut super::tests::Model,
    g: &[TensorView],
    opts: OverlapOptions,
) -> (crate::error::Result<()>, OverlapStats) {
    m.opt.step_begin(opts).unwrap();
    for (i, v) in g.iter().enumerate() {
        m.opt.grads_ready(&[i], std::slice::from_ref(v)).unwrap();
        let t = std::time::Instant::now();
        while m.opt.open_step().unwrap().inbox.pending() > 0 {
            assert!(
                t.elapsed().as_secs() < 60,
                "the pool never returned the task"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    let mut stats = OverlapStats::default();
    let r = m.opt.step_end(None, &mut stats);
    (r, stats)
}

#[test]
fn a_clip_certain_to_scale_defers_the_rest_and_keeps_the_bits() {
    let comm = Comm::local_group(1).pop().unwrap();
    for (max_norm, p, certain) in [
        (1e-3, 2.0, true),
        (1e-3, f64::INFINITY, true),
        (1e6, 2.0, false),
    ] {
        let mut cfg = cfg_for(Algorithm::AdamW, DType::BF16);
        cfg.lr = 1e-2;
        let mut a = model(&cfg, DType::BF16, 3, true).unwrap();
        let mut b = model(&cfg, DType::BF16, 3, true).unwrap();
        let mut ga = Grads::seeded(9);
        let mut gb = ga.clone();
        let (va, vb) = (ga.views(), gb.views());
        let list: Vec<(TensorView, bool)> = va
            .iter()
            .enumerate()
            .map(|(i, v)| (v.clone(), i == SHARD))
            .collect();
        let total = unsafe { clip_grad_norm(&comm, &list, max_norm, p, false) }.unwrap();
        let all: Vec<Option<TensorView>> = va.iter().cloned().map(Some).collect();
        unsafe { a.opt.step(&all) }.unwrap();
        let opts = OverlapOptions {
            max_norm,
            norm_type: p,
            ..OverlapOptions::default()
        };
        let (r, st) = unsafe { one_by_one(&mut b, &vb, opts) };
        r.unwrap();
        assert_eq!(st.total_norm.to_bits(), total.to_bits());
        assert!(snapshot(&a) == snapshot(&b), "max_norm {max_norm} p {p}");
        assert!(ga.bufs == gb.bufs, "the gradients are left scaled alike");
        let n = SHAPES.len() as u64;
        if certain {
            // the first non-empty gradient alone exceeds max_norm: the rest wait for step_end
            let early = 1 + SHAPES
                .iter()
                .position(|s| s.iter().product::<usize>() > 0)
                .unwrap() as u64;
            assert_eq!((st.speculative, st.deferred), (early, n - early), "{st:?}");
            assert_eq!(st.rolled_back, early, "{st:?}");
        } else {
            assert_eq!((st.speculative, st.deferred), (n, 0), "{st:?}");
        }
    }
}

/// The second overlapped step refills the first's undo records (the same allocations),
/// after a step kept and after one rolled back, and keeps the bits of plain steps.
#[test]
fn undo_records_are_refilled_from_step_to_step() {
    let cfg = cfg_for(Algorithm::AdamW, DType::BF16);
    let mut a = model(&cfg, DType::BF16, 5, false).unwrap();
    let mut b = model(&cfg, DType::BF16, 5, false).unwrap();
    let comm = Comm::local_group(1).pop().unwrap();
    let mut rng = Rng::new(21);
    let mut seen: Option<Vec<(usize, [usize; 2])>> = None;
    for (step, max_norm) in [0.0, 0.0, 1e-3, 0.0].into_iter().enumerate() {
        let mut ga = Grads::new(&mut rng, 1.0, step == 0);
        let mut gb = ga.clone();
        let (va, vb) = (ga.views(), gb.views());
        if max_norm > 0.0 {
            let list: Vec<(TensorView, bool)> = va.iter().map(|v| (v.clone(), false)).collect();
            unsafe { clip_grad_norm(&comm, &list, max_norm, 2.0, false) }.unwrap();
        }
        let all: Vec<Option<TensorView>> = va.iter().cloned().map(Some).collect();
        unsafe { a.opt.step(&all) }.unwrap();
        let opts = OverlapOptions {
            max_norm,
            ..OverlapOptions::default()
        };
        unsafe { b.opt.step_begin(opts) }.unwrap();
        let idx: Vec<usize> = (0..vb.len()).collect();
        unsafe { b.opt.grads_ready(&idx, &vb) }.unwrap();
        let mut st = OverlapStats::default();
        unsafe { b.opt.step_end(None, &mut st) }.unwrap();
        assert!(snapshot(&a) == snapshot(&b), "step {step}");
        // where each spare's parameter bytes live, and the first moments of the spare and
        // of the parameter (a rollback swaps those two: no allocation either way)
        let codes = |st: Option<&crate::optim::math::state::ParamState>| match st
            .and_then(|st| st.m.as_ref())
        {
            Some(crate::optim::math::state::Moment::Signed { codes, .. }) => {
                codes.as_ptr() as usize
            }
            _ => 0,
        };
        let now: Vec<(usize, [usize; 2])> = (0..b.opt.num_params())
            .filter_map(|i| {
                let s = b.opt.undo_spares().get(i)?.as_ref()?;
                let mut m = [
                    codes(s.state.as_ref()),
                    codes(b.opt.entry(i).state.as_ref()),
                ];
                m.sort();
                Some((s.bytes.as_ptr() as usize, m))
            })
            .collect();
        assert!(!now.is_empty());
        if step >= 2 {
            // from the step after the first one with state, the same buffers come back
            assert_eq!(
                seen.as_ref(),
                Some(&now),
                "step {step}: the undo records were reallocated"
            );
        }
        seen = Some(now);
    }
}

/// Gradients handed over by `grads_at_end` wait for `step_end`, keep no undo record, and
/// the step keeps the bits of one `step`.
#[test]
fn gradients_handed_over_at_the_end_wait_for_step_end_with_no_undo() {
    let mut cfg = cfg_for(Algorithm::AdamW, DType::BF16);
    cfg.lr = 1e-2;
    let mut a = model(&cfg, DType::BF16, 4, false).unwrap();
    let mut b = model(&cfg, DType::BF16, 4, false).unwrap();
    let mut rng = Rng::new(17);
    for step in 0..3 {
        let mut grads = Grads::new(&mut rng, 1.0, false);
        let g = grads.views();
        let all: Vec<Option<TensorView>> = g.iter().cloned().map(Some).collect();
        unsafe { a.opt.step(&all) }.unwrap();
        let (early, late): (Vec<usize>, Vec<usize>) = (0..SHAPES.len()).partition(|i| i % 2 == 0);
        let pick = |ix: &[usize]| ix.iter().map(|&i| g[i].clone()).collect::<Vec<_>>();
        let mut st = OverlapStats::default();
        unsafe {
            b.opt.step_begin(OverlapOptions::default()).unwrap();
            b.opt.grads_ready(&early, &pick(&early)).unwrap();
            b.opt.grads_at_end(&late, &pick(&late)).unwrap();
            b.opt.step_end(None, &mut st).unwrap();
        }
        assert_eq!(st.speculative as usize, early.len());
        assert_eq!(st.deferred as usize, late.len());
        // Records of the early parameters only: their bytes, and from the second step on
        // (the first creates the state) the state of each.
        let undo: usize = early
            .iter()
            .map(|&i| {
                let p = b.opt.entry(i);
                p.tensor().nbytes() + (step > 0) as usize * p.state.as_ref().unwrap().nbytes()
            })
            .sum();
        assert_eq!(st.undo_high_water_bytes as usize, undo, "step {step}");
        assert!(snapshot(&a) == snapshot(&b), "step {step}: bits differ");
    }
}

/// A stepped parameter's quantized moments change places with its undo record's instead
/// of being copied into it: after each kept step the record holds the buffers the
/// parameter had (the values before the step) and the parameter the record's (written
/// by the step), with the bits of plain steps.
#[test]
fn quantized_moments_change_places_with_the_undo_record_instead_of_being_copied() {
    let cfg = cfg_for(Algorithm::AdamW, DType::BF16);
    let mut a = model(&cfg, DType::BF16, 5, false).unwrap();
    let mut b = model(&cfg, DType::BF16, 5, false).unwrap();
    let mut rng = Rng::new(23);
    let codes = |st: Option<&crate::optim::math::state::ParamState>| match st
        .and_then(|st| st.m.as_ref())
    {
        Some(crate::optim::math::state::Moment::Signed { codes, .. }) => codes.as_ptr() as usize,
        _ => 0,
    };
    let mut before: Option<(usize, usize)> = None;
    for step in 0..4 {
        let mut ga = Grads::new(&mut rng, 1.0, step == 0);
        let mut gb = ga.clone();
        let (va, vb) = (ga.views(), gb.views());
        let all: Vec<Option<TensorView>> = va.iter().cloned().map(Some).collect();
        unsafe { a.opt.step(&all) }.unwrap();
        let idx: Vec<usize> = (0..vb.len()).collect();
        let mut st = OverlapStats::default();
        unsafe {
            b.opt.step_begin(OverlapOptions::default()).unwrap();
            b.opt.grads_ready(&idx, &vb).unwrap();
            b.opt.step_end(None, &mut st).unwrap();
        }
        assert!(snapshot(&a) == snapshot(&b), "step {step}");
        let spare = b.opt.undo_spares()[0]
            .as_ref()
            .and_then(|s| s.state.as_ref());
        let now = (codes(b.opt.entry(0).state.as_ref()), codes(spare));
        assert_ne!(now.0, 0, "parameter 0 has quant8 momentum");
        if let Some((live, rec)) = before.filter(|&(_, rec)| rec != 0) {
            assert_eq!(now, (rec, live), "step {step}: the buffers changed places");
        }
        before = Some(now);
    }
}
