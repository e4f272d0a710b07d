//! The launch path's data, run by the kernel: the kernel text is built for the host (g++,
//! `-ffp-contract=off`, through the shim header, as ctest builds it) into a shared
//! object, and fed tables built by `build_table` from fo's own states and `Rule`s, as the
//! GPU launcher builds them (only the addresses are host ones). The result must be the
//! CPU step's, bit for bit. This proves the Rust side of a launch (rule scalars, moment
//! kinds, state addresses, group prefix sums, SGD's first step) against the kernel
//! without a GPU; skipped, with the reason printed, where g++ is absent.
use crate::dtype::DType;
use crate::kernels::step_path::{row_path, STEP_PATHS};
use crate::kernels::step_table::{
    build_table, FoRule, FoStepTensor, MomentKind, StatePtrs, TableEntry,
};
use crate::optim::math::config::{Algorithm, Arithmetic, OptimConfig, StateFormat};
use crate::optim::math::rule::Rule;
use crate::optim::math::state::ParamState;
use crate::optim::Optimizer;
use crate::tensor::TensorView;

use crate::device::emulated::{encode, host_kernels, values, HostKernels};

fn view(b: &mut [u8], dt: DType, n: usize) -> TensorView {
    unsafe { TensorView::host(b.as_mut_ptr(), dt, &[n as i64], None, "t").unwrap() }
}

const SIZES: [usize; 4] = [100, 33, 0, 70];

/// A kernel-side copy of `len` bytes starting `shift` bytes past a 16-byte boundary.
struct Shifted {
    mem: Vec<u8>,
    at: usize,
    len: usize,
}

impl Shifted {
    fn new(bytes: &[u8], shift: usize) -> Shifted {
        let mut mem = vec![0u8; bytes.len() + 32];
        let at = (16 - mem.as_ptr() as usize % 16) % 16 + shift;
        mem[at..at + bytes.len()].copy_from_slice(bytes);
        let len = bytes.len();
        Shifted { mem, at, len }
    }
    fn ptr(&mut self) -> u64 {
        self.mem[self.at..].as_mut_ptr() as u64
    }
    fn bytes(&self) -> &[u8] {
        &self.mem[self.at..self.at + self.len]
    }
}

fn moment_size(k: MomentKind) -> usize {
    match k {
        MomentKind::None => 0,
        MomentKind::F32 => 4,
        MomentKind::F16 | MomentKind::BF16 => 2,
        _ => 1,
    }
}

/// The kernel side's element-wise state arrays copied to `shift` elements past a 16-byte
/// boundary (the scales stay: the kernel moves them one at a time): the table's pointers,
/// and each copy with the address of the state buffer it came from.
fn shift_state(
    st: &mut ParamState,
    numel: usize,
    shift: usize,
) -> (StatePtrs, Vec<(u64, Shifted)>) {
    let mut ptrs = StatePtrs::of_host(st);
    let mut copies = Vec::new();
    let mut arrays: Vec<(&mut u64, usize)> = Vec::new();
    if ptrs.error_bits != 0 {
        let w = ptrs.error_bits_width as usize / 8;
        arrays.push((&mut ptrs.error_bits, w));
    }
    for m in [ptrs.m.as_mut(), ptrs.v.as_mut()].into_iter().flatten() {
        arrays.push((&mut m.data, moment_size(m.kind)));
    }
    for (p, size) in arrays {
        // SAFETY: `numel` elements of `size` bytes of `st`'s own buffers.
        let bytes = unsafe { std::slice::from_raw_parts(*p as *const u8, numel * size) };
        let mut c = Shifted::new(bytes, shift * size);
        let home = std::mem::replace(p, c.ptr());
        copies.push((home, c));
    }
    (ptrs, copies)
}

