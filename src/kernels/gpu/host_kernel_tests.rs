//! The launch path's data, run by the kernel: the kernel text is built for the host (g++,
//! `-ffp-contract=off`, through the shim header, as ctest builds it) into a shared
//! object, and fed tables built by `build_table` from fo's own states and `Rule`s, as the
//! GPU launcher builds them (only the addresses are host ones). The result must be the
//! CPU step's, bit for bit. This proves the Rust side of a launch (rule scalars, moment
//! kinds, state addresses, group prefix sums, SGD's first step) against the kernel
//! without a GPU; skipped, with the reason printed, where g++ is absent.
use crate::dtype::DType;
use crate::kernels::step_table::{build_table, StatePtrs, TableEntry};
use crate::optim::math::config::{Algorithm, OptimConfig, StateFormat};
use crate::optim::math::rule::Rule;
use crate::optim::math::state::ParamState;
use crate::optim::Optimizer;
use crate::tensor::HostTensor;

use crate::device::emulated::{encode, host_kernel, values, RunTable};

fn view(b: &mut [u8], dt: DType, n: usize) -> HostTensor {
    unsafe { HostTensor::new(b.as_mut_ptr(), dt, &[n as i64], None, "t").unwrap() }
}

const SIZES: [usize; 4] = [100, 33, 0, 70];

/// One config on both sides for 3 steps (step 2 skips tensor 1); mismatching buffers.
fn run_both(run: RunTable, cfg: &OptimConfig, dt: DType) -> usize {
    let mut cpu = Optimizer::new(cfg.clone()).unwrap();
    let mut a: Vec<Vec<u8>> = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| encode(dt, &values(n, i as u64 + 1)))
        .collect();
    let mut b = a.clone();
    for (i, &n) in SIZES.iter().enumerate() {
        unsafe {
            cpu.add_param(&format!("p{i}"), view(&mut a[i], dt, n), None, 0)
                .unwrap()
        };
    }
    // The kernel side's state, as `DeviceState` holds it (zeroed, step, m_valid).
    let mut states: Vec<ParamState> = (0..SIZES.len()).map(|i| cpu.new_state(i)).collect();
    for s in 0..3u64 {
        let mut grads: Vec<Vec<u8>> = SIZES
            .iter()
            .enumerate()
            .map(|(i, &n)| encode(dt, &values(n, 50 + s * 10 + i as u64)))
            .collect();
        let skip = |i: usize| s == 1 && i == 1;
        let views: Vec<Option<HostTensor>> = grads
            .iter_mut()
            .zip(SIZES)
            .enumerate()
            .map(|(i, (g, n))| (!skip(i)).then(|| view(g, dt, n)))
            .collect();
        unsafe { cpu.step(&views).unwrap() };
        let mut entries = Vec::new();
        for (i, st) in states.iter_mut().enumerate() {
            if skip(i) {
                continue;
            }
            entries.push(TableEntry {
                param: b[i].as_mut_ptr() as u64,
                param_dtype: dt,
                grad: grads[i].as_ptr() as u64,
                grad_dtype: dt,
                numel: SIZES[i],
                state: StatePtrs::of_host(st),
                rule: Rule::new(cfg, st.step + 1),
                first: !st.m_valid,
            });
            st.step += 1;
            st.m_valid = true;
        }
        let t = build_table(&entries).unwrap();
        for l in &t.launches {
            let rows = t.tensors[l.row..].as_ptr();
            unsafe {
                run(
                    rows,
                    l.count as i32,
                    l.total_groups,
                    &l.rule,
                    l.first as i32,
                )
            };
        }
    }
    let mut bad = 0;
    for i in 0..SIZES.len() {
        bad += usize::from(a[i] != b[i]);
        // Debug prints -0.0 and 0.0 apart, and every code and scale.
        let want = format!("{:?}", cpu.param_state(i).unwrap());
        bad += usize::from(format!("{:?}", states[i]) != want);
    }
    bad
}

#[test]
fn the_host_kernel_steps_rust_built_tables_like_the_cpu() {
    let run = match host_kernel() {
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
    let mut combos = 0;
    for base in &cfgs {
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
                let bad = run_both(run, &c, dt);
                assert_eq!(bad, 0, "{:?} {f:?} {dt} mw{mw}", c.algorithm);
                combos += 1;
            }
        }
    }
    assert_eq!(combos, 9 * 4 * 4);
}
