//! The overlapped step against one `step` (and `clip_grad_norm` then `step`) with the same
//! gradients: every rule, state format, arithmetic, master weight width and dtype, in
//! random arrival orders and buckets, bit for bit; failures change nothing; misuse is an
//! error, never a hang.
use super::{OverlapOptions, OverlapStats};
use crate::dtype::DType;
use crate::error::Error;
use crate::optim::math::config::{Algorithm, Arithmetic, OptimConfig, StateFormat};
use crate::optim::Optimizer;
use crate::shard::{Placement, ShardSpec};
use crate::tensor::{Tensor, TensorView};

/// xorshift64*: the tests' only randomness, seeded per case so a failure replays.
pub(super) struct Rng(u64);
impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

pub(super) fn encode(dt: DType, vals: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dt.size());
    for &v in vals {
        match dt {
            DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            _ => out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
        }
    }
    out
}

/// Parameter shapes: empty, odd, past one chunk, 2-D (its gradient is given strided).
pub(super) const SHAPES: [&[usize]; 5] = [&[0], &[5], &[2048 + 77], &[7, 9], &[300]];
const STRIDED: usize = 3;
/// The parameter registered as a shard (`model(.., spec = true)`).
pub(super) const SHARD: usize = 2;

fn view(b: &mut [u8], dt: DType, shape: &[usize]) -> TensorView {
    let shape: Vec<i64> = shape.iter().map(|&n| n as i64).collect();
    unsafe { TensorView::host(b.as_mut_ptr(), dt, &shape, None, "t").unwrap() }
}

/// One step's gradients: contiguous buffers, and for `STRIDED` a transposed buffer
/// viewed with strides.
#[derive(Clone)]
pub(super) struct Grads {
    pub dt: Vec<DType>,
    pub bufs: Vec<Vec<u8>>,
}

impl Grads {
    /// Random dtypes and values in [-scale, scale]; `wide`: f32 values over 20 binades,
    /// whose squares and sums round (so the order of a norm's sums shows in its bits).
    pub fn new(rng: &mut Rng, scale: f32, wide: bool) -> Grads {
        let all = [DType::F32, DType::BF16, DType::F16];
        let dt: Vec<DType> = SHAPES
            .iter()
            .map(|_| if wide { DType::F32 } else { all[rng.below(3)] })
            .collect();
        let bufs = SHAPES
            .iter()
            .zip(&dt)
            .map(|(s, &d)| {
                let v: Vec<f32> = (0..s.iter().product::<usize>())
                    .map(|_| {
                        let spread = if wide {
                            (-(rng.below(20) as f32)).exp2()
                        } else {
                            1.0
                        };
                        rng.unit() * scale * spread
                    })
                    .collect();
                encode(d, &v)
            })
            .collect();
        Grads { dt, bufs }
    }

    /// `new(.., 1.0, false)` from a generator of its own, seeded by `seed`.
    pub fn seeded(seed: u64) -> Grads {
        Grads::new(&mut Rng::new(seed), 1.0, false)
    }

    pub fn views(&mut self) -> Vec<TensorView> {
        let mut out = Vec::new();
        for (i, b) in self.bufs.iter_mut().enumerate() {
            let s = SHAPES[i];
            out.push(if i == STRIDED {
                // The buffer holds the [9, 7] transpose: element (r, c) at c * 7 + r.
                let shape = [s[0] as i64, s[1] as i64];
                let strides = [1i64, s[0] as i64];
                unsafe { TensorView::host(b.as_mut_ptr(), self.dt[i], &shape, Some(&strides), "g") }
                    .unwrap()
            } else {
                view(b, self.dt[i], s)
            });
        }
        out
    }
}

pub(super) struct Model {
    pub opt: Optimizer,
    pub mem: Vec<Vec<u8>>,
}

/// `a`'s FlashOptim defaults for parameters of `pdt` (f32 parameters take no master bits).
pub(super) fn cfg_for(a: Algorithm, pdt: DType) -> OptimConfig {
    let mut c = OptimConfig::default_for(a);
    if pdt == DType::F32 {
        c.master_weight_bits = 0;
    }
    c
}

