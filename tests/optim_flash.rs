//! The compressed formats against FlashOptim 0.1.4's own fused kernels: bf16 params,
//! quant8 state and 24/32-bit split masters, 10 steps of 7 cases, bit for bit (params,
//! error bits, codes, scales, reconstructed masters, every step); and the accuracy bar
//! against the fp32 torch trajectory (cosine > 0.99, nmse < 0.01 after every step).
mod optim_util;

use fo::optim::StateFormat;
use fo::{DType, Tensor};
use optim_util::*;

fn state_names(c: &serde_json::Value) -> Vec<&'static str> {
    match c["optimizer"].as_str().unwrap() {
        "flashoptim.FlashAdamW" | "flashoptim.FlashAdam" => vec!["exp_avg", "exp_avg_sq"],
        "flashoptim.FlashSGD" => vec!["momentum_buffer"],
        _ => vec!["exp_avg"],
    }
}

fn concat(run: &Run, n: usize, f: impl Fn(&Run, usize) -> Vec<f32>) -> Vec<f32> {
    (0..n).flat_map(|i| f(run, i)).collect()
}

fn reference(o: &Oracle, n: usize, t: usize) -> Vec<f32> {
    (0..n)
        .flat_map(|i| f32s(&row(o, &format!("p{i}.ref_fp32.params"), t)))
        .collect()
}

fn bit_exact_case(name: &str) {
    let c = case("flash", name);
    let bytes = read(c["file"].as_str().unwrap());
    let o = Oracle::new(&bytes);
    let n = c["shapes"].as_array().unwrap().len();
    let steps = c["num_steps"].as_u64().unwrap() as usize;
    let mut run = Run::new(&o, n, config_for(&c, StateFormat::Quant8));
    assert_eq!(run.dtype, DType::BF16);
    for t in 0..steps {
        run.step(&o, t);
        for i in 0..n {
            let p = format!("p{i}");
            assert_eq!(
                run.bufs[i],
                row(&o, &format!("{p}.param"), t),
                "{name} step {t} {p}: bf16 params"
            );
            assert_eq!(
                run.opt.get_state(i, "error_bits").unwrap().data,
                row(&o, &format!("{p}.error_bits"), t),
                "{name} step {t} {p}: error bits"
            );
            assert_eq!(
                run.opt.get_state(i, "master").unwrap().data,
                row(&o, &format!("{p}.master_fp32"), t),
                "{name} step {t} {p}: master"
            );
            for s in state_names(&c) {
                for part in ["quantized", "scales"] {
                    let got = run.opt.get_state(i, &format!("{s}::{part}")).unwrap().data;
                    assert_eq!(
                        got,
                        row(&o, &format!("{p}.{s}.{part}"), t),
                        "{name} step {t} {p}: {s}::{part}"
                    );
                }
            }
        }
    }
    for i in 0..n {
        for s in state_names(&c) {
            let got = run.opt.get_state(i, s).unwrap();
            assert_eq!(
                got.data,
                o.bytes(&format!("p{i}.final.{s}.dequantized")),
                "{name} p{i}: final {s} decoded"
            );
        }
    }
}

/// Loads FlashOptim's own `state_dict()` (bf16-viewed scales and error bits) and its
/// portable form into fresh optimizers over the final params; the raw state must equal
/// what our run produced, and the portable load must decode to FlashOptim's values.
fn state_dict_loads(name: &str) {
    let c = case("flash", name);
    let bytes = read(c["file"].as_str().unwrap());
    let o = Oracle::new(&bytes);
    let n = c["shapes"].as_array().unwrap().len();
    let steps = c["num_steps"].as_u64().unwrap() as usize;
    let cfg = config_for(&c, StateFormat::Quant8);
    let mut run = Run::new(&o, n, cfg.clone());
    for t in 0..steps {
        run.step(&o, t);
    }
    let keys: Vec<String> = o.0.names().into_iter().map(|s| s.to_string()).collect();
    for portable in [false, true] {
        let prefix = if portable {
            "state_dict_portable"
        } else {
            "state_dict"
        };
        let mut fresh = Run::new(&o, n, cfg.clone());
        for i in 0..n {
            fresh.bufs[i].copy_from_slice(&run.bufs[i]);
            let pre = format!("p{i}.{prefix}.");
            let entries: Vec<(String, Tensor)> = keys
                .iter()
                .filter_map(|k| k.strip_prefix(&pre).map(|s| (s.to_string(), k)))
                .map(|(s, k)| {
                    (
                        s,
                        Tensor::new(dtype_of(o.dtype(k)), o.shape(k), o.bytes(k)).unwrap(),
                    )
                })
                .collect();
            assert!(!entries.is_empty());
            fresh.opt.set_states(i, &entries).unwrap();
            assert_eq!(
                fresh.opt.get_state(i, "master").unwrap(),
                run.opt.get_state(i, "master").unwrap(),
                "{name} {prefix} p{i}"
            );
            for s in state_names(&c) {
                if portable {
                    let want = o.f32(&format!("p{i}.{prefix}.{s}"));
                    let got = fresh.opt.get_state(i, s).unwrap().to_f32().unwrap();
                    let (cos, nmse) = cosine_nmse(&got, &want);
                    assert!(
                        cos > 0.9999 && nmse < 1e-4,
                        "{name} p{i} {s}: requantized portable state {cos} {nmse}"
                    );
                } else {
                    for part in ["quantized", "scales"] {
                        let k = format!("{s}::{part}");
                        assert_eq!(
                            fresh.opt.get_state(i, &k).unwrap(),
                            run.opt.get_state(i, &k).unwrap(),
                            "{name} p{i} {k}"
                        );
                    }
                }
            }
            if cfg.algorithm.is_adam() {
                assert_eq!(
                    fresh.opt.get_state(i, "step").unwrap().to_f32().unwrap(),
                    vec![steps as f32]
                );
            }
        }
    }
}

