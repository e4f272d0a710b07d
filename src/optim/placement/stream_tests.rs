//! Streams on the adversarial emulated devices (`device::emulated`: a worker per stream,
//! random delays, only events order two streams): an optimizer's stream belongs to one
//! device, and a new stream's work comes after the old one's.
use super::*;
use crate::device::emulated::{self, encode, values, EMULATED};
use crate::dtype::DType;
use crate::optim::math::config::{Algorithm, OptimConfig};

const N: usize = 300;

fn view(b: &mut [u8]) -> TensorView {
    unsafe { TensorView::host(b.as_mut_ptr(), DType::F32, &[N as i64], None, "t").unwrap() }
}

fn adamw() -> Optimizer {
    let mut c = OptimConfig::default_for(Algorithm::AdamW);
    c.master_weight_bits = 0;
    Optimizer::new(c).unwrap()
}

/// Registers `b` as parameter `name`, claimed as memory of emulated device `ordinal`.
unsafe fn add_on(opt: &mut Optimizer, name: &str, ordinal: i32, b: &mut [u8]) -> Result<usize> {
    opt.add_param(
        name,
        emulated::on(emulated::dev(ordinal), &view(b)),
        None,
        0,
    )
}

/// A host optimizer and one on device `EMULATED`, each holding parameter "p" with the
/// same values (`hp`, `dp`: returned, as the optimizers point into them), so their
/// steps can be compared.
fn host_and_device(seed: u64) -> (Vec<u8>, Vec<u8>, Optimizer, Optimizer) {
    let mut hp = encode(DType::F32, &values(N, seed));
    let mut dp = hp.clone();
    let (mut host, mut opt) = (adamw(), adamw());
    unsafe {
        host.add_param("p", view(&mut hp), None, 0).unwrap();
        add_on(&mut opt, "p", EMULATED, &mut dp).unwrap();
    }
    (hp, dp, host, opt)
}

/// One step of both with gradient `g` (the device one's claimed as device memory).
fn step_both(host: &mut Optimizer, opt: &mut Optimizer, g: &mut [u8]) {
    let g = Some(view(g));
    unsafe { host.step(std::slice::from_ref(&g)) }.unwrap();
    unsafe { opt.step(&emulated::each_on(&[emulated::dev(EMULATED)], &[g])) }.unwrap();
}

#[test]
fn a_stream_of_one_device_is_refused_for_another_devices_work_before_anything_is_queued() {
    if emulated::skip() {
        return;
    }
    let (d0, d1) = (EMULATED, EMULATED + 1);
    let s0 = emulated::create_stream(d0);
    let (mut a, mut b) = (
        encode(DType::F32, &values(N, 1)),
        encode(DType::F32, &values(N, 2)),
    );
    let before = (a.clone(), b.clone());
    // Parameters on two devices, then a stream of the first: refused, naming the second.
    let mut opt = adamw();
    unsafe {
        add_on(&mut opt, "p0", d0, &mut a).unwrap();
        add_on(&mut opt, "p1", d1, &mut b).unwrap();
    }
    let e = opt.set_stream(s0).unwrap_err().to_string();
    assert!(
        e.contains("parameter p1 is on CUDA device 78, and the optimizer's stream is not a stream of that device"),
        "{e}"
    );
    assert!(e.contains("emulated device 77 made it"), "{e}");
    assert_eq!(opt.stream(), 0, "a refused stream is not kept");
    // The legacy default stream (each device's own) steps both devices.
    let (mut g0, mut g1) = (
        encode(DType::F32, &values(N, 3)),
        encode(DType::F32, &values(N, 4)),
    );
    unsafe {
        opt.step(&emulated::each_on(
            &[emulated::dev(d0), emulated::dev(d1)],
            &[Some(view(&mut g0)), Some(view(&mut g1))],
        ))
    }
    .unwrap();
    emulated::synchronize_all();
    assert!(a != before.0 && b != before.1, "both devices stepped");

    // A stream first, then a parameter on another device: refused at registration.
    let mut opt = adamw();
    let (mut c, mut d) = (before.0.clone(), before.1.clone());
    unsafe { add_on(&mut opt, "p0", d0, &mut c) }.unwrap();
    opt.set_stream(s0).unwrap();
    let e = unsafe { add_on(&mut opt, "p1", d1, &mut d) }
        .unwrap_err()
        .to_string();
    assert!(e.contains("parameter p1 is on CUDA device 78"), "{e}");
    assert_eq!(opt.num_params(), 1, "p1 was not registered");
    // An offloaded gradient on the other device: refused before anything changes.
    let mut h = before.0.clone();
    unsafe { opt.add_param("h", view(&mut h), None, 0) }.unwrap();
    let e = unsafe {
        opt.step(&emulated::each_on(
            &[emulated::dev(d0), emulated::dev(d1)],
            &[Some(view(&mut g0)), Some(view(&mut g1))],
        ))
    }
    .unwrap_err()
    .to_string();
    assert!(e.contains("the gradient of h is on CUDA device 78"), "{e}");
    emulated::synchronize_all();
    assert_eq!((&c, &h), (&before.0, &before.0), "nothing stepped");
    assert!(!opt.has_state(0), "no state was made");
}

