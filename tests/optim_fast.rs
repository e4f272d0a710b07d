//! `Arithmetic::Fast` against `Arithmetic::Exact`: from the same state, one step of each
//! differs by at most `fast::ULP_BOUND` units of the master's resolution (params, masters,
//! 16-bit states) and by at most one quant8 code (and one fp16 ulp of a scale), over the
//! FlashOptim oracle cases and random cases of every rule × format; over the oracle
//! trajectories fast stays as close to torch's fp32 run as exact does; and the fast bits
//! are the same on every kernel path.
mod optim_util;

use fo::optim::math::master_split::Half;
use fo::optim::math::rule::fast::{ULP_BOUND, ULP_BOUND_FINE};
use fo::optim::{Algorithm, Arithmetic, OptimConfig, Optimizer, StateFormat};
use fo::{DType, TensorView};
use optim_util::*;

/// One optimizer over its own copy of the parameters.
struct Side {
    opt: Optimizer,
    bufs: Vec<Vec<u8>>,
}

struct Pair {
    exact: Side,
    fast: Side,
    shapes: Vec<Vec<usize>>,
    dtype: DType,
    bits: u32,
}

fn side(cfg: &OptimConfig, init: &[Vec<u8>], shapes: &[Vec<usize>], dtype: DType) -> Side {
    let mut opt = Optimizer::new(cfg.clone()).unwrap();
    let mut bufs = init.to_vec();
    for (i, b) in bufs.iter_mut().enumerate() {
        let shape: Vec<i64> = shapes[i].iter().map(|&s| s as i64).collect();
        let t = unsafe { TensorView::host(b.as_mut_ptr(), dtype, &shape, None, "param").unwrap() };
        unsafe { opt.add_param(&format!("p{i}"), t, None, 0).unwrap() };
    }
    Side { opt, bufs }
}

impl Pair {
    fn new(cfg: &OptimConfig, init: Vec<Vec<u8>>, shapes: Vec<Vec<usize>>, dtype: DType) -> Pair {
        let mut fc = cfg.clone();
        fc.arithmetic = Arithmetic::Fast;
        let mut ec = cfg.clone();
        ec.arithmetic = Arithmetic::Exact;
        Pair {
            exact: side(&ec, &init, &shapes, dtype),
            fast: side(&fc, &init, &shapes, dtype),
            shapes,
            dtype,
            bits: cfg.master_weight_bits,
        }
    }
}

fn step(s: &mut Side, shapes: &[Vec<usize>], grads: &mut [Vec<u8>], gdt: DType) {
    let views: Vec<Option<TensorView>> = grads
        .iter_mut()
        .zip(shapes)
        .map(|(g, s)| {
            let shape: Vec<i64> = s.iter().map(|&x| x as i64).collect();
            Some(unsafe { TensorView::host(g.as_mut_ptr(), gdt, &shape, None, "grad").unwrap() })
        })
        .collect();
    unsafe { s.opt.step(&views).unwrap() };
}

/// The resolution of a master value of magnitude `x`: one error-bits code (split
/// masters), one ulp of the 16-bit value (no error bits), one f32 ulp (f32 params).
fn unit(dtype: DType, bits: u32, x: f32) -> f64 {
    let x = x.abs().max(f32::MIN_POSITIVE);
    match Half::from_dtype(dtype) {
        Ok(h) => {
            let l = h.half_ulp_log2(h.from_f32(x)) as f64;
            match bits {
                24 => l.exp2() / 127.0,
                32 => l.exp2() / 32767.0,
                _ => (l + 1.0).exp2(),
            }
        }
        // f32 params: one f32 ulp.
        Err(_) => (((x.to_bits() >> 23) as f64) - 150.0).exp2(),
    }
    .max(f64::MIN_POSITIVE)
}

