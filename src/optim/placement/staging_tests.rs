//! The device half end to end on the emulated device (`device::emulated`: host memory posing
//! as device memory, launches run by the host build of the kernel): a hybrid optimizer
//! steps, reads and writes state by key, and saves and loads checkpoints exactly as an
//! all-host optimizer over the same values does, and frees its device memory. Skipped,
//! saying why, where g++ cannot build the host kernel.
use std::ops::Range;
use std::sync::Mutex;

use crate::ckpt::{load, LoadOptions};
use crate::ckpt::{save_optimizer as save, Mode, ParamsAs, SaveOptions};
use crate::device::emulated::{self, encode, values, COUNTED};
use crate::dtype::DType;
use crate::optim::math::config::{Algorithm, OptimConfig, StateFormat};
use crate::optim::Optimizer;
use crate::tensor::{Device, Tensor, TensorView};

/// The live-allocation count of the emulated device these tests use (`COUNTED`, theirs
/// alone) is per process: they take turns.
static SERIAL: Mutex<()> = Mutex::new(());

fn view(b: &mut [u8], dt: DType, n: usize) -> TensorView {
    unsafe { TensorView::host(b.as_mut_ptr(), dt, &[n as i64], None, "t").unwrap() }
}

/// Sizes with a partial quantization group and an empty shard.
const SIZES: [usize; 4] = [100, 33, 0, 70];

/// One optimizer over `mem` (one buffer per param, group 1 for the last one), every
/// param on `device` but param 0, which stays in host memory.
fn build(cfgs: &[OptimConfig; 2], dt: DType, mem: &mut [Vec<u8>], device: Device) -> Optimizer {
    let mut opt = Optimizer::new(cfgs[0].clone()).unwrap();
    opt.add_param_group(cfgs[1].clone()).unwrap();
    for (i, b) in mem.iter_mut().enumerate() {
        let n = SIZES[i];
        let (dev, group) = (
            if i == 0 { Device::Host } else { device },
            usize::from(i == 3),
        );
        let v = emulated::on(dev, &view(b, dt, n));
        unsafe { opt.add_param(&format!("p{i}"), v, None, group) }.unwrap();
    }
    opt
}

fn params(dt: DType) -> Vec<Vec<u8>> {
    (0..SIZES.len())
        .map(|i| encode(dt, &values(SIZES[i], i as u64 + 1)))
        .collect()
}

/// Steps `opt` with gradients seeded by `s` (skipping param 1 on odd steps).
fn step(opt: &mut Optimizer, dt: DType, s: u64, device: Device) {
    let mut grads: Vec<Vec<u8>> = (0..SIZES.len())
        .map(|i| encode(dt, &values(SIZES[i], 100 + 10 * s + i as u64)))
        .collect();
    let views: Vec<Option<TensorView>> = grads
        .iter_mut()
        .enumerate()
        .map(|(i, g)| {
            let on = if i == 0 { Device::Host } else { device };
            (s.is_multiple_of(2) || i != 1).then(|| emulated::on(on, &view(g, dt, SIZES[i])))
        })
        .collect();
    unsafe { opt.step(&views) }.unwrap();
    // The gradients must stay valid until the device's kernels have run (the step only
    // queues them): wait before they are dropped.
    emulated::synchronize_all();
}

/// Steps `host` (all in host memory) and `dev` (params 1.. on the emulated device) with
/// the gradients seeded by each of `steps`.
fn step_pair(host: &mut Optimizer, dev: &mut Optimizer, dt: DType, steps: Range<u64>) {
    for s in steps {
        step(host, dt, s, Device::Host);
        step(dev, dt, s, emulated::dev(COUNTED));
    }
}

/// The same optimizer twice over equal values, stepped by `step_pair`: all in host
/// memory (`host` over `ha`) and with params 1.. on the emulated device (`dev` over `da`).
fn stepped_pair(
    cfgs: &[OptimConfig; 2],
    dt: DType,
    steps: Range<u64>,
) -> (Vec<Vec<u8>>, Vec<Vec<u8>>, Optimizer, Optimizer) {
    let (mut ha, mut da) = (params(dt), params(dt));
    let mut host = build(cfgs, dt, &mut ha, Device::Host);
    let mut dev = build(cfgs, dt, &mut da, emulated::dev(COUNTED));
    step_pair(&mut host, &mut dev, dt, steps);
    (ha, da, host, dev)
}

