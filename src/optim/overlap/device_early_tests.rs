//! Early device steps on the emulated device (whose streams run their work late and in
//! random interleavings): device parameters handed over during an overlapped step step at
//! once on the device's step lane, with the bits of an all-host `step` (clipping, rollback
//! by the clip, by `step_abort`, by a failing step and by drop included), beside work
//! queued on the optimizer's stream after their hand-over.
use super::offload_tests::{grads, params, view, DT, SIZES};
use super::{OverlapOptions, OverlapStats};
use crate::clip::{clip_grad_norm_checked, ClipGrad};
use crate::comm::Comm;
use crate::device::backend::Backend as _;
use crate::device::emulated::{self, encode, values, EMULATED};
use crate::optim::math::config::{Algorithm, OptimConfig, StateFormat};
use crate::optim::Optimizer;
use crate::tensor::TensorView;

fn on_device(t: &TensorView) -> TensorView {
    emulated::on(emulated::dev(EMULATED), t)
}

/// `offload_tests`' sizes and values: quant8 with 24-bit masters (FlashOptim's layout)
/// for p0 and p1, fp32 AdamW for p2; on the emulated device or on the host.
fn build(mem: &mut [Vec<u8>], device: bool) -> Optimizer {
    let mut q8 = OptimConfig::default_for(Algorithm::AdamW);
    (q8.lr, q8.weight_decay) = (1e-2, 0.05);
    (q8.state_format, q8.master_weight_bits) = (StateFormat::Quant8, 24);
    let mut f32 = OptimConfig::default_for(Algorithm::AdamW);
    (f32.state_format, f32.master_weight_bits) = (StateFormat::Fp32, 0);
    let mut opt = Optimizer::new(q8).unwrap();
    opt.add_param_group(f32).unwrap();
    for (i, b) in mem.iter_mut().enumerate() {
        let v = view(b, SIZES[i]);
        let v = if device { on_device(&v) } else { v };
        unsafe { opt.add_param(&format!("p{i}"), v, None, usize::from(i == 2)) }.unwrap();
    }
    opt
}

/// The host optimizer's step with gradients `g` (clipped first when `max_norm` > 0).
fn host_step(host: &mut Optimizer, g: &mut [Vec<u8>], max_norm: f64) {
    let comm = Comm::local_group(1).pop().unwrap();
    let v: Vec<TensorView> = (g.iter_mut().enumerate())
        .map(|(i, b)| view(b, SIZES[i]))
        .collect();
    if max_norm > 0.0 {
        let list = v.iter().map(|t| ClipGrad {
            tensor: t.clone(),
            is_shard: false,
        });
        unsafe { clip_grad_norm_checked(&comm, Ok(list.collect()), max_norm, 2.0, false) }.unwrap();
    }
    unsafe { host.step(&v.into_iter().map(Some).collect::<Vec<_>>()) }.unwrap();
}

/// Device gradients over `g`, one per parameter.
fn device_grads(g: &mut [Vec<u8>]) -> Vec<TensorView> {
    (g.iter_mut().enumerate())
        .map(|(i, b)| on_device(&view(b, SIZES[i])))
        .collect()
}

/// Every parameter's state, as text (device parameters' read back from the device).
fn states(opt: &Optimizer, device: bool) -> Vec<String> {
    (0..SIZES.len())
        .map(|i| match device {
            true => format!("{:?}", opt.device_state(i).ok()),
            false => format!("{:?}", opt.param_state(i)),
        })
        .collect()
}