pub(super) fn model(cfg: &OptimConfig, pdt: DType, seed: u64, spec: bool) -> Option<Model> {
    let mut rng = Rng::new(seed);
    let mut mem: Vec<Vec<u8>> = SHAPES
        .iter()
        .map(|s| {
            let v: Vec<f32> = (0..s.iter().product::<usize>())
                .map(|_| rng.unit())
                .collect();
            encode(pdt, &v)
        })
        .collect();
    let mut opt = Optimizer::new(cfg.clone()).ok()?;
    for (i, b) in mem.iter_mut().enumerate() {
        // One sharded parameter: its gradient counts as a shard in the clip norm.
        // In the middle of the list, so a wrong flag changes the sum's order.
        let sp = (spec && i == SHARD).then(|| {
            let n = 2 * SHAPES[SHARD][0];
            ShardSpec::new(vec![n], vec![2], vec![0], vec![Placement::Shard(0)]).unwrap()
        });
        unsafe { opt.add_param(&format!("p{i}"), view(b, pdt, SHAPES[i]), sp, 0) }.ok()?;
    }
    Some(Model { opt, mem })
}

/// Parameters and every raw state entry, for bit comparisons.
pub(super) fn snapshot(m: &Model) -> (Vec<Vec<u8>>, Vec<(String, Tensor)>) {
    let mut st = Vec::new();
    for i in 0..m.opt.num_params() {
        for k in m.opt.keys_of(i) {
            st.push((format!("{i}.{k}"), m.opt.get_state(i, &k).unwrap()));
        }
    }
    (m.mem.clone(), st)
}

fn configs() -> Vec<(OptimConfig, DType)> {
    let mut out = Vec::new();
    for a in Algorithm::ALL {
        for fmt in [StateFormat::Fp32, StateFormat::Quant8] {
            for ar in [Arithmetic::Exact, Arithmetic::Fast] {
                for (pdt, bits) in [
                    (DType::F32, 0),
                    (DType::BF16, 0),
                    (DType::BF16, 24),
                    (DType::F16, 24),
                ] {
                    let mut c = OptimConfig::default_for(a);
                    (c.state_format, c.arithmetic, c.master_weight_bits) = (fmt, ar, bits);
                    c.lr = 1e-2;
                    c.weight_decay = 0.05;
                    if matches!(a, Algorithm::Sgd | Algorithm::SgdW) {
                        (c.momentum, c.dampening) = (0.9, 0.1);
                    }
                    if c.validate().is_ok() {
                        out.push((c, pdt));
                    }
                }
            }
        }
    }
    out
}

/// Hands `which` over in a random order, in random buckets.
pub(super) unsafe fn overlapped(
    m: &mut Model,
    g: &[TensorView],
    which: &[usize],
    rng: &mut Rng,
    opts: OverlapOptions,
) -> (crate::error::Result<()>, OverlapStats) {
    let mut order = which.to_vec();
    rng.shuffle(&mut order);
    m.opt.step_begin(opts).unwrap();
    let mut at = 0;
    while at < order.len() {
        let n = 1 + rng.below(order.len() - at);
        let idx = &order[at..at + n];
        let views: Vec<TensorView> = idx.iter().map(|&i| g[i].clone()).collect();
        m.opt.grads_ready(idx, &views).unwrap();
        at += n;
    }
    let mut stats = OverlapStats::default();
    let r = m.opt.step_end(None, &mut stats);
    (r, stats)
}

pub(super) fn handed(rng: &mut Rng) -> Vec<usize> {
    // Usually all, sometimes some parameters skipped (no gradient this step).
    (0..SHAPES.len()).filter(|_| rng.below(5) != 0).collect()
}

#[test]
fn any_order_and_bucketing_gives_the_bits_of_one_step_for_every_configuration() {
    let cases = configs();
    assert!(cases.len() >= 60, "{} configurations", cases.len());
    for (c, (cfg, pdt)) in cases.iter().enumerate() {
        let (Some(mut a), Some(mut b)) = (model(cfg, *pdt, 7, false), model(cfg, *pdt, 7, false))
        else {
            continue;
        };
        let mut rng = Rng::new(1000 + c as u64);
        for step in 0..3 {
            let mut grads = Grads::new(&mut rng, 1.0, false);
            let g = grads.views();
            let which = handed(&mut rng);
            let all: Vec<Option<TensorView>> = (0..g.len())
                .map(|i| which.contains(&i).then(|| g[i].clone()))
                .collect();
            unsafe { a.opt.step(&all) }.unwrap();
            let (r, st) =
                unsafe { overlapped(&mut b, &g, &which, &mut rng, OverlapOptions::default()) };
            r.unwrap();
            assert_eq!(st.handed_over as usize, which.len());
            assert_eq!(st.speculative as usize, which.len());
            assert_eq!(st.rolled_back, 0);
            assert!(
                snapshot(&a) == snapshot(&b),
                "case {c} ({:?} {:?} {:?} {} bits, {pdt}) step {step}: bits differ",
                cfg.algorithm,
                cfg.state_format,
                cfg.arithmetic,
                cfg.master_weight_bits
            );
        }
    }
}