/// Distance of two 16-bit floats in ulps (sign-magnitude ordered).
fn ord16(a: u16, b: u16) -> i64 {
    let o = |x: u16| {
        if x & 0x8000 != 0 {
            -((x & 0x7fff) as i64)
        } else {
            x as i64
        }
    };
    (o(a) - o(b)).abs()
}

#[derive(Debug, Default, Clone, Copy)]
struct Worst {
    ulps: f64,
    /// The bound that applies (`ULP_BOUND` or `ULP_BOUND_FINE`).
    bound: u32,
    codes: i64,
    scales: i64,
    states16: i64,
}

impl Worst {
    fn max(self, o: Worst) -> Worst {
        Worst {
            ulps: self.ulps.max(o.ulps),
            bound: self.bound.max(o.bound),
            codes: self.codes.max(o.codes),
            scales: self.scales.max(o.scales),
            states16: self.states16.max(o.states16),
        }
    }
}

/// Puts fast on exact's state, steps both with `grads`, and measures the difference.
fn compare_step(p: &mut Pair, grads: &[Vec<u8>], gdt: DType) -> Worst {
    for i in 0..p.shapes.len() {
        p.fast.bufs[i].copy_from_slice(&p.exact.bufs[i]);
        let keys = p.exact.opt.state_keys(i).unwrap();
        if !keys.is_empty() {
            let entries: Vec<(String, fo::Tensor)> = keys
                .iter()
                .map(|k| (k.clone(), p.exact.opt.get_state(i, k).unwrap()))
                .collect();
            p.fast.opt.set_states(i, &entries).unwrap();
        }
    }
    let before: Vec<Vec<f32>> = (0..p.shapes.len())
        .map(|i| p.exact.opt.master(i).unwrap())
        .collect();
    step(&mut p.exact, &p.shapes, &mut grads.to_vec(), gdt);
    step(&mut p.fast, &p.shapes, &mut grads.to_vec(), gdt);
    let fine = p.bits == 32 || p.dtype == DType::F32;
    let mut w = Worst {
        bound: if fine { ULP_BOUND_FINE } else { ULP_BOUND },
        ..Worst::default()
    };
    for (i, before) in before.iter().enumerate() {
        let (e, f) = (
            p.exact.opt.master(i).unwrap(),
            p.fast.opt.master(i).unwrap(),
        );
        for ((&e, &f), &b) in e.iter().zip(&f).zip(before) {
            if e.is_nan() && f.is_nan() {
                continue;
            }
            let u = unit(p.dtype, p.bits, e.abs().max(b.abs()));
            w.ulps = w.ulps.max(((e as f64 - f as f64).abs() / u).max(
                if e.is_nan() != f.is_nan() {
                    f64::INFINITY
                } else {
                    0.0
                },
            ));
        }
        for k in p.exact.opt.state_keys(i).unwrap() {
            let (te, tf) = (
                p.exact.opt.get_state(i, &k).unwrap(),
                p.fast.opt.get_state(i, &k).unwrap(),
            );
            if k.ends_with("::quantized") {
                let d = match te.dtype {
                    DType::I8 => te
                        .data
                        .iter()
                        .zip(&tf.data)
                        .map(|(&a, &b)| (a as i8 as i64 - b as i8 as i64).abs())
                        .max(),
                    _ => te
                        .data
                        .iter()
                        .zip(&tf.data)
                        .map(|(&a, &b)| (a as i64 - b as i64).abs())
                        .max(),
                };
                w.codes = w.codes.max(d.unwrap_or(0));
            } else if k.ends_with("::scales")
                || matches!(te.dtype, DType::BF16 | DType::F16) && k != "error_bits"
            {
                let d = te
                    .data
                    .chunks_exact(2)
                    .zip(tf.data.chunks_exact(2))
                    .map(|(a, b)| {
                        ord16(
                            u16::from_le_bytes([a[0], a[1]]),
                            u16::from_le_bytes([b[0], b[1]]),
                        )
                    })
                    .max()
                    .unwrap_or(0);
                if k.ends_with("::scales") {
                    w.scales = w.scales.max(d);
                } else {
                    w.states16 = w.states16.max(d);
                }
            }
        }
    }
    w
}

