//! Lent state (`Optimizer::share_state`, `fo_optimizer_share_state`): a borrower's pointer
//! shows the optimizer's live f32 state through steps, loads, an overlapped step's
//! rollback and a numerics undo, at one address; writes through it are the state's; it
//! outlives the optimizer; compressed, device-less or missing state is refused by name.
use fo::optim::overlap::{OverlapOptions, OverlapStats};
use fo::optim::{Algorithm, OptimConfig, Optimizer, StateFormat};
use fo::{DType, Error, Tensor, TensorView};

const N: usize = 1000;

fn wave(k: f32) -> Vec<f32> {
    (0..N)
        .map(|i| ((i as f32) * 0.37 + k).sin() * 1e-2)
        .collect()
}

fn view(v: &mut [f32]) -> TensorView {
    unsafe {
        TensorView::host(
            v.as_mut_ptr() as *mut u8,
            DType::F32,
            &[N as i64],
            None,
            "t",
        )
    }
    .unwrap()
}

/// One f32 parameter (`param`, borrowed by the optimizer) and its gradient memory.
struct Run {
    opt: Optimizer,
    param: Vec<f32>,
    grad: Vec<f32>,
}

impl Run {
    fn new(algorithm: Algorithm, format: StateFormat) -> Run {
        let mut cfg = OptimConfig::default_for(algorithm);
        (cfg.state_format, cfg.master_weight_bits) = (format, 0);
        (cfg.lr, cfg.momentum) = (1e-2, 0.9);
        let mut r = Run {
            opt: Optimizer::new(cfg).unwrap(),
            param: wave(0.0),
            grad: vec![0.0; N],
        };
        unsafe { r.opt.add_param("w", view(&mut r.param), None, 0).unwrap() };
        r
    }

    fn step(&mut self, k: f32) {
        self.grad = wave(k);
        unsafe { self.opt.step(&[Some(view(&mut self.grad))]).unwrap() };
    }