/// What `run_both` saw: mismatching buffers, and the kernel's vector loads and stores
/// against the count of an aligned run (one per array of every whole range of 4
/// elements; a gradient is only loaded).
struct Both {
    bad: usize,
    vectors: u64,
    aligned_vectors: u64,
    /// The kernel entries the launches ran (`step_path`).
    paths: std::collections::BTreeSet<u32>,
}

/// One config on both sides for 3 steps (step 2 skips tensor 1), the kernel's parameter,
/// gradient and state arrays `shift[0]`, `shift[1]` and `shift[2]` elements past a
/// 16-byte boundary.
fn run_both(
    k: &HostKernels,
    cfg: &OptimConfig,
    dt: DType,
    sizes: &[usize],
    shift: [usize; 3],
) -> Both {
    let mut cpu = Optimizer::new(cfg.clone()).unwrap();
    let mut a: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| encode(dt, &values(n, i as u64 + 1)))
        .collect();
    let mut b: Vec<Shifted> = a
        .iter()
        .map(|x| Shifted::new(x, shift[0] * dt.size()))
        .collect();
    for (i, &n) in sizes.iter().enumerate() {
        unsafe {
            cpu.add_param(&format!("p{i}"), view(&mut a[i], dt, n), None, 0)
                .unwrap()
        };
    }
    // The kernel side's state, as `DeviceState` holds it (zeroed, step, m_valid).
    let mut states: Vec<ParamState> = (0..sizes.len()).map(|i| cpu.new_state(i)).collect();
    let (mut vectors, mut aligned_vectors) = (0, 0);
    let mut paths = std::collections::BTreeSet::new();
    for s in 0..3u64 {
        let grads: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| encode(dt, &values(n, 50 + s * 10 + i as u64)))
            .collect();
        let mut kgrads: Vec<Shifted> = grads
            .iter()
            .map(|g| Shifted::new(g, shift[1] * dt.size()))
            .collect();
        let skip = |i: usize| s == 1 && i == 1;
        let mut cgrads = grads.clone();
        let views: Vec<Option<TensorView>> = cgrads
            .iter_mut()
            .zip(sizes)
            .enumerate()
            .map(|(i, (g, &n))| (!skip(i)).then(|| view(g, dt, n)))
            .collect();
        unsafe { cpu.step(&views).unwrap() };
        let mut entries = Vec::new();
        let mut copies = Vec::new();
        for (i, st) in states.iter_mut().enumerate() {
            if skip(i) {
                continue;
            }
            let (state, c) = shift_state(st, sizes[i], shift[2]);
            let state_arrays = usize::from(state.error_bits_width != 0)
                + [state.m, state.v].iter().flatten().count();
            aligned_vectors += ((sizes[i] / 4) * (3 + 2 * state_arrays)) as u64;
            copies.extend(c);
            entries.push(TableEntry {
                param: b[i].ptr(),
                param_dtype: dt,
                grad: kgrads[i].ptr(),
                grad_dtype: dt,
                numel: sizes[i],
                state,
                rule: Rule::new(cfg, st.step + 1),
                first: !st.m_valid,
            });
            st.step += 1;
            st.m_valid = true;
        }
        let t = build_table(&entries).unwrap();
        let (mut l0, mut s0, mut l1, mut s1) = (0, 0, 0, 0);
        unsafe { (k.vec_counts)(&mut l0, &mut s0) };
        for l in &t.launches {
            let rows = t.tensors[l.row..].as_ptr();
            unsafe {
                (k.step)(
                    rows,
                    l.count as i32,
                    l.total_groups,
                    &l.rule,
                    l.first as i32,
                    l.path,
                )
            };
            paths.insert(l.path);
        }
        unsafe { (k.vec_counts)(&mut l1, &mut s1) };
        vectors += l1 - l0 + s1 - s0;
        for (home, c) in copies {
            // SAFETY: back into the state buffer the copy was taken from.
            unsafe { std::ptr::copy_nonoverlapping(c.bytes().as_ptr(), home as *mut u8, c.len) };
        }
    }
    let mut bad = 0;
    for i in 0..sizes.len() {
        bad += usize::from(a[i] != b[i].bytes());
        // Debug prints -0.0 and 0.0 apart, and every code and scale.
        let want = format!("{:?}", cpu.param_state(i).unwrap());
        bad += usize::from(format!("{:?}", states[i]) != want);
    }
    Both {
        bad,
        vectors,
        aligned_vectors,
        paths,
    }
}