#[test]
fn a_step_on_a_new_stream_runs_after_the_steps_on_the_old_one() {
    if emulated::skip() {
        return;
    }
    let dev = emulated::device().unwrap();
    let (sa, sb) = (
        emulated::create_stream(EMULATED),
        emulated::create_stream(EMULATED),
    );
    let (hp, dp, mut host, mut opt) = host_and_device(5);
    let mut grads: Vec<Vec<u8>> = (0..3)
        .map(|s| encode(DType::F32, &values(N, 10 + s)))
        .collect();
    for (s, stream) in [sa, sb, sa].into_iter().enumerate() {
        opt.set_stream(stream).unwrap();
        if s == 0 {
            // Stream A is still busy (a slow backward, say) when the steps are queued:
            // without an event, step 1 on B would run first.
            dev.stall(stream, 200);
        }
        step_both(&mut host, &mut opt, &mut grads[s]);
    }
    emulated::synchronize_all();
    assert_eq!(dp, hp, "the three steps ran in order");
}

#[test]
fn a_steps_launch_table_is_copied_from_pinned_memory_still_held_when_the_copy_runs() {
    let Some((dev, stream)) = emulated::device_and_stream() else {
        return;
    };
    let (hp, dp, mut host, mut opt) = host_and_device(6);
    opt.set_stream(stream).unwrap();
    let mut grads: Vec<Vec<u8>> = (0..3)
        .map(|s| encode(DType::F32, &values(N, 20 + s)))
        .collect();
    for g in grads.iter_mut() {
        // The stream is busy: the table's copy runs after `step` returned, when its
        // host buffer would be gone were it not the ring's pinned slot.
        dev.stall(stream, 20);
        step_both(&mut host, &mut opt, g);
    }
    // Panics, naming the copy, where a queued copy read pageable or freed host memory.
    emulated::synchronize_all();
    assert_eq!(dp, hp, "the steps read their tables");
}

#[test]
fn host_memory_and_another_devices_memory_are_refused_naming_the_argument_before_anything_is_queued(
) {
    use crate::device::backend::Backend as _;
    if emulated::skip() {
        return;
    }
    let (d0, d1) = (EMULATED, EMULATED + 1);
    let other = emulated::device_at(d1).unwrap();
    // Memory device 78 allocated, given as device 77's.
    let foreign = unsafe { other.alloc_zeroed(N * 4, 0) }.unwrap();
    emulated::synchronize_all();
    let foreign_view = || {
        unsafe { TensorView::host(foreign as *mut u8, DType::F32, &[N as i64], None, "f") }.unwrap()
    };
    let mut host = encode(DType::F32, &values(N, 7));
    let _host_mark = emulated::mark_host(&host);
    let mut opt = adamw();
    let e = unsafe { add_on(&mut opt, "h", d0, &mut host) }.unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    let e = e.to_string();
    assert!(e.contains("`param`: parameter h: pointer 0x"), "{e}");
    assert!(e.contains("is host memory, not device 77's"), "{e}");
    let e = unsafe {
        opt.add_param(
            "f",
            emulated::on(emulated::dev(d0), &foreign_view()),
            None,
            0,
        )
    }
    .unwrap_err()
    .to_string();
    assert!(e.contains("parameter f: pointer"), "{e}");
    assert!(e.contains("is memory of device 78, not device 77's"), "{e}");
    assert_eq!(opt.num_params(), 0, "nothing was registered");

    // Gradients: host memory, another device's memory.
    let mut p = encode(DType::F32, &values(N, 8));
    let before = p.clone();
    unsafe { add_on(&mut opt, "p", d0, &mut p) }.unwrap();
    let mut g = encode(DType::F32, &values(N, 9));
    let _grad_mark = emulated::mark_host(&g);
    let e = unsafe {
        opt.step(&emulated::each_on(
            &[emulated::dev(d0)],
            &[Some(view(&mut g))],
        ))
    }
    .unwrap_err()
    .to_string();
    assert!(e.contains("`grads`: gradient of p: pointer"), "{e}");
    assert!(e.contains("is host memory, not device 77's"), "{e}");
    let e = unsafe {
        opt.step(&emulated::each_on(
            &[emulated::dev(d0)],
            &[Some(foreign_view())],
        ))
    }
    .unwrap_err()
    .to_string();
    assert!(e.contains("is memory of device 78, not device 77's"), "{e}");

    // A mirror in host memory.
    let mut hp = encode(DType::F32, &values(N, 10));
    unsafe { opt.add_param("hp", view(&mut hp), None, 0) }.unwrap();
    let mut m = vec![0u8; N * 4];
    let _mirror_mark = emulated::mark_host(&m);
    let e = unsafe { opt.set_mirror(1, Some(emulated::on(emulated::dev(d0), &view(&mut m)))) }
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`mirror`: mirror of parameter hp: pointer"),
        "{e}"
    );
    assert!(e.contains("is host memory, not device 77's"), "{e}");

    emulated::synchronize_all();
    assert_eq!(p, before, "nothing stepped");
    assert!(!opt.has_state(0), "no state was made");
    assert!(
        m.iter().all(|&b| b == 0),
        "the refused mirror was not written"
    );
    unsafe { other.free(foreign) };
}