/// Every key of every param, as `get_state` reads it, and the param bytes.
fn everything(opt: &Optimizer) -> Vec<(String, Tensor)> {
    let mut out = Vec::new();
    for i in 0..opt.num_params() {
        out.push((format!("p{i}"), opt.param_tensor(i).unwrap()));
        for k in opt.keys_of(i).into_iter().chain(["master".to_string()]) {
            let t = opt.get_state(i, &k).unwrap();
            out.push((format!("p{i}.{k}"), t));
        }
    }
    out
}

fn configs() -> Vec<([OptimConfig; 2], DType)> {
    let cfg = |a: Algorithm, f: StateFormat, mw: u32| {
        let mut c = OptimConfig::default_for(a);
        (c.lr, c.weight_decay, c.state_format, c.master_weight_bits) = (1e-2, 0.05, f, mw);
        c
    };
    let mut sgd = cfg(Algorithm::Sgd, StateFormat::ParamDtype, 0);
    (sgd.momentum, sgd.nesterov) = (0.9, true);
    vec![
        (
            [
                cfg(Algorithm::AdamW, StateFormat::Quant8, 24),
                cfg(Algorithm::Lion, StateFormat::Quant8Wide, 32),
            ],
            DType::BF16,
        ),
        (
            [sgd, cfg(Algorithm::Adam, StateFormat::Fp32, 0)],
            DType::F16,
        ),
        (
            [
                cfg(Algorithm::AdamW, StateFormat::Fp32, 0),
                cfg(Algorithm::Sgd, StateFormat::Quant8, 0),
            ],
            DType::F32,
        ),
    ]
}

#[test]
fn a_hybrid_step_on_the_emulated_device_is_the_host_step() {
    if emulated::skip() {
        return;
    }
    let _turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // A device keeps a few allocations of its own from its first step on (they are not
    // the optimizer's): one step on it first, then the count must come back every time.
    let (cfgs, dt) = configs().swap_remove(0);
    drop(stepped_pair(&cfgs, dt, 0..1));
    emulated::synchronize_all();
    let live = emulated::device_at(COUNTED).unwrap().live_allocations();
    for (cfgs, dt) in configs() {
        let (ha, da, host, dev) = stepped_pair(&cfgs, dt, 0..3);
        // The device's work is queued, not done: wait before reading its memory.
        emulated::synchronize_all();
        assert_eq!(ha, da, "{:?} {dt}", cfgs[0].algorithm);
        assert!(dev.param_state(1).is_none() && dev.has_state(1));
        assert_eq!(dev.device_state(1).unwrap().step, 2);
        assert_eq!(dev.total_state_bytes(), host.total_state_bytes());
        // Debug prints -0.0 and 0.0 apart, and every code and scale.
        for i in 0..SIZES.len() {
            assert_eq!(dev.keys_of(i), host.keys_of(i));
        }
        assert_eq!(
            format!("{:?}", everything(&dev)),
            format!("{:?}", everything(&host)),
            "{:?} {dt}",
            cfgs[0].algorithm
        );
        drop(dev);
        assert_eq!(
            emulated::device_at(COUNTED).unwrap().live_allocations(),
            live,
            "device state is freed with its optimizer"
        );
    }
}

