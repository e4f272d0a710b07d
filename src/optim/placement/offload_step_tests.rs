//! The offload case on the emulated device (`device::emulated`): host parameters stepped
//! from gradients given on the device, mirrored back to device copies, give the bits of
//! an all-host step; mirrors follow every change; refusals change nothing.
use super::super::test_views::{grads_of, optimizer_over, set_mirrors, view};
use crate::device::emulated::{self, dev, each_on, encode, values, EMULATED};
use crate::dtype::DType;
use crate::optim::math::config::{Algorithm, OptimConfig, StateFormat};
use crate::optim::Optimizer;
use crate::tensor::{Device, Tensor, TensorView};

const SIZES: [usize; 3] = [100, 0, 67];
const DT: DType = DType::BF16;

fn cfg(check_numerics: bool) -> OptimConfig {
    let mut c = OptimConfig::default_for(Algorithm::AdamW);
    (c.lr, c.state_format, c.master_weight_bits) = (1e-2, StateFormat::Quant8, 24);
    c.check_numerics = check_numerics;
    c
}

fn build(c: &OptimConfig, mem: &mut [Vec<u8>]) -> Optimizer {
    optimizer_over(c, mem, DT, &SIZES)
}

fn params() -> Vec<Vec<u8>> {
    SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| encode(DT, &values(n, i as u64)))
        .collect()
}

fn grads(s: u64) -> Vec<Vec<u8>> {
    SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| encode(DT, &values(n, 40 + s * 3 + i as u64)))
        .collect()
}

fn state(opt: &Optimizer) -> String {
    let mut out = String::new();
    for i in 0..opt.num_params() {
        for k in opt.keys_of(i) {
            out += &format!("{k}={:?};", opt.get_state(i, &k).unwrap());
        }
    }
    out
}

#[test]
fn offloaded_gradients_step_the_host_params_and_mirrors_follow() {
    if emulated::skip() {
        return;
    }
    for numerics in [false, true] {
        let c = cfg(numerics);
        let (mut ha, mut oa) = (params(), params());
        let mut host = build(&c, &mut ha);
        let mut off = build(&c, &mut oa);
        // Device copies of the params, stale until set_mirror writes them.
        let mut mirrors: Vec<Vec<u8>> = SIZES.iter().map(|&n| vec![0xAB; n * 2]).collect();
        set_mirrors(&mut off, &mut mirrors, DT, &SIZES);
        emulated::synchronize_all();
        assert_eq!(mirrors, oa, "set_mirror writes the param");
        for s in 0..3 {
            let mut g = grads(s);
            let mut skip1 = |i: usize| s == 1 && i == 2;
            let v: Vec<Option<TensorView>> = g
                .iter_mut()
                .enumerate()
                .map(|(i, b)| (!skip1(i)).then(|| view(b, DT, SIZES[i])))
                .collect();
            unsafe { host.step(&v) }.unwrap();
            unsafe { off.step(&each_on(&[dev(EMULATED); 3], &v)) }.unwrap();
            emulated::synchronize_all();
            assert_eq!(ha, oa, "step {s}, check_numerics {numerics}");
            assert_eq!(mirrors, oa, "step {s}: mirrors follow");
            let _ = &mut skip1;
        }
        assert_eq!(state(&off), state(&host));
        // A state write into the param reaches the mirror too.
        let master = Tensor::from_f32(vec![SIZES[0]], &values(SIZES[0], 9)).unwrap();
        off.set_states(0, &[("master".into(), master)]).unwrap();
        emulated::synchronize_all();
        assert_eq!(mirrors[0], oa[0]);
        assert_ne!(oa[0], ha[0]);
    }
}

#[test]
fn a_non_finite_offloaded_gradient_is_caught_before_anything_changes() {
    if emulated::skip() {
        return;
    }
    let mut oa = params();
    let before = oa.clone();
    let mut off = build(&cfg(true), &mut oa);
    let mut g = grads(0);
    g[2][10..12].copy_from_slice(&0x7fc0u16.to_le_bytes());
    let v = grads_of(&mut g, DT, &SIZES);
    let e = unsafe { off.step(&each_on(&[Device::Host, dev(EMULATED), dev(EMULATED)], &v)) }
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("gradient of p2 holds a non-finite value at flat index 5"),
        "{e}"
    );
    assert!((0..3).all(|i| !off.has_state(i)));
    drop(off);
    assert_eq!(oa, before);
}

#[test]
fn mirrors_are_checked_before_they_are_kept() {
    if emulated::skip() {
        return;
    }
    let mut oa = params();
    let mut opt = build(&cfg(false), &mut oa);
    let mut wrong = vec![0u8; SIZES[0] * 4];
    let e = unsafe {
        opt.set_mirror(
            0,
            Some(
                TensorView::on(
                    dev(EMULATED),
                    wrong.as_mut_ptr(),
                    DType::F32,
                    &[100],
                    None,
                    "m",
                )
                .unwrap(),
            ),
        )
    }
    .unwrap_err();
    // A wrong dtype is a dtype error (FO_ERR_DTYPE), not a shape one.
    assert!(matches!(e, crate::error::Error::Dtype(_)), "{e:?}");
    let e = e.to_string();
    assert!(
        e.contains("mirror of parameter p0: dtype F32 given, the parameter's BF16 expected"),
        "{e}"
    );
    let mut m = vec![0u8; SIZES[0] * 2];
    let e = unsafe { opt.set_mirror(0, Some(view(&mut m, DT, SIZES[0]))) }
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("a mirror is device memory (device >= 0), got -1"),
        "{e}"
    );
    assert!(unsafe { opt.set_mirror(7, None) }.is_err());
    assert!(m.iter().all(|&b| b == 0), "nothing was written");
    unsafe {
        opt.set_mirror(
            0,
            Some(emulated::on(dev(EMULATED), &view(&mut m, DT, SIZES[0]))),
        )
    }
    .unwrap();
    unsafe { opt.set_mirror(0, None) }.unwrap();
    emulated::synchronize_all();
    m.fill(0);
    let mut g = grads(0);
    unsafe { opt.step(&grads_of(&mut g, DT, &SIZES)) }.unwrap();
    emulated::synchronize_all();
    assert!(m.iter().all(|&b| b == 0), "a removed mirror is left alone");
}

#[test]
fn offloaded_gradients_larger_than_the_pinned_ring_give_the_host_steps_bits() {
    use crate::device::ring::RING_BYTES;
    if emulated::skip() {
        return;
    }
    // Gradients of 2.5 and 1.3 rings (bf16): pieces of the pipeline without check_numerics,
    // through the ring with it (the bound on pinned memory: `offload_pipe`'s tests).
    let sizes = [RING_BYTES * 5 / 4, RING_BYTES * 2 / 3 + 17];
    for numerics in [false, true] {
        let c = cfg(numerics);
        let mut ha: Vec<Vec<u8>> = sizes.iter().map(|&n| encode(DT, &values(n, 3))).collect();
        let mut oa = ha.clone();
        let mut host = optimizer_over(&c, &mut ha, DT, &sizes);
        let mut off = optimizer_over(&c, &mut oa, DT, &sizes);
        for s in 0..2 {
            let mut g: Vec<Vec<u8>> = sizes
                .iter()
                .map(|&n| encode(DT, &values(n, 50 + s)))
                .collect();
            let v = grads_of(&mut g, DT, &sizes);
            unsafe { host.step(&v) }.unwrap();
            unsafe { off.step(&each_on(&[dev(EMULATED); 2], &v)) }.unwrap();
            emulated::synchronize_all();
            assert!(ha == oa, "step {s}, check_numerics {numerics}");
        }
    }
}