#[test]
fn an_undo_budget_defers_what_does_not_fit_with_the_same_bits() {
    let (cfg, pdt) = (cfg_for(Algorithm::AdamW, DType::BF16), DType::BF16);
    for budget in [0usize, 3000, 9000] {
        let mut a = model(&cfg, pdt, 3, false).unwrap();
        let mut b = model(&cfg, pdt, 3, false).unwrap();
        let mut rng = Rng::new(budget as u64);
        for _ in 0..2 {
            let mut grads = Grads::new(&mut rng, 1.0, false);
            let g = grads.views();
            let all: Vec<Option<TensorView>> = g.iter().cloned().map(Some).collect();
            unsafe { a.opt.step(&all) }.unwrap();
            let opts = OverlapOptions {
                undo_budget_bytes: budget,
                ..OverlapOptions::default()
            };
            let which: Vec<usize> = (0..SHAPES.len()).collect();
            let (r, st) = unsafe { overlapped(&mut b, &g, &which, &mut rng, opts) };
            r.unwrap();
            assert!(st.undo_high_water_bytes as usize <= budget, "{st:?}");
            assert_eq!(st.speculative + st.deferred, SHAPES.len() as u64);
            if budget == 0 {
                assert_eq!(st.speculative, 1, "only the empty parameter fits: {st:?}");
            }
            assert!(snapshot(&a) == snapshot(&b), "budget {budget}");
        }
    }
}

#[test]
fn a_bad_gradient_handed_over_late_fails_the_step_and_changes_nothing() {
    let mut cfg = OptimConfig::default_for(Algorithm::AdamW);
    cfg.check_numerics = true;
    let mut m = model(&cfg, DType::BF16, 5, false).unwrap();
    let mut grads = Grads::seeded(9);
    let g = grads.views();
    let all: Vec<Option<TensorView>> = g.iter().cloned().map(Some).collect();
    unsafe { m.opt.step(&all) }.unwrap();
    let before = snapshot(&m);
    unsafe {
        // A wrong shape: refused at once, and the step fails at its end.
        m.opt.step_begin(OverlapOptions::default()).unwrap();
        m.opt
            .grads_ready(&[2, 4], &[g[2].clone(), g[4].clone()])
            .unwrap();
        let e = m.opt.grads_ready(&[1], &[g[0].clone()]).unwrap_err();
        assert!(matches!(e, Error::Shape(_)), "{e}");
        assert!(e.to_string().contains("gradient of p1"), "{e}");
        let again = m.opt.grads_ready(&[3], &[g[3].clone()]).unwrap_err();
        assert!(again.to_string().contains("already failed"), "{again}");
        let mut st = OverlapStats::default();
        let e = m.opt.step_end(None, &mut st).unwrap_err();
        assert!(matches!(e, Error::Shape(_)), "{e}");
        assert_eq!((st.rolled_back, st.speculative), (2, 2), "{st:?}");
        assert!(snapshot(&m) == before);
        // A non-finite gradient under check_numerics, found on the pool.
        let mut nan = encode_like(&grads.bufs[4], grads.dt[4]);
        let bad = view(&mut nan, grads.dt[4], SHAPES[4]);
        m.opt.step_begin(OverlapOptions::default()).unwrap();
        m.opt
            .grads_ready(&[0, 1, 2], &[g[0].clone(), g[1].clone(), g[2].clone()])
            .unwrap();
        m.opt.grads_ready(&[4], &[bad]).unwrap();
        m.opt.grads_ready(&[3], &[g[3].clone()]).unwrap();
        let e = m.opt.step_end(None, &mut st).unwrap_err();
        assert!(matches!(e, Error::Numerics(_)), "{e}");
        assert!(e.to_string().contains("gradient of p4"), "{e}");
        assert!(snapshot(&m) == before);
        // The optimizer steps normally afterwards.
        m.opt.step(&all).unwrap();
    }
}

#[test]
fn abort_puts_every_early_step_back_and_drops_fresh_state() {
    let cfg = OptimConfig::default_for(Algorithm::AdamW);
    let mut m = model(&cfg, DType::BF16, 11, false).unwrap();
    let mut grads = Grads::seeded(21);
    let g = grads.views();
    let before = snapshot(&m);
    let mut st = OverlapStats::default();
    assert!(m.opt.step_abort(&mut st).is_err(), "no step open");
    unsafe {
        // The first step creates state: an abort drops it again.
        m.opt.step_begin(OverlapOptions::default()).unwrap();
        let all: Vec<usize> = (0..g.len()).collect();
        m.opt.grads_ready(&all, &g).unwrap();
    }
    m.opt.step_abort(&mut st).unwrap();
    assert_eq!(st.rolled_back, st.speculative, "{st:?}");
    assert!(st.speculative > 0, "{st:?}");
    assert!(snapshot(&m) == before);
    assert!((0..g.len()).all(|i| !m.opt.has_state(i)));
    assert!(!m.opt.step_open());
    // The handle steps normally afterwards.
    let all: Vec<Option<TensorView>> = g.iter().cloned().map(Some).collect();
    unsafe { m.opt.step(&all) }.unwrap();
}