#[test]
fn the_host_kernel_steps_rust_built_tables_like_the_cpu() {
    let k = match host_kernels() {
        Ok(r) => r,
        Err(why) => {
            eprintln!("skipped: {why}");
            return;
        }
    };
    let mut cfgs = Vec::new();
    for a in Algorithm::ALL {
        for (momentum, nesterov, dampening) in
            [(0.0, false, 0.0), (0.9, true, 0.0), (0.8, false, 0.3)]
        {
            if !a.is_sgd() && momentum != 0.0 {
                continue;
            }
            let mut c = OptimConfig::default_for(a);
            (c.lr, c.weight_decay) = (1e-2, 0.05);
            (c.momentum, c.nesterov, c.dampening) = (momentum, nesterov, dampening);
            cfgs.push(c);
        }
    }
    let (mut combos, mut paths) = (0, std::collections::BTreeSet::new());
    for base in &cfgs {
        for arith in [Arithmetic::Exact, Arithmetic::Fast] {
            for f in [
                StateFormat::Fp32,
                StateFormat::ParamDtype,
                StateFormat::Quant8,
                StateFormat::Quant8Wide,
            ] {
                for (dt, mw) in [
                    (DType::F32, 0),
                    (DType::BF16, 24),
                    (DType::F16, 32),
                    (DType::BF16, 0),
                ] {
                    let mut c = base.clone();
                    (c.state_format, c.master_weight_bits) = (f, mw);
                    c.arithmetic = arith;
                    let r = run_both(&k, &c, dt, &SIZES, [0; 3]);
                    assert_eq!(r.bad, 0, "{:?} {arith:?} {f:?} {dt} mw{mw}", c.algorithm);
                    assert_eq!(r.vectors, r.aligned_vectors, "{:?} {f:?} {dt}", c.algorithm);
                    paths.extend(r.paths);
                    combos += 1;
                }
            }
        }
    }
    assert_eq!(combos, 9 * 2 * 4 * 4);
    // Every entry of the kernel ran, each giving the CPU step's bits.
    assert_eq!(paths, (0..STEP_PATHS).collect());
}

/// The launch code's choice of entry (`step_path::row_path`) and the kernel's own
/// (`fo_step_path_of`) agree on every combination of dtypes, error bits, moment kinds and
/// rule kinds, so an entry compiled for one path never runs a row of another.
#[test]
fn the_launch_and_the_kernel_give_every_row_the_same_path() {
    let k = match host_kernels() {
        Ok(r) => r,
        Err(why) => {
            eprintln!("skipped: {why}");
            return;
        }
    };
    let mut seen = std::collections::BTreeSet::new();
    let kinds = |n: i32| 0..n;
    for pd in 0..3 {
        for gd in 0..3 {
            for ew in [0, 8, 16] {
                for (m, v) in kinds(7).flat_map(|m| kinds(7).map(move |v| (m, v))) {
                    for kind in 0..9 {
                        let t = FoStepTensor {
                            param_dtype: pd,
                            grad_dtype: gd,
                            error_bits_width: ew,
                            m_kind: m,
                            v_kind: v,
                            ..FoStepTensor::default()
                        };
                        let r = FoRule {
                            kind,
                            ..FoRule::default()
                        };
                        let c = unsafe { (k.path_of)(&t, &r) };
                        assert_eq!(row_path(&t, &r) as i32, c, "{t:?} {r:?}");
                        seen.insert(c as u32);
                    }
                }
            }
        }
    }
    assert_eq!(seen, (0..STEP_PATHS).collect());
}
