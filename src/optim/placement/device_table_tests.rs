//! A device step's host cost on the emulated device: pointer look-ups (what
//! `cuPointerGetAttribute` answers on a GPU) and launch-table uploads, counted per step,
//! with the results compared bit for bit with an all-host optimizer at every step.
use super::*;
use crate::device::backend::Backend as _;
use crate::device::emulated::{self, encode, values, EMULATED};
use crate::dtype::DType;
use crate::optim::math::config::{Algorithm, Arithmetic, OptimConfig, StateFormat};

/// Three parameters in two groups: FlashOptim's layout (bf16, quant8, 24-bit master) and
/// fp32 AdamW, sizes with partial scale groups.
const SIZES: [usize; 3] = [100, 33, 70];
const DT: DType = DType::BF16;

fn view(at: *mut u8, n: usize) -> TensorView {
    unsafe { TensorView::host(at, DT, &[n as i64], None, "t").unwrap() }
}

fn build(mem: &mut [Vec<u8>], device: Device) -> Optimizer {
    build_with(mem, device, Arithmetic::Exact)
}

/// `build` with the quant8 group's arithmetic `arith`.
fn build_with(mem: &mut [Vec<u8>], device: Device, arith: Arithmetic) -> Optimizer {
    let mut q8 = OptimConfig::default_for(Algorithm::AdamW);
    (q8.lr, q8.weight_decay) = (1e-2, 0.05);
    (q8.state_format, q8.master_weight_bits) = (StateFormat::Quant8, 24);
    q8.arithmetic = arith;
    let mut f32 = OptimConfig::default_for(Algorithm::AdamW);
    (f32.state_format, f32.master_weight_bits) = (StateFormat::Fp32, 0);
    let mut opt = Optimizer::new(q8).unwrap();
    opt.add_param_group(f32).unwrap();
    for (i, b) in mem.iter_mut().enumerate() {
        let v = emulated::on(device, &view(b.as_mut_ptr(), SIZES[i]));
        unsafe { opt.add_param(&format!("p{i}"), v, None, usize::from(i == 2)) }.unwrap();
    }
    opt
}

/// Gradients as torch's caching allocator hands them out: views into one device
/// allocation (a segment), at byte offsets `at`, filled with step `s`'s values.
struct Segment {
    ptr: u64,
    bytes: usize,
}

impl Segment {
    fn grads(&self, at: &[usize], s: u64) -> Vec<Option<TensorView>> {
        emulated::synchronize_all(); // the previous step has read the old values
        (0..SIZES.len())
            .map(|i| {
                let g = encode(DT, &values(SIZES[i], 100 + 10 * s + i as u64));
                assert!(at[i] + g.len() <= self.bytes);
                let dst = (self.ptr as usize + at[i]) as *mut u8;
                unsafe { std::ptr::copy_nonoverlapping(g.as_ptr(), dst, g.len()) };
                Some(view(dst, SIZES[i]))
            })
            .collect()
    }
}

/// One step of both optimizers; returns the device step's (pointer look-ups, uploads).
fn step(host: &mut Optimizer, dev: &mut Optimizer, g: &[Option<TensorView>]) -> (usize, usize) {
    // The host optimizer reads the same bytes (in host memory, which the emulated
    // device's memory is).
    unsafe { host.step(g) }.unwrap();
    let (q, u) = (
        emulated::pointer_queries_on_this_thread(),
        emulated::table_uploads_on_this_thread(),
    );
    unsafe { dev.step(&emulated::each_on(&[emulated::dev(EMULATED); 3], g)) }.unwrap();
    let counts = (
        emulated::pointer_queries_on_this_thread() - q,
        emulated::table_uploads_on_this_thread() - u,
    );
    emulated::synchronize_all();
    counts
}

fn assert_same(host: &Optimizer, dev: &Optimizer, hm: &[Vec<u8>], dm: &[Vec<u8>], s: u64) {
    assert_eq!(hm, dm, "step {s}: parameters");
    for i in 0..SIZES.len() {
        let want = format!("{:?}", host.param_state(i).unwrap());
        assert_eq!(
            format!("{:?}", dev.device_state(i).unwrap()),
            want,
            "step {s}: p{i}"
        );
    }
}

/// The parameters' first values.
fn first_values() -> Vec<Vec<u8>> {
    (0..3)
        .map(|i| encode(DT, &values(SIZES[i], i as u64 + 1)))
        .collect()
}

/// A 4 KiB gradient segment on the emulated device, and the host and device optimizers
/// (`build_with(arith)`) over the parameters' first values: (segment, host memory, device
/// memory, host optimizer, device optimizer). The optimizers point into the two memories'
/// buffers, which moving the vectors out leaves in place.
fn pair(arith: Arithmetic) -> (Segment, Vec<Vec<u8>>, Vec<Vec<u8>>, Optimizer, Optimizer) {
    let b = emulated::device().unwrap();
    let bytes = 4096;
    let seg = Segment {
        ptr: unsafe { b.alloc_zeroed(bytes, 0) }.unwrap(),
        bytes,
    };
    let (mut hm, mut dm) = (first_values(), first_values());
    let host = build_with(&mut hm, Device::Host, arith);
    let dev = build_with(&mut dm, emulated::dev(EMULATED), arith);
    (seg, hm, dm, host, dev)
}