#[test]
fn device_parameters_step_early_with_the_bits_of_the_host_step_clipped_or_not() {
    if emulated::skip() {
        return;
    }
    for max_norm in [0.0, 0.05, 1e9] {
        let (mut ha, mut da) = (params(), params());
        let mut host = build(&mut ha, false);
        let mut dev = build(&mut da, true);
        for s in 0..3 {
            let (mut gh, mut gd) = (grads(s), grads(s));
            host_step(&mut host, &mut gh, max_norm);
            let vd = device_grads(&mut gd);
            let opts = OverlapOptions {
                max_norm,
                ..OverlapOptions::default()
            };
            let mut st = OverlapStats::default();
            unsafe {
                dev.step_begin(opts).unwrap();
                for i in (0..SIZES.len()).rev() {
                    dev.grads_ready(&[i], &[vd[i].clone()]).unwrap();
                }
                dev.step_end(None, &mut st).unwrap();
            }
            emulated::synchronize_all();
            let n = SIZES.len() as u64;
            assert_eq!((st.speculative, st.deferred), (n, 0), "{st:?}");
            assert!(st.undo_high_water_bytes > 0, "{st:?}");
            assert_eq!(ha, da, "max_norm {max_norm} step {s}: parameters");
            assert_eq!(states(&host, false), states(&dev, true), "step {s}: state");
            assert_eq!(gh, gd, "gradients scaled alike");
            if max_norm == 0.05 {
                assert!(st.clipped && st.rolled_back == n, "{st:?}");
                assert!(st.rolled_back_bytes > 0, "{st:?}");
            } else {
                assert_eq!(st.rolled_back, 0, "{st:?}");
            }
        }
        let d = emulated::device_at(EMULATED).unwrap();
        assert!(d.take_violations().is_empty());
    }
}