/// `bytes` (elements of `dt`) with element 5 made NaN.
pub(super) fn encode_like(bytes: &[u8], dt: DType) -> Vec<u8> {
    let mut out = bytes.to_vec();
    let nan: Vec<u8> = match dt {
        DType::F32 => f32::NAN.to_le_bytes().to_vec(),
        DType::BF16 => half::bf16::NAN.to_le_bytes().to_vec(),
        _ => half::f16::NAN.to_le_bytes().to_vec(),
    };
    out[5 * dt.size()..6 * dt.size()].copy_from_slice(&nan);
    out
}

#[test]
fn misuse_is_a_clear_error_and_other_calls_refuse_while_a_step_is_open() {
    let cfg = OptimConfig::default_for(Algorithm::AdamW);
    let mut m = model(&cfg, DType::BF16, 2, false).unwrap();
    let mut grads = Grads::seeded(3);
    let g = grads.views();
    let mut st = OverlapStats::default();
    unsafe {
        let e = m.opt.grads_ready(&[0], &[g[0].clone()]).unwrap_err();
        assert!(e.to_string().contains("no overlapped step is open"), "{e}");
        let e = m.opt.step_end(None, &mut st).unwrap_err();
        assert!(
            e.to_string()
                .contains("step_end: no overlapped step is open"),
            "{e}"
        );
        m.opt.step_begin(OverlapOptions::default()).unwrap();
        let e = m.opt.step_begin(OverlapOptions::default()).unwrap_err();
        assert!(e.to_string().contains("already open"), "{e}");
        m.opt.grads_ready(&[1], &[g[1].clone()]).unwrap();
        let e = m.opt.step(&vec![None; SHAPES.len()]).unwrap_err();
        assert!(
            matches!(e, Error::Busy(_)) && e.to_string().contains("step:"),
            "{e}"
        );
        let e = m.opt.set_states(1, &[]).unwrap_err();
        assert!(matches!(e, Error::Busy(_)), "{e}");
        let mut extra = vec![0u8; 8];
        let e = m
            .opt
            .add_param("x", view(&mut extra, DType::F32, &[2]), None, 0);
        assert!(matches!(e.unwrap_err(), Error::Busy(_)));
        let e = m.opt.grads_ready(&[1], &[g[1].clone()]).unwrap_err();
        assert!(e.to_string().contains("already handed over"), "{e}");
        m.opt.step_end(None, &mut st).unwrap_err();
        // Twice within one bucket, and out of range.
        m.opt.step_begin(OverlapOptions::default()).unwrap();
        let e = m.opt.grads_ready(&[2, 2], &[g[2].clone(), g[2].clone()]);
        assert!(e.unwrap_err().to_string().contains("already handed over"));
        m.opt.step_end(None, &mut st).unwrap_err();
        m.opt.step_begin(OverlapOptions::default()).unwrap();
        let e = m.opt.grads_ready(&[9], &[g[2].clone()]).unwrap_err();
        assert!(e.to_string().contains("indices[0]"), "{e}");
        m.opt.step_end(None, &mut st).unwrap_err();
        let e = m.opt.step_begin(OverlapOptions {
            max_norm: 1.0,
            norm_type: -1.0,
            ..OverlapOptions::default()
        });
        assert!(e.unwrap_err().to_string().contains("norm_type"));
        assert!(!m.opt.step_open());
    }
}

#[test]
fn dropping_the_optimizer_with_a_step_open_waits_and_puts_parameters_back() {
    let cfg = cfg_for(Algorithm::AdamW, DType::F32);
    let m = model(&cfg, DType::F32, 6, false).unwrap();
    let before = m.mem.clone();
    let Model { mut opt, mem } = m;
    let mut grads = Grads::seeded(12);
    let g = grads.views();
    unsafe {
        opt.step_begin(OverlapOptions::default()).unwrap();
        let idx: Vec<usize> = (0..SHAPES.len()).collect();
        opt.grads_ready(&idx, &g).unwrap();
    }
    drop(opt);
    assert!(mem == before, "an abandoned step changes nothing");
}