    fn state(&self, key: &str) -> Vec<f32> {
        let t = self.opt.get_state(0, key).unwrap();
        t.data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
}

fn read(s: &fo::optim::Share) -> Vec<f32> {
    // SAFETY: the share keeps its buffer alive; no step runs meanwhile.
    unsafe { std::slice::from_raw_parts(s.as_ptr(), s.len()) }.to_vec()
}

fn f32_tensor(v: &[f32]) -> Tensor {
    Tensor {
        dtype: DType::F32,
        shape: vec![N],
        data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

#[test]
fn a_share_follows_steps_and_loads_at_one_address() {
    let mut r = Run::new(Algorithm::AdamW, StateFormat::Fp32);
    r.step(1.0);
    let (m, v) = (
        r.opt.share_state(0, "exp_avg").unwrap(),
        r.opt.share_state(0, "exp_avg_sq").unwrap(),
    );
    assert_eq!((m.len(), read(&m)), (N, r.state("exp_avg")));
    let at = m.as_ptr();
    for k in 2..5 {
        r.step(k as f32);
        assert_eq!(read(&m), r.state("exp_avg"), "step {k}");
        assert_eq!(read(&v), r.state("exp_avg_sq"), "step {k}");
    }
    let loaded = wave(9.0);
    r.opt
        .set_states(0, &[("exp_avg".into(), f32_tensor(&loaded))])
        .unwrap();
    assert_eq!(
        (m.as_ptr(), read(&m)),
        (at, loaded),
        "a load writes in place"
    );
    // SGD's momentum buffer too.
    let mut s = Run::new(Algorithm::Sgd, StateFormat::Fp32);
    s.step(1.0);
    let b = s.opt.share_state(0, "momentum_buffer").unwrap();
    s.step(2.0);
    assert_eq!(read(&b), s.state("momentum_buffer"));
}

#[test]
fn writes_through_a_share_are_the_state_and_step_as_a_load_would() {
    let (mut a, mut b) = (
        Run::new(Algorithm::AdamW, StateFormat::Fp32),
        Run::new(Algorithm::AdamW, StateFormat::Fp32),
    );
    a.step(1.0);
    b.step(1.0);
    let edit = wave(5.0);
    let m = a.opt.share_state(0, "exp_avg").unwrap();
    unsafe { std::slice::from_raw_parts_mut(m.as_ptr(), N).copy_from_slice(&edit) };
    b.opt
        .set_states(0, &[("exp_avg".into(), f32_tensor(&edit))])
        .unwrap();
    a.step(2.0);
    b.step(2.0);
    assert_eq!(
        a.param.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        b.param.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!(read(&m), b.state("exp_avg"));
}

#[test]
fn an_overlapped_rollback_and_a_numerics_undo_restore_the_lent_buffer_in_place() {
    let mut r = Run::new(Algorithm::AdamW, StateFormat::Fp32);
    r.step(1.0);
    let m = r.opt.share_state(0, "exp_avg").unwrap();
    let (before, at) = (read(&m), m.as_ptr());
    r.grad = wave(3.0);
    unsafe {
        r.opt.step_begin(OverlapOptions::default()).unwrap();
        r.opt.grads_ready(&[0], &[view(&mut r.grad)]).unwrap();
    }
    let mut stats = OverlapStats::default();
    r.opt.step_abort(&mut stats).unwrap();
    assert_eq!(stats.rolled_back, 1, "{stats:?}");
    assert_eq!(
        (m.as_ptr(), read(&m)),
        (at, before.clone()),
        "rolled back in place"
    );
    // Twice: the rollback's spare buffer serves the next step's undo record.
    unsafe {
        r.opt.step_begin(OverlapOptions::default()).unwrap();
        r.opt.grads_ready(&[0], &[view(&mut r.grad)]).unwrap();
    }
    r.opt.step_abort(&mut stats).unwrap();
    assert_eq!(read(&m), before);
    r.step(2.0);
    assert_eq!(read(&m), r.state("exp_avg"), "and still live after");

    let mut cfg = r.opt.group_config(0).unwrap().clone();
    cfg.check_numerics = true;
    r.opt.set_group_config(0, cfg).unwrap();
    let before = read(&m);
    r.grad = wave(4.0);
    r.grad[7] = f32::INFINITY;
    let e = unsafe { r.opt.step(&[Some(view(&mut r.grad))]) }.unwrap_err();
    assert!(matches!(e, Error::Numerics(_)), "{e}");
    assert_eq!((m.as_ptr(), read(&m)), (at, before), "undone in place");
}

#[test]
fn a_share_outlives_its_optimizer_and_what_cannot_be_lent_is_refused_by_name() {
    let mut r = Run::new(Algorithm::AdamW, StateFormat::Fp32);
    let e = r.opt.share_state(0, "exp_avg").err().unwrap();
    assert!(
        matches!(e, Error::NotFound(_)) && e.to_string().contains("no optimizer state yet"),
        "{e}"
    );
    r.step(1.0);
    for key in ["step", "master", "exp_avg::quantized", "momentum_buffer"] {
        let e = r.opt.share_state(0, key).err().unwrap();
        assert!(
            matches!(e, Error::NotFound(_)) && e.to_string().contains(key),
            "{key}: {e}"
        );
    }
    assert!(r.opt.share_state(1, "exp_avg").is_err());
    let m = r.opt.share_state(0, "exp_avg").unwrap();
    let want = r.state("exp_avg");
    drop(r);
    assert_eq!(read(&m), want, "the memory outlives the optimizer");

    let mut q = Run::new(Algorithm::AdamW, StateFormat::Quant8);
    q.step(1.0);
    let e = q.opt.share_state(0, "exp_avg").err().unwrap();
    assert!(
        matches!(e, Error::Unsupported(_)) && e.to_string().contains("quant8"),
        "{e}"
    );
}