/// The early step waits for the work queued on the optimizer's stream before its
/// hand-over (the gradient's producer) and for nothing queued after it (the rest of
/// backward): it is done while that work still runs.
#[test]
fn a_device_parameter_steps_while_later_work_on_the_optimizers_stream_still_runs() {
    if emulated::skip() {
        return;
    }
    let d = emulated::device_at(EMULATED).unwrap();
    let stream = emulated::create_stream(EMULATED);
    let (mut ha, mut da) = (params(), params());
    let mut host = build(&mut ha, false);
    let mut dev = build(&mut da, true);
    dev.set_stream(stream).unwrap();
    let (mut gh, mut gd) = (grads(0), grads(0));
    host_step(&mut host, &mut gh, 0.0);
    // p1's gradient is written by its producer, queued on the optimizer's stream (late)
    // before the hand-over: the early step must wait for it.
    let g1 = std::mem::replace(&mut gd[1], vec![0; SIZES[1] * 2]);
    let vd = device_grads(&mut gd);
    let stall = std::time::Duration::from_millis(1500);
    let mut st = OverlapStats::default();
    unsafe {
        dev.step_begin(OverlapOptions::default()).unwrap();
        d.stall(stream, 100);
        d.upload(vd[1].as_ptr() as u64, &g1, stream).unwrap();
        dev.grads_ready(&[1], &[vd[1].clone()]).unwrap();
        let t0 = std::time::Instant::now();
        d.stall(stream, stall.as_millis() as u64);
        let before = params()[1].clone();
        let p = da[1].as_ptr();
        // Read while the lane writes: volatile, byte by byte.
        let changed = || (0..before.len()).any(|k| std::ptr::read_volatile(p.add(k)) != before[k]);
        while !changed() {
            assert!(
                t0.elapsed() < stall * 2 / 3,
                "the early device step waited for work queued after its hand-over"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        dev.grads_ready(&[2, 0], &[vd[2].clone(), vd[0].clone()])
            .unwrap();
        dev.step_end(None, &mut st).unwrap();
    }
    emulated::synchronize_all();
    assert_eq!(st.speculative, SIZES.len() as u64, "{st:?}");
    assert_eq!(ha, da);
    assert_eq!(states(&host, false), states(&dev, true));
}

/// A step dropped by the loop (`step_abort`), one that fails at `step_end` (a bad
/// gradient handed over after the others stepped early) and one left open when the
/// optimizer is destroyed change nothing: parameters and state as before, a state the
/// step created gone; the next step has the bits of a host optimizer that never saw them.
#[test]
fn aborted_failed_and_dropped_steps_put_device_parameters_back() {
    if emulated::skip() {
        return;
    }
    let (mut ha, mut da) = (params(), params());
    let mut host = build(&mut ha, false);
    let mut dev = build(&mut da, true);
    let mut short = encode(DT, &values(SIZES[2] - 1, 7));
    for s in 0..4u64 {
        let (mut gh, mut gd) = (grads(s), grads(s));
        let vd = device_grads(&mut gd);
        let (before, before_states) = (da.clone(), states(&dev, true));
        let mut st = OverlapStats::default();
        unsafe {
            dev.step_begin(OverlapOptions::default()).unwrap();
            // Only p0 and p1 at step 0 (p2 gets no state yet on either side) and at
            // step 2 (p2's gradient is bad).
            let handed = if s == 0 || s == 2 { 2 } else { 3 };
            for (i, g) in vd.iter().enumerate().take(handed) {
                dev.grads_ready(&[i], std::slice::from_ref(g)).unwrap();
            }
            match s {
                1 => dev.step_abort(&mut st).unwrap(),
                2 => {
                    // A gradient of the wrong shape fails the step.
                    let bad = on_device(&view(&mut short, SIZES[2] - 1));
                    assert!(dev.grads_ready(&[2], &[bad]).is_err());
                    assert!(dev.step_end(None, &mut st).is_err());
                }
                _ => dev.step_end(None, &mut st).unwrap(),
            }
        }
        emulated::synchronize_all();
        if s == 1 || s == 2 {
            assert_eq!(da, before, "step {s}: parameters put back");
            assert_eq!(
                states(&dev, true),
                before_states,
                "step {s}: state put back"
            );
            assert!(st.rolled_back >= 2, "{st:?}");
            continue;
        }
        let v: Vec<Option<TensorView>> = (gh.iter_mut().enumerate())
            .map(|(i, b)| (s > 0 || i < 2).then(|| view(b, SIZES[i])))
            .collect();
        unsafe { host.step(&v) }.unwrap();
        assert_eq!(ha, da, "step {s}");
        assert_eq!(states(&host, false), states(&dev, true), "step {s}");
    }
    // Left open when the optimizer goes: the parameters are put back.
    let before = da.clone();
    let mut gd = grads(9);
    let vd = device_grads(&mut gd);
    unsafe {
        dev.step_begin(OverlapOptions::default()).unwrap();
        dev.grads_ready(&[0, 1, 2], &vd).unwrap();
    }
    drop(dev);
    emulated::synchronize_all();
    assert_eq!(da, before, "dropped with its step open");
}

/// Past the undo budget a device parameter waits for `step_end` (no record), as a host
/// one does; the step has the same bits.
#[test]
fn device_parameters_past_the_undo_budget_wait_for_step_end() {
    if emulated::skip() {
        return;
    }
    let (mut ha, mut da) = (params(), params());
    let mut host = build(&mut ha, false);
    let mut dev = build(&mut da, true);
    for s in 0..2 {
        let (mut gh, mut gd) = (grads(s), grads(s));
        host_step(&mut host, &mut gh, 0.0);
        let vd = device_grads(&mut gd);
        // Room for p0's record only (its bf16 bytes and, from step 1, its state).
        let budget = SIZES[0] * 2
            + if s == 0 {
                0
            } else {
                dev.device_state(0).unwrap().nbytes()
            };
        let opts = OverlapOptions {
            undo_budget_bytes: budget,
            ..OverlapOptions::default()
        };
        let mut st = OverlapStats::default();
        unsafe {
            dev.step_begin(opts).unwrap();
            for (i, g) in vd.iter().enumerate() {
                dev.grads_ready(&[i], std::slice::from_ref(g)).unwrap();
            }
            dev.step_end(None, &mut st).unwrap();
        }
        emulated::synchronize_all();
        assert_eq!((st.speculative, st.deferred), (1, 2), "step {s}: {st:?}");
        assert_eq!(st.undo_high_water_bytes, budget as u64);
        assert_eq!(ha, da, "step {s}");
        assert_eq!(states(&host, false), states(&dev, true), "step {s}");
    }
}

/// A hand-over never waits on the host for the device, and its undo record is two copies
/// (parameter, state) whatever the state's buffers: each early step's one-row table
/// goes up through the ring, and a ring slot reused while the copy queued from it still
/// waits (on the step lane, behind the gradient's producer) blocked the hook that handed
/// over, so the host could not queue backward's next kernels ahead of the GPU (measured
/// on an H200: `fo quant8 overlap` 0.35x torch's fused AdamW; a 4-slot ring blocked from
/// the fifth hand-over on).
#[test]
fn hand_overs_queue_their_steps_without_waiting_for_the_device() {
    if emulated::skip() {
        return;
    }
    const N: usize = 40;
    let d = emulated::device_at(EMULATED).unwrap();
    let stream = emulated::create_stream(EMULATED);
    let mut c = OptimConfig::default_for(Algorithm::AdamW);
    (c.lr, c.state_format, c.master_weight_bits) = (1e-2, StateFormat::Quant8, 24);
    let sizes: Vec<usize> = (0..N).map(|i| 40 + 7 * i).collect();
    let init = |i: usize| encode(DT, &values(sizes[i], i as u64));
    let (mut ha, mut da): (Vec<Vec<u8>>, Vec<Vec<u8>>) = (0..N).map(|i| (init(i), init(i))).unzip();
    let (mut host, mut dev) = (
        Optimizer::new(c.clone()).unwrap(),
        Optimizer::new(c).unwrap(),
    );
    for i in 0..N {
        let name = format!("layers.{i}.weight");
        unsafe {
            host.add_param(&name, view(&mut ha[i], sizes[i]), None, 0)
                .unwrap();
            dev.add_param(&name, on_device(&view(&mut da[i], sizes[i])), None, 0)
                .unwrap();
        }
    }
    dev.set_stream(stream).unwrap();
    for s in 0..3u64 {
        let g = |i: usize| encode(DT, &values(sizes[i], 100 + 3 * s + i as u64));
        let (mut gh, mut gd): (Vec<Vec<u8>>, Vec<Vec<u8>>) = (0..N).map(|i| (g(i), g(i))).unzip();
        let vh: Vec<Option<TensorView>> = (gh.iter_mut().enumerate())
            .map(|(i, b)| Some(view(b, sizes[i])))
            .collect();
        unsafe { host.step(&vh) }.unwrap();
        let mut st = OverlapStats::default();
        unsafe {
            dev.step_begin(OverlapOptions::default()).unwrap();
            // Backward's producers, late on the optimizer's stream: every hand-over's
            // step waits for them on the device, and none of the hand-overs on the host.
            d.stall(stream, 3000);
            let before = emulated::blocking_waits_on_this_thread();
            let copies = emulated::device_copies_on_this_thread();
            let t0 = std::time::Instant::now();
            for i in (0..N).rev() {
                let v = on_device(&view(&mut gd[i], sizes[i]));
                dev.grads_ready(&[i], &[v]).unwrap();
            }
            let waited = emulated::blocking_waits_on_this_thread() - before;
            assert!(
                waited == 0 && t0.elapsed() < std::time::Duration::from_millis(2500),
                "step {s}: {waited} hand-overs of {N} waited for the device ({:?})",
                t0.elapsed()
            );
            // Each undo record is two copies: the parameter, and its state's one block
            // (none before the first step made it).
            let per_record = if s == 0 { 1 } else { 2 };
            assert_eq!(
                emulated::device_copies_on_this_thread() - copies,
                per_record * N,
                "step {s}"
            );
            dev.step_end(None, &mut st).unwrap();
        }
        emulated::synchronize_all();
        assert_eq!(st.speculative, N as u64, "{st:?}");
        assert_eq!(ha, da, "step {s}: the host step's bits");
    }
    assert!(d.take_violations().is_empty());
}