fn assert_within(what: &str, w: Worst) {
    eprintln!("{what}: {w:?}");
    if std::env::var_os("FO_FAST_MEASURE").is_some() {
        return;
    }
    assert!(
        w.ulps <= w.bound as f64,
        "{what}: {} master units > {}",
        w.ulps,
        w.bound
    );
    assert!(
        w.states16 <= ULP_BOUND as i64,
        "{what}: 16-bit state {} ulps > {ULP_BOUND}",
        w.states16
    );
    assert!(w.codes <= 1, "{what}: quant8 codes differ by {}", w.codes);
    assert!(
        w.scales <= 1,
        "{what}: fp16 scales differ by {} ulps",
        w.scales
    );
}

fn oracle_grads(o: &Oracle, n: usize, t: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| row(o, &format!("p{i}.grads"), t)).collect()
}

const FLASH_CASES: [&str; 7] = [
    "flash_adamw_mw24",
    "flash_adamw_mw32",
    "flash_adam_l2_mw24",
    "flash_sgd_momentum_mw24",
    "flash_sgd_nesterov_mw24",
    "flash_lion_mw24",
    "flash_adamw_mw24_wide_grads",
];

#[test]
fn fast_is_within_the_bound_of_exact_on_every_oracle_step() {
    for name in FLASH_CASES {
        for format in [StateFormat::Quant8, StateFormat::Quant8Wide] {
            let c = case("flash", name);
            let bytes = read(c["file"].as_str().unwrap());
            let o = Oracle::new(&bytes);
            let n = c["shapes"].as_array().unwrap().len();
            let steps = c["num_steps"].as_u64().unwrap() as usize;
            let init: Vec<Vec<u8>> = (0..n).map(|i| o.bytes(&format!("p{i}.init"))).collect();
            let shapes: Vec<Vec<usize>> = (0..n).map(|i| o.shape(&format!("p{i}.init"))).collect();
            let mut p = Pair::new(
                &config_for(&c, format),
                init,
                shapes,
                dtype_of(o.dtype("p0.init")),
            );
            let gdt = dtype_of(o.dtype("p0.grads"));
            let mut w = Worst::default();
            for t in 0..steps {
                w = w.max(compare_step(&mut p, &oracle_grads(&o, n, t), gdt));
            }
            assert_within(&format!("{name} {}", format.name()), w);
        }
    }
}

/// xorshift, deterministic.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let (a, b) = (self.next().max(1e-300), self.next());
        (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()
    }
}