#[test]
fn device_state_is_written_by_key_as_host_state_is() {
    if emulated::skip() {
        return;
    }
    let _turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    for (cfgs, dt) in configs() {
        let (ha, da, mut host, mut dev) = stepped_pair(&cfgs, dt, 0..1);
        // A third optimizer's state, written into both by key (param 3's creates state
        // on the device; param 1's replaces it after a step).
        let mut src = params(dt);
        let mut from = build(&cfgs, dt, &mut src, Device::Host);
        for s in 0..2 {
            step(&mut from, dt, s + 7, Device::Host);
        }
        for i in [1, 3] {
            let entries: Vec<(String, Tensor)> = from
                .keys_of(i)
                .into_iter()
                .chain(["master".to_string()])
                .map(|k| {
                    let t = from.get_state(i, &k).unwrap();
                    (k, t)
                })
                .collect();
            host.set_states(i, &entries).unwrap();
            dev.set_states(i, &entries).unwrap();
        }
        // A refused write changes nothing on the device either.
        let before = format!("{:?}", everything(&dev));
        let bad = Tensor::zeros(DType::F32, vec![SIZES[1] + 1]);
        let e = dev
            .set_states(
                1,
                &[
                    ("step".into(), Tensor::zeros(DType::F32, vec![])),
                    ("master".into(), bad),
                ],
            )
            .unwrap_err();
        assert!(e.to_string().contains("key master of parameter p1"), "{e}");
        assert_eq!(format!("{:?}", everything(&dev)), before);
        step_pair(&mut host, &mut dev, dt, 1..3);
        // The device's work is queued, not done: wait before reading its memory.
        emulated::synchronize_all();
        assert_eq!(ha, da, "{:?} {dt}", cfgs[0].algorithm);
        assert_eq!(
            format!("{:?}", everything(&dev)),
            format!("{:?}", everything(&host)),
            "{:?} {dt}",
            cfgs[0].algorithm
        );
    }
}

fn files(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            (name, std::fs::read(e.path()).unwrap())
        })
        .collect();
    v.sort();
    v
}

#[test]
fn a_checkpoint_of_device_state_is_the_host_checkpoint_and_loads_back_onto_the_device() {
    if emulated::skip() {
        return;
    }
    let _turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = std::env::temp_dir().join(format!("fo-staging-{}", std::process::id()));
    for (c, (cfgs, dt)) in configs().into_iter().enumerate() {
        // `_da` holds `dev`'s params: kept until the end, unread.
        let (ha, _da, mut host, dev) = stepped_pair(&cfgs, dt, 0..2);
        for mode in [Mode::Compressed, Mode::Portable] {
            let mut o = SaveOptions::new(0, 1, mode);
            (o.save_id, o.params) = ("same".into(), Some(ParamsAs::Stored));
            let (a, b) = (
                root.join(format!("{c}-{mode:?}-host")),
                root.join(format!("{c}-{mode:?}-dev")),
            );
            save(&host, &a, &o).unwrap();
            let before = emulated::downloads_on_this_thread();
            save(&dev, &b, &o).unwrap();
            let used = emulated::downloads_on_this_thread() - before;
            // Each device parameter's state is read back once for all its keys, and its
            // elements at most twice (the plain-FQN entry and `master`), not per key.
            let before = emulated::downloads_on_this_thread();
            for i in 1..SIZES.len() {
                dev.stage(i).unwrap();
            }
            let once = emulated::downloads_on_this_thread() - before + 2 * (SIZES.len() - 1);
            assert!(used <= once, "{used} copies down for {once}");
            assert_eq!(
                files(&a),
                files(&b),
                "{:?} {dt} {mode:?}",
                cfgs[0].algorithm
            );
        }
        // The host checkpoint restores a fresh device optimizer: it then steps as the host.
        let mut fresh = params(dt);
        let mut back = build(&cfgs, dt, &mut fresh, emulated::dev(COUNTED));
        let dir = root.join(format!("{c}-Compressed-host"));
        let lo = LoadOptions {
            params: true,
            ..LoadOptions::default()
        };
        load(&mut back, &dir, &lo).unwrap();
        step(&mut host, dt, 5, Device::Host);
        step(&mut back, dt, 5, emulated::dev(COUNTED));
        assert_eq!(ha, fresh, "{:?} {dt}", cfgs[0].algorithm);
        // The empty shard (p2) saves nothing, so its step counter is not restored: as
        // for host parameters.
        let saved = |o: &Optimizer| -> String {
            let e = everything(o);
            format!(
                "{:?}",
                e.iter()
                    .filter(|(k, _)| !k.starts_with("p2"))
                    .collect::<Vec<_>>()
            )
        };
        assert_eq!(saved(&back), saved(&host), "{:?} {dt}", cfgs[0].algorithm);
    }
    let _ = std::fs::remove_dir_all(&root);
}
