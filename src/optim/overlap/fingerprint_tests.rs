//! `grads_changed` on a real overlapped step: a gradient scaled after its early step is
//! named by its sampled fingerprint (an edit torch's counters may not see), one multiplied
//! by 1.0 is not named by its full one (an edit by the counter, the same bits), and one
//! asked about fully without a full fingerprint counts as changed.
use super::super::OverlapOptions;
use crate::dtype::DType;
use crate::optim::math::config::{Algorithm, OptimConfig};
use crate::optim::Optimizer;
use crate::tensor::TensorView;

/// Three f32 parameters (over several sample strides, one with a strided gradient, a
/// short one) and their gradients (the second's buffer twice its size).
struct Loop {
    opt: Optimizer,
    _mem: Vec<Vec<f32>>,
    grads: Vec<Vec<f32>>,
}

const SIZES: [usize; 3] = [10_000, 1_500, 7];

fn setup(full: bool) -> Loop {
    let mut cfg = OptimConfig::default_for(Algorithm::AdamW);
    cfg.master_weight_bits = 0;
    let mut opt = Optimizer::new(cfg).unwrap();
    let mut mem: Vec<Vec<f32>> = SIZES.iter().map(|&n| vec![0.5; n]).collect();
    for (i, m) in mem.iter_mut().enumerate() {
        let n = m.len() as i64;
        let v = unsafe { TensorView::host(m.as_mut_ptr() as *mut u8, DType::F32, &[n], None, "p") };
        unsafe { opt.add_param(&format!("p{i}"), v.unwrap(), None, 0) }.unwrap();
    }
    opt.set_full_fingerprints(full).unwrap();
    let grads = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            (0..n * if i == 1 { 2 } else { 1 })
                .map(|k| (k as f32 * 0.1).cos())
                .collect()
        })
        .collect();
    Loop {
        opt,
        _mem: mem,
        grads,
    }
}

impl Loop {
    /// Opens a step and hands parameters 0 and 1 over early (1's gradient a view of every
    /// other element of its buffer), 2 for step_end.
    fn hand_over(&mut self) {
        unsafe { self.opt.step_begin(OverlapOptions::default()) }.unwrap();
        let view = |g: &mut Vec<f32>, n: usize, stride: i64| {
            let p = g.as_mut_ptr() as *mut u8;
            unsafe { TensorView::host(p, DType::F32, &[n as i64], Some(&[stride]), "g") }.unwrap()
        };
        let v = [
            view(&mut self.grads[0], SIZES[0], 1),
            view(&mut self.grads[1], SIZES[1], 2),
        ];
        unsafe { self.opt.grads_ready(&[0, 1], &v) }.unwrap();
        let v = view(&mut self.grads[2], SIZES[2], 1);
        unsafe { self.opt.grads_at_end(&[2], &[v]) }.unwrap();
    }

    fn end(&mut self) {
        let mut st = Default::default();
        unsafe { self.opt.step_end(None, &mut st) }.unwrap();
    }
}

#[test]
fn an_untouched_step_names_nothing_and_a_scaled_gradient_is_named() {
    let mut l = setup(false);
    l.hand_over();
    assert_eq!(
        unsafe { l.opt.grads_changed(&[]) }.unwrap(),
        Vec::<usize>::new()
    );
    // Scaled through a handle torch would not count (`.data`); the one stepped at
    // step_end is not asked about: its step reads it there.
    l.grads[0].iter_mut().for_each(|x| *x *= 0.5);
    l.grads[2].iter_mut().for_each(|x| *x *= 0.5);
    assert_eq!(unsafe { l.opt.grads_changed(&[]) }.unwrap(), vec![0]);
    // The strided gradient: an element between its own (odd index) is not its; one of
    // them is.
    l.grads[1][1] = 9.0;
    assert_eq!(unsafe { l.opt.grads_changed(&[]) }.unwrap(), vec![0]);
    l.grads[1][2998] = 9.0;
    assert_eq!(unsafe { l.opt.grads_changed(&[]) }.unwrap(), vec![0, 1]);
    l.end();
}

#[test]
fn multiplying_by_one_is_no_change_by_the_full_fingerprint() {
    let mut l = setup(true);
    l.hand_over();
    l.grads[0].iter_mut().for_each(|x| *x *= 1.0);
    assert_eq!(
        unsafe { l.opt.grads_changed(&[0, 1]) }.unwrap(),
        Vec::<usize>::new()
    );
    // One element between the sampled words: only the full fingerprint sees it.
    l.grads[0][300] += 1.0;
    assert_eq!(
        unsafe { l.opt.grads_changed(&[]) }.unwrap(),
        Vec::<usize>::new()
    );
    assert_eq!(unsafe { l.opt.grads_changed(&[0]) }.unwrap(), vec![0]);
    l.end();
}

#[test]
fn a_full_question_without_a_full_fingerprint_is_answered_changed() {
    let mut l = setup(false);
    l.hand_over();
    assert_eq!(unsafe { l.opt.grads_changed(&[1, 2]) }.unwrap(), vec![1]);
    let e = unsafe { l.opt.grads_changed(&[3]) }.unwrap_err();
    assert!(
        e.to_string().contains("full[0]") && e.to_string().contains("out of range"),
        "{e}"
    );
    let e = l.opt.set_full_fingerprints(true).unwrap_err();
    assert!(e.to_string().contains("set_full_fingerprints"), "{e}");
    l.end();
    let e = unsafe { l.opt.grads_changed(&[]) }.unwrap_err();
    assert!(e.to_string().contains("no overlapped step is open"), "{e}");
}
