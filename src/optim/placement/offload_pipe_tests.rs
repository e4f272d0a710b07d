//! The pipelined offload step on the adversarial emulated device (a worker thread per
//! stream, random delays, only events order two streams): the bits of an all-host step
//! for every rule and format with tensors cut into many pieces; the gradients read only
//! after their producer on the optimizer's stream; the mirrors written only after what
//! read them there, and seen by what comes after; pinned memory bounded.
use super::super::test_views::{grads_of, optimizer_over, set_mirrors, view};
use super::*;
use crate::device::backend::Backend;
use crate::device::emulated::{self, encode, values, EMULATED};
use crate::device::lanes::LANES_BYTES;
use crate::device::ring::{RING_BYTES, SMALL_BYTES};
use crate::dtype::DType;
use crate::optim::math::config::{Algorithm, Arithmetic, OptimConfig, StateFormat};

/// (config, param dtype, grad dtype): every kind of job the pipeline cuts.
fn cases() -> Vec<(OptimConfig, DType, DType)> {
    let mut out = Vec::new();
    let mut c = OptimConfig::default_for(Algorithm::AdamW);
    (c.lr, c.state_format, c.master_weight_bits) = (1e-2, StateFormat::Fp32, 0);
    out.push((c.clone(), DType::F32, DType::F32)); // in place, 16384-element jobs
    (c.state_format, c.master_weight_bits) = (StateFormat::Quant8, 24);
    out.push((c.clone(), DType::BF16, DType::BF16));
    c.arithmetic = Arithmetic::Fast;
    out.push((c.clone(), DType::BF16, DType::F32)); // grads wider than the mirror
    let mut s = OptimConfig::default_for(Algorithm::Sgd);
    (s.lr, s.momentum, s.state_format) = (1e-2, 0.9, StateFormat::ParamDtype);
    out.push((s, DType::F16, DType::F16)); // SGD's first step copies the gradient
    let mut l = OptimConfig::default_for(Algorithm::Lion);
    (l.lr, l.state_format, l.master_weight_bits) = (1e-3, StateFormat::Quant8, 32);
    out.push((l, DType::BF16, DType::BF16));
    out
}

/// Several pieces per tensor (a lane slot is 128 KiB in tests), an empty tensor, a tail.
const SIZES: [usize; 4] = [3 * 32768 + 4100, 0, 31, 70_001];
/// The bytes of the first mirror a reader queued before each step copies out.
const PROBE: usize = 256;
/// The tests here share the emulated device and both allocate pinned probes; the first
/// bounds the device's pinned high-water mark, so they take turns (a probe of the other
/// test, alive at the same time, once broke that bound in CI).
static PROBES: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn the_pipelined_offload_step_gives_the_host_steps_bits_in_stream_order() {
    let _turn = PROBES.lock().unwrap_or_else(|e| e.into_inner());
    let Some((dev, stream)) = emulated::device_and_stream() else {
        return;
    };
    let b: &dyn Backend = &*dev;
    for (case, (c, pdt, gdt)) in cases().into_iter().enumerate() {
        let init = |i: usize, n: usize| encode(pdt, &values(n, (case * 10 + i) as u64));
        let mut ha: Vec<Vec<u8>> = SIZES.iter().enumerate().map(|(i, &n)| init(i, n)).collect();
        let mut oa = ha.clone();
        let mut host = optimizer_over(&c, &mut ha, pdt, &SIZES);
        let mut off = optimizer_over(&c, &mut oa, pdt, &SIZES);
        off.set_stream(stream).unwrap();
        // Mirrors of all but the last parameter (a piece without an up copy).
        let mut mirrors: Vec<Vec<u8>> = oa[..3].iter().map(|p| vec![0xAB; p.len()]).collect();
        set_mirrors(&mut off, &mut mirrors, pdt, &SIZES);
        emulated::synchronize_all();
        let mut before: Vec<u64> = Vec::new();
        for s in 0..3u64 {
            let gvals: Vec<Vec<u8>> = SIZES
                .iter()
                .enumerate()
                .map(|(i, &n)| encode(gdt, &values(n, 100 + s * 7 + i as u64)))
                .collect();
            // The "device" gradients hold NaN until their producer, queued on the
            // optimizer's stream behind a stall, writes them.
            let mut g: Vec<Vec<u8>> = gvals.iter().map(|v| vec![0xFF; v.len()]).collect();
            dev.stall(stream, 15);
            for (d, v) in g.iter_mut().zip(&gvals) {
                unsafe { b.ring().upload(b, d.as_mut_ptr() as u64, v, stream) }.unwrap();
            }
            // A reader of the first mirror queued there too (a forward pass): it must
            // see the mirror before this step, however late it runs.
            let seen = unsafe { b.alloc_pinned(PROBE) }.unwrap();
            dev.stall(stream, 5);
            unsafe { b.copy_to_host(seen, mirrors[0].as_ptr() as u64, PROBE, stream) }.unwrap();
            before.push(seen);
            let prev = oa[0].clone();
            let mut hg = gvals.clone();
            let hv = grads_of(&mut hg, gdt, &SIZES);
            let ov = grads_of(&mut g, gdt, &SIZES);
            unsafe { host.step(&hv) }.unwrap();
            unsafe { off.step(&emulated::each_on(&[emulated::dev(EMULATED); 4], &ov)) }.unwrap();
            // What comes after on the optimizer's stream sees the new mirrors.
            let mut after = vec![0u8; mirrors[2].len()];
            unsafe {
                b.ring()
                    .download(b, mirrors[2].as_ptr() as u64, &mut after, stream)
            }
            .unwrap();
            assert!(
                after == oa[2],
                "case {case} step {s}: the mirror after the step"
            );
            emulated::synchronize_all();
            assert!(ha == oa, "case {case} step {s}: the host step's bits");
            assert!(
                mirrors[..] == oa[..3],
                "case {case} step {s}: mirrors follow"
            );
            let seen =
                unsafe { std::slice::from_raw_parts(before[s as usize] as *const u8, PROBE) };
            assert!(
                seen == &prev[..PROBE],
                "case {case} step {s}: the mirror was overwritten before its reader ran"
            );
        }
        for (i, _) in SIZES.iter().enumerate() {
            assert_eq!(
                host.keys_of(i)
                    .iter()
                    .map(|k| host.get_state(i, k).unwrap())
                    .collect::<Vec<_>>(),
                off.keys_of(i)
                    .iter()
                    .map(|k| off.get_state(i, k).unwrap())
                    .collect::<Vec<_>>(),
                "case {case}: state of p{i}"
            );
        }
        for p in before {
            unsafe { b.free_pinned(p) };
        }
    }
    // The lanes are made once and reused: the device's pinned memory is its ring (slots
    // and small slots), its lanes and this test's probes, whatever the tensors' sizes and
    // however many steps.
    assert_eq!(b.lanes().held_bytes(), LANES_BYTES);
    let u = dev.usage();
    assert!(
        u.pinned_peak <= RING_BYTES + SMALL_BYTES + LANES_BYTES + 3 * PROBE,
        "{u:?}"
    );
}