/// The fast arithmetic on the device: the host's fast step's bits at every step, the
/// device group stepping the fast kernel path (quant8 over bf16 with 24-bit masters).
#[test]
fn the_fast_arithmetic_steps_on_the_device_with_the_hosts_bits() {
    if emulated::skip() {
        return;
    }
    let (seg, hm, dm, mut host, mut dev) = pair(Arithmetic::Fast);
    for s in 1..5 {
        step(&mut host, &mut dev, &seg.grads(&[0, 512, 1024], s));
        assert_same(&host, &dev, &hm, &dm, s);
    }
    assert_ne!(hm, first_values(), "the parameters moved");
    unsafe { emulated::device().unwrap().free(seg.ptr) };
}

#[test]
fn a_step_with_unchanged_pointers_queries_no_pointer_and_uploads_no_table() {
    if emulated::skip() {
        return;
    }
    let (seg, hm, dm, mut host, mut dev) = pair(Arithmetic::Exact);
    let at = [0, 512, 1024];

    // Step 1: each gradient's segment is looked up (first and last byte, then its
    // extent) once, and each group's table uploaded.
    let (q, u) = step(&mut host, &mut dev, &seg.grads(&at, 1));
    assert_eq!(
        (q, u),
        (3, 2),
        "step 1: one look-up of the segment, one table per group"
    );
    assert_same(&host, &dev, &hm, &dm, 1);

    // Steps 2 and 3: the same pointers (new values): nothing is looked up or uploaded.
    for s in 2..4 {
        let (q, u) = step(&mut host, &mut dev, &seg.grads(&at, s));
        assert_eq!((q, u), (0, 0), "step {s}");
        assert_same(&host, &dev, &hm, &dm, s);
    }

    // Gradients moved inside the segment (torch allocated new ones): no look-up (the
    // segment is known), only the changed table is uploaded.
    let moved = [0, 512, 2048];
    let (q, u) = step(&mut host, &mut dev, &seg.grads(&moved, 4));
    assert_eq!((q, u), (0, 1), "step 4: group 1's table changed");
    assert_same(&host, &dev, &hm, &dm, 4);

    // A gradient outside every known allocation is looked up again ...
    let mut fresh = encode(DT, &values(SIZES[1], 77));
    let mut g = seg.grads(&moved, 5);
    g[1] = Some(view(fresh.as_mut_ptr(), SIZES[1]));
    let (q, u) = step(&mut host, &mut dev, &g);
    assert_eq!(
        (q, u),
        (3, 1),
        "step 5: the new gradient's first and last byte, its extent"
    );
    assert_same(&host, &dev, &hm, &dm, 5);

    // ... and host memory given as a device gradient is still refused, naming it, with
    // nothing changed.
    let mut bad = encode(DT, &values(SIZES[1], 78));
    let _host = emulated::mark_host(&bad);
    let mut g = seg.grads(&moved, 6);
    g[1] = Some(view(bad.as_mut_ptr(), SIZES[1]));
    let before = (dm.clone(), format!("{:?}", dev.device_state(1).unwrap()));
    let e = unsafe { dev.step(&emulated::each_on(&[emulated::dev(EMULATED); 3], &g)) }.unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    let e = e.to_string();
    assert!(e.contains("`grads`: gradient of p1: pointer"), "{e}");
    assert!(e.contains("is host memory, not device 77's"), "{e}");
    emulated::synchronize_all();
    let after = (dm.clone(), format!("{:?}", dev.device_state(1).unwrap()));
    assert_eq!(before, after, "the refused step changed nothing");

    // The last good pointers again: still no look-up, and the results still the host's.
    let (q, u) = step(&mut host, &mut dev, &seg.grads(&moved, 7));
    assert_eq!((q, u), (0, 1), "step 7: group 0's table changed back");
    assert_same(&host, &dev, &hm, &dm, 7);
    drop(dev);
    unsafe { emulated::device().unwrap().free(seg.ptr) };
}

/// The offload case (host parameters, device gradients) takes the same validated ranges:
/// an unchanged device gradient is not looked up again, and the bits are the host's.
#[test]
fn offloaded_gradients_are_looked_up_once_per_allocation() {
    if emulated::skip() {
        return;
    }
    let b = emulated::device().unwrap();
    let seg = Segment {
        ptr: unsafe { b.alloc_zeroed(4096, 0) }.unwrap(),
        bytes: 4096,
    };
    let mem: Vec<Vec<u8>> = (0..3)
        .map(|i| encode(DT, &values(SIZES[i], i as u64 + 5)))
        .collect();
    let (mut hm, mut om) = (mem.clone(), mem);
    let (mut host, mut off) = (build(&mut hm, Device::Host), build(&mut om, Device::Host));
    let at = [0, 512, 1024];
    for s in 1..4 {
        let g = seg.grads(&at, s);
        unsafe { host.step(&g) }.unwrap();
        let q = emulated::pointer_queries_on_this_thread();
        unsafe { off.step(&emulated::each_on(&[emulated::dev(EMULATED); 3], &g)) }.unwrap();
        let q = emulated::pointer_queries_on_this_thread() - q;
        emulated::synchronize_all();
        assert_eq!(q, if s == 1 { 3 } else { 0 }, "step {s}");
        assert_eq!(hm, om, "step {s}: parameters");
        for i in 0..SIZES.len() {
            let want = format!("{:?}", host.param_state(i).unwrap());
            assert_eq!(format!("{:?}", off.param_state(i).unwrap()), want, "p{i}");
        }
    }
    drop(off);
    unsafe { b.free(seg.ptr) };
}
