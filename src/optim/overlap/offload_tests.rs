//! The overlapped step's offload case on the emulated device: host parameters whose
//! gradients are on the device step early (each task brings its gradient down to a
//! host copy first, through the pinned ring) with the bits of an all-host step and of the
//! pipelined `step`, mirrors follow, and clipping matches `clip_grad_norm` then step.
use super::{OverlapOptions, OverlapStats};
use crate::clip::{clip_grad_norm_checked, ClipGrad};
use crate::comm::Comm;
use crate::device::emulated::{self, encode, values, EMULATED};
use crate::dtype::DType;
use crate::optim::math::config::{Algorithm, OptimConfig, StateFormat};
use crate::optim::Optimizer;
use crate::tensor::TensorView;

/// Partial scale groups (also `device_early_tests`' sizes).
pub(super) const SIZES: [usize; 3] = [100, 2048 + 33, 67];
pub(super) const DT: DType = DType::BF16;

pub(super) fn view(b: &mut [u8], n: usize) -> TensorView {
    unsafe { TensorView::host(b.as_mut_ptr(), DT, &[n as i64], None, "t").unwrap() }
}

fn build(mem: &mut [Vec<u8>]) -> Optimizer {
    let mut c = OptimConfig::default_for(Algorithm::AdamW);
    (c.lr, c.state_format, c.master_weight_bits) = (1e-2, StateFormat::Quant8, 24);
    let mut opt = Optimizer::new(c).unwrap();
    for (i, b) in mem.iter_mut().enumerate() {
        unsafe { opt.add_param(&format!("p{i}"), view(b, SIZES[i]), None, 0) }.unwrap();
    }
    opt
}

pub(super) fn params() -> Vec<Vec<u8>> {
    (SIZES.iter().enumerate())
        .map(|(i, &n)| encode(DT, &values(n, i as u64)))
        .collect()
}

pub(super) fn grads(s: u64) -> Vec<Vec<u8>> {
    (SIZES.iter().enumerate())
        .map(|(i, &n)| encode(DT, &values(n, 40 + s * 3 + i as u64)))
        .collect()
}

#[test]
fn offloaded_gradients_step_early_with_the_bits_of_the_host_step_and_mirrors_follow() {
    if emulated::skip() {
        return;
    }
    let comm = Comm::local_group(1).pop().unwrap();
    for max_norm in [0.0, 0.05, 1e9] {
        let (mut ha, mut oa) = (params(), params());
        let mut host = build(&mut ha);
        let mut off = build(&mut oa);
        let mut mirrors: Vec<Vec<u8>> = SIZES.iter().map(|&n| vec![0xAB; n * 2]).collect();
        for (i, m) in mirrors.iter_mut().enumerate() {
            unsafe {
                off.set_mirror(
                    i,
                    Some(emulated::on(emulated::dev(EMULATED), &view(m, SIZES[i]))),
                )
            }
            .unwrap();
        }
        for s in 0..3 {
            let (mut gh, mut gd) = (grads(s), grads(s));
            let vh: Vec<TensorView> = (gh.iter_mut().enumerate())
                .map(|(i, b)| view(b, SIZES[i]))
                .collect();
            if max_norm > 0.0 {
                let list = vh.iter().map(|t| ClipGrad {
                    tensor: t.clone(),
                    is_shard: false,
                });
                unsafe { clip_grad_norm_checked(&comm, Ok(list.collect()), max_norm, 2.0, false) }
                    .unwrap();
            }
            unsafe { host.step(&vh.iter().cloned().map(Some).collect::<Vec<_>>()) }.unwrap();
            // The device gradients, handed over last to first, one per call.
            let vd: Vec<TensorView> = (gd.iter_mut().enumerate())
                .map(|(i, b)| view(b, SIZES[i]))
                .collect();
            let opts = OverlapOptions {
                max_norm,
                ..OverlapOptions::default()
            };
            let mut st = OverlapStats::default();
            unsafe {
                off.step_begin(opts).unwrap();
                for i in (0..SIZES.len()).rev() {
                    off.grads_ready(&[i], &[emulated::on(emulated::dev(EMULATED), &vd[i])])
                        .unwrap();
                }
                off.step_end(Some(&comm), &mut st).unwrap();
            }
            emulated::synchronize_all();
            assert_eq!(st.speculative, SIZES.len() as u64, "{st:?}");
            assert_eq!(ha, oa, "max_norm {max_norm} step {s}");
            assert_eq!(mirrors, oa, "max_norm {max_norm} step {s}: mirrors follow");
            assert_eq!(gh, gd, "gradients scaled alike");
            if max_norm == 0.05 {
                assert!(st.clipped && st.rolled_back == SIZES.len() as u64, "{st:?}");
            }
        }
    }
}

/// An offloaded gradient comes down while the optimizer's stream is still busy with what
/// was queued after its hand-over (the rest of backward): its copy waits for its producer
/// only, so its early step is done long before that work is. Before, the copy was queued
/// on the optimizer's stream when the task ran, behind that work.
#[test]
fn an_offloaded_gradient_steps_while_later_work_on_the_optimizers_stream_still_runs() {
    if emulated::skip() {
        return;
    }
    let dev = emulated::device_at(EMULATED).unwrap();
    let stream = emulated::create_stream(EMULATED);
    let (mut ha, mut oa) = (params(), params());
    let mut host = build(&mut ha);
    let mut off = build(&mut oa);
    off.set_stream(stream).unwrap();
    let (mut gh, mut gd) = (grads(0), grads(0));
    let vh: Vec<Option<TensorView>> = (gh.iter_mut().enumerate())
        .map(|(i, b)| Some(view(b, SIZES[i])))
        .collect();
    unsafe { host.step(&vh) }.unwrap();
    let vd: Vec<TensorView> = (gd.iter_mut().enumerate())
        .map(|(i, b)| view(b, SIZES[i]))
        .collect();
    let mut st = OverlapStats::default();
    let stall = std::time::Duration::from_millis(1500);
    unsafe {
        off.step_begin(OverlapOptions::default()).unwrap();
        off.grads_ready(&[1], &[emulated::on(emulated::dev(EMULATED), &vd[1])])
            .unwrap();
        // The rest of backward, queued on the optimizer's stream after the hand-over.
        let t0 = std::time::Instant::now();
        dev.stall(stream, stall.as_millis() as u64);
        // The early step writes the parameter in place; wait for it to change.
        let before = params()[1].clone();
        let p = oa[1].as_ptr();
        // Read while the pool writes: volatile, byte by byte.
        let changed = || (0..before.len()).any(|k| std::ptr::read_volatile(p.add(k)) != before[k]);
        while !changed() {
            assert!(
                t0.elapsed() < stall * 2 / 3,
                "the early step waited for work queued after the hand-over"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        for i in [2, 0] {
            off.grads_ready(&[i], &[emulated::on(emulated::dev(EMULATED), &vd[i])])
                .unwrap();
        }
        off.step_end(None, &mut st).unwrap();
    }
    emulated::synchronize_all();
    assert_eq!(st.speculative, SIZES.len() as u64, "{st:?}");
    assert_eq!(ha, oa);
}