/// Mirrors of parameters stepped from host gradients (and the overlapped step's) go up
/// through the up lane too: after the work that read them on the optimizer's stream,
/// before what comes after it there.
#[test]
fn mirror_writes_go_up_the_lane_in_the_optimizers_stream_order() {
    let _turn = PROBES.lock().unwrap_or_else(|e| e.into_inner());
    let Some((dev, stream)) = emulated::device_and_stream() else {
        return;
    };
    let b: &dyn Backend = &*dev;
    // Four pieces: the host never waits for a slot of this step, so nothing but the
    // stream order keeps later work from reading the mirror early.
    let n = 3 * 32768 + 77;
    let mut c = OptimConfig::default_for(Algorithm::AdamW);
    (c.lr, c.state_format, c.master_weight_bits) = (1e-2, StateFormat::Fp32, 0);
    let mut pa = encode(DType::F32, &values(n, 5));
    let mut opt = Optimizer::new(c).unwrap();
    unsafe { opt.add_param("w", view(&mut pa, DType::F32, n), None, 0) }.unwrap();
    opt.set_stream(stream).unwrap();
    let mut mirror = vec![0u8; pa.len()];
    set_mirrors(
        &mut opt,
        std::slice::from_mut(&mut mirror),
        DType::F32,
        &[n],
    );
    emulated::synchronize_all();
    for s in 0..3u64 {
        let prev = pa.clone();
        // A reader of the mirror queued before the step, behind a stall; the up lane
        // busy for longer, so what comes after the step must wait for it.
        dev.stall(stream, 10);
        let up = unsafe { b.lanes().stream(b, crate::device::lanes::Dir::Up) }.unwrap();
        dev.stall(up, 30);
        let seen = unsafe { b.alloc_pinned(PROBE) }.unwrap();
        unsafe { b.copy_to_host(seen, mirror.as_ptr() as u64, PROBE, stream) }.unwrap();
        let mut g = encode(DType::F32, &values(n, 60 + s));
        unsafe { opt.step(&[Some(view(&mut g, DType::F32, n))]) }.unwrap();
        let mut after = vec![0u8; mirror.len()];
        unsafe {
            b.ring()
                .download(b, mirror.as_ptr() as u64, &mut after, stream)
        }
        .unwrap();
        emulated::synchronize_all();
        assert!(
            after == pa,
            "step {s}: work after the step sees the new mirror"
        );
        let seen_now = unsafe { std::slice::from_raw_parts(seen as *const u8, PROBE) };
        assert!(
            seen_now == &prev[..PROBE],
            "step {s}: the reader saw the old mirror"
        );
        unsafe { b.free_pinned(seen) };
    }
}