/// Our bf16 params and masters against the fp32 torch run after every step.
fn accuracy(name: &str, format: StateFormat) -> (f64, f64) {
    let c = case("flash", name);
    let bytes = read(c["file"].as_str().unwrap());
    let o = Oracle::new(&bytes);
    let n = c["shapes"].as_array().unwrap().len();
    let steps = c["num_steps"].as_u64().unwrap() as usize;
    let mut run = Run::new(&o, n, config_for(&c, format));
    let (mut worst_cos, mut worst_nmse) = (1f64, 0f64);
    for t in 0..steps {
        run.step(&o, t);
        let r = reference(&o, n, t);
        for got in [
            concat(&run, n, |r, i| r.param_f32(i)),
            concat(&run, n, |r, i| r.opt.master(i).unwrap()),
        ] {
            let (cos, nmse) = cosine_nmse(&got, &r);
            worst_cos = worst_cos.min(cos);
            worst_nmse = worst_nmse.max(nmse);
        }
    }
    (worst_cos, worst_nmse)
}

macro_rules! flash_cases {
    ($($test:ident, $loads:ident, $acc:ident => $name:literal,)*) => {$(
        #[test]
        fn $test() { bit_exact_case($name) }
        #[test]
        fn $loads() { state_dict_loads($name) }
        #[test]
        fn $acc() {
            let (cos, nmse) = accuracy($name, StateFormat::Quant8);
            assert!(cos > 0.99 && nmse < 0.01, "{}: worst cosine {cos}, nmse {nmse}", $name);
        }
    )*};
}

flash_cases! {
    adamw_mw24_bit_exact, adamw_mw24_state_dict_loads, adamw_mw24_tracks_torch_fp32 => "flash_adamw_mw24",
    adamw_mw32_bit_exact, adamw_mw32_state_dict_loads, adamw_mw32_tracks_torch_fp32 => "flash_adamw_mw32",
    adam_l2_mw24_bit_exact, adam_l2_mw24_state_dict_loads, adam_l2_mw24_tracks_torch_fp32 => "flash_adam_l2_mw24",
    sgd_momentum_mw24_bit_exact, sgd_momentum_mw24_state_dict_loads, sgd_momentum_mw24_tracks_torch_fp32 => "flash_sgd_momentum_mw24",
    sgd_nesterov_mw24_bit_exact, sgd_nesterov_mw24_state_dict_loads, sgd_nesterov_mw24_tracks_torch_fp32 => "flash_sgd_nesterov_mw24",
    lion_mw24_bit_exact, lion_mw24_state_dict_loads, lion_mw24_tracks_torch_fp32 => "flash_lion_mw24",
}

#[test]
fn adamw_wide_grads_reproduces_flashoptim_divergence_bit_exact() {
    bit_exact_case("flash_adamw_mw24_wide_grads");
    let (_, nmse) = accuracy("flash_adamw_mw24_wide_grads", StateFormat::Quant8);
    assert!(
        nmse > 1.0,
        "the exact FlashOptim format diverges on this case (nmse {nmse})"
    );
}

#[test]
fn quant8_wide_stays_on_the_torch_trajectory_where_flashoptim_diverges() {
    let (cos, nmse) = accuracy("flash_adamw_mw24_wide_grads", StateFormat::Quant8Wide);
    eprintln!(
        "quant8_wide worst cosine {cos} nmse {nmse}; quant8 {:?}",
        accuracy("flash_adamw_mw24_wide_grads", StateFormat::Quant8)
    );
    assert!(
        cos > 0.99 && nmse < 0.01,
        "quant8_wide: worst cosine {cos}, nmse {nmse}"
    );
}

/// The kernel picks AVX-512, AVX2 or plain code at run time; every path must give the
/// same bits. Re-runs this file's bit-exact tests in child processes with the choice
/// capped (`FO_KERNEL_ISA`), so the paths this machine would not pick are proven too.
#[test]
fn every_kernel_path_reproduces_flashoptim_bit_for_bit() {
    if std::env::var_os("FO_KERNEL_ISA").is_some() {
        return; // already a child run
    }
    for isa in ["generic", "avx2"] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .env("FO_KERNEL_ISA", isa)
            .args(["bit_exact", "--test-threads", "1"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "FO_KERNEL_ISA={isa}:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains("test result: ok. 7 passed"),
            "FO_KERNEL_ISA={isa}: {text}"
        );
    }
}