fn encode(dtype: DType, v: &[f32]) -> Vec<u8> {
    match Half::from_dtype(dtype) {
        Ok(h) => v
            .iter()
            .flat_map(|&x| h.from_f32(x).to_le_bytes())
            .collect(),
        Err(_) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn rules() -> Vec<(&'static str, OptimConfig)> {
    let mk = |a: Algorithm, f: &dyn Fn(&mut OptimConfig)| {
        let mut c = OptimConfig::default_for(a);
        c.lr = 1e-2;
        c.initial_lr = 1e-2;
        f(&mut c);
        c
    };
    vec![
        ("adamw", mk(Algorithm::AdamW, &|c| c.weight_decay = 0.1)),
        ("adam_l2", mk(Algorithm::Adam, &|c| c.weight_decay = 0.01)),
        (
            "sgd_momentum_dampening",
            mk(Algorithm::Sgd, &|c| {
                c.momentum = 0.9;
                c.dampening = 0.1
            }),
        ),
        (
            "sgd_nesterov_l2",
            mk(Algorithm::Sgd, &|c| {
                c.momentum = 0.9;
                c.nesterov = true;
                c.weight_decay = 0.01
            }),
        ),
        ("sgd_plain", mk(Algorithm::Sgd, &|_| {})),
        (
            "sgdw",
            mk(Algorithm::SgdW, &|c| {
                c.momentum = 0.8;
                c.weight_decay = 0.05
            }),
        ),
        (
            "lion",
            mk(Algorithm::Lion, &|c| {
                c.lr = 1e-3;
                c.weight_decay = 0.1
            }),
        ),
    ]
}

#[test]
fn fast_is_within_the_bound_of_exact_on_random_cases_of_every_rule_and_format() {
    let formats = [
        (StateFormat::Quant8, 24, DType::BF16),
        (StateFormat::Quant8, 32, DType::BF16),
        (StateFormat::Quant8, 0, DType::BF16),
        (StateFormat::Quant8Wide, 24, DType::BF16),
        (StateFormat::Quant8, 24, DType::F16),
        (StateFormat::ParamDtype, 24, DType::BF16),
        (StateFormat::ParamDtype, 0, DType::F16),
        (StateFormat::Quant8, 0, DType::F32),
    ];
    let shapes = vec![vec![1000], vec![77], vec![3]];
    let mut rng = Rng(0x5eed_f00d);
    for (name, base) in rules() {
        for &(format, bits, dtype) in &formats {
            let mut cfg = base.clone();
            cfg.state_format = format;
            cfg.master_weight_bits = bits;
            let init: Vec<Vec<u8>> = shapes
                .iter()
                .map(|s| {
                    let scale = 10f64.powf(rng.next() * 3.0 - 2.0);
                    let v: Vec<f32> = (0..s[0]).map(|_| (rng.normal() * scale) as f32).collect();
                    encode(dtype, &v)
                })
                .collect();
            let mut p = Pair::new(&cfg, init, shapes.clone(), dtype);
            let mut w = Worst::default();
            for _ in 0..6 {
                let grads: Vec<Vec<u8>> = shapes
                    .iter()
                    .map(|s| {
                        let scale = 10f64.powf(rng.next() * 3.0 - 2.0);
                        let v: Vec<f32> = (0..s[0])
                            .map(|_| {
                                if rng.next() < 0.03 {
                                    0.0
                                } else {
                                    (rng.normal() * scale) as f32
                                }
                            })
                            .collect();
                        encode(dtype, &v)
                    })
                    .collect();
                w = w.max(compare_step(&mut p, &grads, dtype));
            }
            assert_within(&format!("{name} {} mw{bits} {dtype}", format.name()), w);
        }
    }
}

/// Fast's own trajectory (never re-synchronized with exact) against torch's fp32 run.
fn fast_accuracy(name: &str, format: StateFormat) -> (f64, f64) {
    let c = case("flash", name);
    let bytes = read(c["file"].as_str().unwrap());
    let o = Oracle::new(&bytes);
    let n = c["shapes"].as_array().unwrap().len();
    let steps = c["num_steps"].as_u64().unwrap() as usize;
    let mut cfg = config_for(&c, format);
    cfg.arithmetic = Arithmetic::Fast;
    let mut run = Run::new(&o, n, cfg);
    let (mut worst_cos, mut worst_nmse) = (1f64, 0f64);
    for t in 0..steps {
        run.step(&o, t);
        let r: Vec<f32> = (0..n)
            .flat_map(|i| f32s(&row(&o, &format!("p{i}.ref_fp32.params"), t)))
            .collect();
        for got in [
            (0..n).flat_map(|i| run.param_f32(i)).collect::<Vec<f32>>(),
            (0..n).flat_map(|i| run.opt.master(i).unwrap()).collect(),
        ] {
            let (cos, nmse) = cosine_nmse(&got, &r);
            worst_cos = worst_cos.min(cos);
            worst_nmse = worst_nmse.max(nmse);
        }
    }
    (worst_cos, worst_nmse)
}

#[test]
fn fast_tracks_torch_fp32_on_every_oracle_trajectory() {
    for name in &FLASH_CASES[..6] {
        let (cos, nmse) = fast_accuracy(name, StateFormat::Quant8);
        eprintln!("{name}: fast worst cosine {cos}, nmse {nmse}");
        assert!(
            cos > 0.99 && nmse < 0.01,
            "{name}: fast worst cosine {cos}, nmse {nmse}"
        );
    }
    // Exact quant8 diverges on the wide-gradient case (FlashOptim's format); quant8_wide
    // is the format that holds it, in fast arithmetic too.
    let (cos, nmse) = fast_accuracy("flash_adamw_mw24_wide_grads", StateFormat::Quant8Wide);
    assert!(
        cos > 0.99 && nmse < 0.01,
        "wide grads quant8_wide fast: {cos} {nmse}"
    );
}

/// A digest of every oracle case's fast trajectory (params and raw state, every step).
fn fast_digest() -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: &[u8]| {
        for &x in b {
            h = (h ^ x as u64).wrapping_mul(0x100_0000_01b3);
        }
    };
    for name in FLASH_CASES {
        for format in [
            StateFormat::Quant8,
            StateFormat::Quant8Wide,
            StateFormat::ParamDtype,
        ] {
            let c = case("flash", name);
            let bytes = read(c["file"].as_str().unwrap());
            let o = Oracle::new(&bytes);
            let n = c["shapes"].as_array().unwrap().len();
            let mut cfg = config_for(&c, format);
            cfg.arithmetic = Arithmetic::Fast;
            let mut run = Run::new(&o, n, cfg);
            for t in 0..c["num_steps"].as_u64().unwrap() as usize {
                run.step(&o, t);
                for i in 0..n {
                    eat(&run.bufs[i]);
                    for k in run.opt.state_keys(i).unwrap() {
                        eat(&run.opt.get_state(i, &k).unwrap().data);
                    }
                }
            }
        }
    }
    h
}

/// The fast arithmetic is IEEE operations only (fused multiply-adds included), so the
/// AVX-512, AVX2 and plain paths give the same bits; checked in child processes with the
/// kernel's choice capped (`FO_KERNEL_ISA`).
#[test]
fn every_kernel_path_gives_the_same_fast_bits() {
    let d = fast_digest();
    if std::env::var_os("FO_KERNEL_ISA").is_some() {
        println!("fast-digest={d:016x}");
        return;
    }
    for isa in ["generic", "avx2"] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .env("FO_KERNEL_ISA", isa)
            .args([
                "--exact",
                "every_kernel_path_gives_the_same_fast_bits",
                "--nocapture",
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "FO_KERNEL_ISA={isa}: {text}");
        assert!(
            text.contains(&format!("fast-digest={d:016x}")),
            "FO_KERNEL_ISA={isa}: {text}"
        );
    }
}

#[test]
fn fp32_state_steps_the_same_under_either_arithmetic() {
    let shapes = vec![vec![100]];
    let init = vec![encode(
        DType::F32,
        &(0..100)
            .map(|i| (i as f32 * 0.37).sin())
            .collect::<Vec<_>>(),
    )];
    for (name, mut cfg) in rules() {
        cfg.state_format = StateFormat::Fp32;
        cfg.master_weight_bits = 0;
        let mut p = Pair::new(&cfg, init.clone(), shapes.clone(), DType::F32);
        let g = vec![encode(
            DType::F32,
            &(0..100)
                .map(|i| (i as f32 * 0.11).cos())
                .collect::<Vec<_>>(),
        )];
        for _ in 0..3 {
            step(&mut p.exact, &shapes, &mut g.clone(), DType::F32);
            step(&mut p.fast, &shapes, &mut g.clone(), DType::F32);
        }
        assert_eq!(p.exact.bufs, p.fast.bufs, "{name}");
    }
}
