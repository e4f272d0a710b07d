//! The caller's current context is current again after every fo call that touches a
//! device (on the emulated devices, whose calls push their context as CUDA's do): a
//! torch extension calling fo finds its own context current afterwards.
use super::{Emulated, Guard};
use crate::clip::{clip_grad_norm_checked, ClipGrad};
use crate::comm::Comm;
use crate::device::emulated::{self, encode, values, EMULATED};
use crate::dtype::DType;
use crate::optim::math::config::{Algorithm, OptimConfig};
use crate::optim::Optimizer;
use crate::tensor::{Tensor, TensorView};

const N: usize = 200;
/// The caller's own context (torch's, say).
const CALLER: usize = 0xCA11;

fn view(b: &mut [u8], dt: DType) -> TensorView {
    unsafe { TensorView::host(b.as_mut_ptr(), dt, &[N as i64], None, "t").unwrap() }
}

/// `b` as memory of the emulated device `EMULATED`.
fn on_device(b: &mut [u8], dt: DType) -> TensorView {
    emulated::on(emulated::dev(EMULATED), &view(b, dt))
}

#[test]
fn every_fo_call_that_touches_a_device_leaves_the_callers_context_current() {
    if emulated::skip() {
        return;
    }
    let _caller = unsafe { Guard::<Emulated>::push(CALLER) }.unwrap();
    let mut seen = 0;
    let mut after = |what: &str| {
        assert_eq!(
            (Emulated::current(), Emulated::depth()),
            (CALLER, 1),
            "after {what}"
        );
        seen += 1;
    };
    let stream = emulated::create_stream(EMULATED);
    let mut c = OptimConfig::default_for(Algorithm::AdamW);
    c.master_weight_bits = 0;
    let mut opt = Optimizer::new(c).unwrap();
    let (mut dp, mut hp) = (
        encode(DType::F32, &values(N, 1)),
        encode(DType::F32, &values(N, 2)),
    );
    let mut mirror = vec![0u8; N * 4];
    unsafe { opt.add_param("d", on_device(&mut dp, DType::F32), None, 0) }.unwrap();
    after("add_param (on the device)");
    unsafe { opt.add_param("h", view(&mut hp, DType::F32), None, 0) }.unwrap();
    opt.set_stream(stream).unwrap();
    after("set_stream");
    unsafe { opt.set_mirror(1, Some(on_device(&mut mirror, DType::F32))) }.unwrap();
    after("set_mirror");
    let (mut g0, mut g1) = (
        encode(DType::F32, &values(N, 3)),
        encode(DType::F32, &values(N, 4)),
    );
    let grads = [
        Some(on_device(&mut g0, DType::F32)),
        Some(on_device(&mut g1, DType::F32)),
    ];
    // The device step and the offload case (a host param, its gradient on the device).
    unsafe { opt.step(&grads) }.unwrap();
    after("step");
    let exp_avg = opt.get_state(0, "exp_avg").unwrap();
    after("get_state (a device state comes down)");
    let zeros = Tensor::from_f32(vec![N], &vec![0.0; N]).unwrap();
    opt.set_states(0, &[("exp_avg".into(), zeros)]).unwrap();
    after("set_states (a device state goes up)");
    assert_eq!(exp_avg.shape, vec![N]);
    // A refused call restores it too.
    let mut host = encode(DType::F32, &values(N, 5));
    let _mark = emulated::mark_host(&host);
    assert!(unsafe { opt.step(&[Some(on_device(&mut host, DType::F32)), None]) }.is_err());
    after("a refused step");

    let comm = Comm::local_group(1).pop().unwrap();
    let mut g = encode(DType::F32, &values(N, 6));
    let grads = vec![ClipGrad {
        tensor: on_device(&mut g, DType::F32),
        is_shard: true,
    }];
    unsafe { clip_grad_norm_checked(&comm, Ok(grads), 0.5, 2.0, true) }.unwrap();
    after("clip_grad_norm");
    drop(opt);
    after("the optimizer's drop (device state freed)");
    emulated::synchronize_all();
    assert_eq!(seen, 9);
}
