//! The overlapped step's clipping against `clip_grad_norm` then `step`: the same total
//! norm bits, the same parameters and state, the gradients left scaled alike; a
//! non-finite norm under `error_if_nonfinite` fails and changes nothing.
use super::tests::{
    cfg_for, encode_like, handed, model, overlapped, snapshot, Grads, Rng, SHAPES, SHARD,
};
use super::OverlapOptions;
use crate::clip::clip_grad_norm;
use crate::comm::Comm;
use crate::dtype::DType;
use crate::error::Error;
use crate::optim::math::config::Algorithm;
use crate::tensor::TensorView;

/// Clip-then-step against the overlapped step with the same clipping, for clipping that
/// triggers (small max_norm) and that does not, every norm type.
#[test]
fn clipping_gives_the_bits_of_clip_grad_norm_then_step() {
    let comm = Comm::local_group(1).pop().unwrap();
    let mut seen = [false; 2];
    for (k, (max_norm, p)) in [
        (0.5, 2.0),
        (1e6, 2.0),
        (0.5, 1.0),
        (1e6, 1.0),
        (0.05, f64::INFINITY),
        (1e6, f64::INFINITY),
        (0.5, 3.0),
        (1e6, 3.0),
    ]
    .into_iter()
    .enumerate()
    {
        for (budget, pdt) in [(usize::MAX, DType::BF16), (2000, DType::F32)] {
            let mut cfg = cfg_for(Algorithm::AdamW, pdt);
            cfg.lr = 1e-2;
            let mut a = model(&cfg, pdt, 11, true).unwrap();
            let mut b = model(&cfg, pdt, 11, true).unwrap();
            let mut rng = Rng::new(50 + k as u64);
            for step in 0..2 {
                let mut ga = Grads::new(&mut rng, 1.0, step == 0);
                let mut gb = ga.clone();
                let (va, vb) = (ga.views(), gb.views());
                let which = handed(&mut rng);
                let list: Vec<(TensorView, bool)> =
                    which.iter().map(|&i| (va[i].clone(), i == SHARD)).collect();
                let total = unsafe { clip_grad_norm(&comm, &list, max_norm, p, false) }.unwrap();
                let all: Vec<Option<TensorView>> = (0..va.len())
                    .map(|i| which.contains(&i).then(|| va[i].clone()))
                    .collect();
                unsafe { a.opt.step(&all) }.unwrap();
                let opts = OverlapOptions {
                    max_norm,
                    norm_type: p,
                    error_if_nonfinite: true,
                    undo_budget_bytes: budget,
                };
                let (r, st) = unsafe { overlapped(&mut b, &vb, &which, &mut rng, opts) };
                r.unwrap();
                assert_eq!(st.total_norm.to_bits(), total.to_bits(), "p {p}");
                let clips = max_norm / (total + 1e-6) < 1.0;
                assert_eq!(st.clipped, clips, "{st:?}");
                seen[clips as usize] = true;
                if clips {
                    assert_eq!(st.rolled_back, st.speculative, "{st:?}");
                    assert!(st.speculative == 0 || st.rolled_back_bytes > 0, "{st:?}");
                }
                assert!(
                    ga.bufs == gb.bufs,
                    "the gradients are left scaled as clip leaves them"
                );
                assert!(snapshot(&a) == snapshot(&b), "max_norm {max_norm} p {p}");
            }
        }
    }
    assert_eq!(seen, [true, true]);
}

#[test]
fn a_non_finite_norm_with_error_if_nonfinite_fails_and_scales_nothing() {
    let cfg = cfg_for(Algorithm::Lion, DType::F32);
    let mut m = model(&cfg, DType::F32, 8, false).unwrap();
    let before = snapshot(&m);
    let mut rng = Rng::new(4);
    let mut grads = Grads::new(&mut rng, 1.0, false);
    grads.bufs[2] = encode_like(&grads.bufs[2], grads.dt[2]);
    let kept = grads.bufs.clone();
    let g = grads.views();
    let opts = OverlapOptions {
        max_norm: 1.0,
        error_if_nonfinite: true,
        ..OverlapOptions::default()
    };
    let which: Vec<usize> = (0..SHAPES.len()).collect();
    let (r, st) = unsafe { overlapped(&mut m, &g, &which, &mut rng, opts) };
    let e = r.unwrap_err();
    assert!(
        matches!(e, Error::Numerics(_)) && e.to_string().contains("norm"),
        "{e}"
    );
    assert!(st.total_norm.is_nan() || st.total_norm < 0.0, "{st:?}");
    assert_eq!(st.rolled_back, st.speculative);
    assert!(snapshot(&m) == before);
    assert!(grads.bufs == kept, "nothing scaled");
}

/// Two ranks of one communicator close an overlapped step with `opts[rank]` after
/// handing over every gradient; returns each rank's result and whether its parameters
/// and state are as before the step.
fn two_ranks_end(opts: [Option<OverlapOptions>; 2]) -> Vec<(crate::error::Result<()>, bool)> {
    let comms = crate::comm::Comm::local_group_with(
        2,
        crate::comm::LocalGroupOptions {
            timeout: std::time::Duration::from_secs(30),
        },
    );
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let r = comm.rank();
                    let cfg = cfg_for(Algorithm::AdamW, DType::F32);
                    let mut m = model(&cfg, DType::F32, 21, true).unwrap();
                    let before = snapshot(&m);
                    let mut grads = Grads::seeded(7);
                    let g = grads.views();
                    if let Some(o) = opts[r] {
                        let all: Vec<usize> = (0..SHAPES.len()).collect();
                        unsafe {
                            m.opt.step_begin(o).unwrap();
                            m.opt.grads_ready(&all, &g).unwrap();
                        }
                    }
                    let t0 = std::time::Instant::now();
                    let mut st = super::OverlapStats::default();
                    let res = unsafe { m.opt.step_end(Some(&comm), &mut st) };
                    assert!(t0.elapsed().as_secs() < 10, "rank {r} waited for a timeout");
                    (res, snapshot(&m) == before)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Issue 38: rank 0 clipping while rank 1 does not used to step rank 1 (OK) while rank 0
/// timed out in the norm's all-reduce. Now every rank fails at once, naming both
/// choices, and nothing is stepped anywhere; a rank without a step open fails every rank.
#[test]
fn ranks_that_disagree_on_clipping_fail_every_rank_at_once_with_nothing_stepped() {
    let clip = OverlapOptions {
        max_norm: 0.5,
        ..OverlapOptions::default()
    };
    let other = OverlapOptions {
        max_norm: 0.25,
        ..clip
    };
    for (opts, want) in [
        ([Some(clip), Some(OverlapOptions::default())], "rank 1 does not clip while rank 0 clips (max_norm 0.5"),
        ([Some(OverlapOptions::default()), Some(clip)], "rank 1 clips (max_norm 0.5, norm_type 2, error_if_nonfinite false) while rank 0 does not clip"),
        ([Some(clip), Some(other)], "max_norm 0.25"),
        ([None, Some(clip)], "no overlapped step is open"),
    ] {
        for (r, (res, unchanged)) in two_ranks_end(opts).into_iter().enumerate() {
            let e = res.unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains(want),
                "rank {r}: {e}"
            );
            assert!(unchanged, "rank {r} stepped");
        }
    }
    // Agreeing ranks still step (and clip alike).
    for (r, (res, unchanged)) in two_ranks_end([Some(clip), Some(clip)])
        .into_iter()
        .enumerate()
    {
        res.unwrap();
        assert!(!unchanged, "rank {r} did not step");
    }
}
