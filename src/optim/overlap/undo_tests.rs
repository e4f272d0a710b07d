//! Undo records of parameters of several chunks in every layout (f32 in place,
//! 16384-element chunks; bf16/f16 with error bits and quant8 state, 2048-element chunks
//! with a short last group), stepped early and then put back by a failing step: restored
//! bit for bit, from a fresh record and from the last step's (`keep_spares`).
use super::tests::{encode, snapshot, Model, Rng};
use super::OverlapOptions;
use crate::dtype::DType;
use crate::optim::math::config::{Algorithm, OptimConfig, StateFormat};
use crate::optim::Optimizer;
use crate::tensor::TensorView;

/// Elements per parameter: three f32 chunks and a bit; several 2048-element chunks.
const SIZES: [usize; 2] = [3 * 16384 + 100, 5 * 2048 + 45];
/// Parameters whose records are copied and put back in 1 MiB pieces across the pool
/// (`record::fill_par`, `record::copy_par`): 2.4 MB and 1.2 MB of f32, 1.2 MB and 0.6 MB of
/// 16-bit values, neither a whole number of pieces.
const LARGE: [usize; 2] = [600_001, 300_007];

fn views(bufs: &mut [Vec<u8>], dt: &[DType]) -> Vec<TensorView> {
    bufs.iter_mut()
        .zip(dt)
        .map(|(b, &d)| {
            let n = (b.len() / d.size()) as i64;
            unsafe { TensorView::host(b.as_mut_ptr(), d, &[n], None, "t") }.unwrap()
        })
        .collect()
}

fn model(fmt: StateFormat, pdt: DType, bits: u32) -> Model {
    model_of(&SIZES, fmt, pdt, bits)
}

fn model_of(sizes: &[usize; 2], fmt: StateFormat, pdt: DType, bits: u32) -> Model {
    let mut cfg = OptimConfig::default_for(Algorithm::AdamW);
    (cfg.state_format, cfg.master_weight_bits, cfg.check_numerics) = (fmt, bits, true);
    cfg.lr = 1e-2;
    let mut rng = Rng::new(11);
    let mut mem: Vec<Vec<u8>> = sizes
        .iter()
        .map(|&n| encode(pdt, &(0..n).map(|_| rng.unit()).collect::<Vec<f32>>()))
        .collect();
    let mut opt = Optimizer::new(cfg).unwrap();
    for (i, v) in views(&mut mem, &[pdt, pdt]).into_iter().enumerate() {
        unsafe { opt.add_param(&format!("p{i}"), v, None, 0) }.unwrap();
    }
    Model { opt, mem }
}

fn grads(rng: &mut Rng, dt: DType) -> Vec<Vec<u8>> {
    grads_of(&SIZES, rng, dt)
}

fn grads_of(sizes: &[usize; 2], rng: &mut Rng, dt: DType) -> Vec<Vec<u8>> {
    sizes
        .iter()
        .map(|&n| encode(dt, &(0..n).map(|_| rng.unit()).collect::<Vec<f32>>()))
        .collect()
}

#[test]
fn multi_chunk_parameters_are_put_back_whole_from_fresh_and_reused_records() {
    put_back_whole(&SIZES);
}

#[test]
fn parameters_of_several_copy_pieces_are_put_back_whole() {
    put_back_whole(&LARGE);
}

/// Steps that succeed and fail in turn: a failed one puts every parameter back bit for bit.
fn put_back_whole(sizes: &[usize; 2]) {
    for (fmt, pdt, bits) in [
        (StateFormat::Fp32, DType::F32, 0),
        (StateFormat::Quant8, DType::BF16, 24),
        (StateFormat::Quant8, DType::F16, 32),
    ] {
        let mut m = model_of(sizes, fmt, pdt, bits);
        let mut rng = Rng::new(5);
        for step in 0..4 {
            // Steps 0 and 2 succeed (step 0 creates the state, step 2 refills the
            // records step 1 left); steps 1 and 3 fail at step_end on a NaN gradient
            // handed over after the other parameter stepped early.
            let fail = step % 2 == 1;
            let before = snapshot(&m);
            let mut g = grads_of(sizes, &mut rng, pdt);
            if fail {
                let nan = encode(pdt, &[f32::NAN]);
                g[1][..nan.len()].copy_from_slice(&nan);
            }
            let v = views(&mut g, &[pdt, pdt]);
            unsafe {
                m.opt.step_begin(OverlapOptions::default()).unwrap();
                m.opt.grads_ready(&[0], &v[..1]).unwrap();
                m.opt.grads_ready(&[1], &v[1..]).unwrap();
                let mut st = super::OverlapStats::default();
                let r = m.opt.step_end(None, &mut st);
                assert_eq!(r.is_err(), fail, "{fmt:?} {pdt} step {step}: {r:?}");
                assert_eq!(st.speculative, 2);
            }
            if fail {
                assert!(
                    snapshot(&m) == before,
                    "{fmt:?} {pdt} step {step}: not put back bit for bit"
                );
            } else {
                assert!(snapshot(&m) != before, "{fmt:?} {pdt} step {step}: no step");
            }
        }
    }
}

/// The records kept for the next step are freed on request, with their size: each
/// parameter's bytes plus its state; nothing is left to free a second time; the next
/// overlapped step makes new ones and steps as a plain step with the same gradients does.
#[test]
fn kept_undo_records_are_freed_with_their_size_and_made_again() {
    let (fmt, pdt, bits) = (StateFormat::Quant8, DType::BF16, 24);
    let (mut m, mut plain) = (model(fmt, pdt, bits), model(fmt, pdt, bits));
    assert_eq!(m.opt.release_undo(), 0, "no overlapped step yet");
    let mut rng = Rng::new(9);
    for step in 0..3 {
        let mut g = grads(&mut rng, pdt);
        let mut g2 = g.clone();
        let v = views(&mut g, &[pdt, pdt]);
        let mut st = super::OverlapStats::default();
        unsafe {
            m.opt.step_begin(OverlapOptions::default()).unwrap();
            m.opt.grads_ready(&[0, 1], &v).unwrap();
            m.opt.step_end(None, &mut st).unwrap();
            let pv: Vec<Option<TensorView>> =
                views(&mut g2, &[pdt, pdt]).into_iter().map(Some).collect();
            plain.opt.step(&pv).unwrap();
        }
        assert_eq!(st.speculative, 2);
        if step == 1 {
            let kept = m.opt.release_undo();
            // The records were taken before this step: the parameters' bytes and their
            // state after step 0, the same size as the state now.
            let want: usize = (0..SIZES.len())
                .map(|i| SIZES[i] * pdt.size() + m.opt.state_bytes(i).unwrap())
                .sum();
            assert_eq!(kept, want);
            assert_eq!(m.opt.release_undo(), 0, "freed once");
        }
        assert!(snapshot(&m) == snapshot(&plain), "step {step}");
    }
}
