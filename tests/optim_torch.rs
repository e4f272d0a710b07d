//! The fp32 state format against torch.optim (AdamW, Adam, SGD) and lion-pytorch: every
//! parameter after every one of 25 steps, and the final state, within rtol 1e-5 and
//! atol 1e-7 (FlashOptim's own tolerance for its reference against torch).
mod optim_util;

use fo::optim::StateFormat;
use optim_util::*;

const RTOL: f32 = 1e-5;
const ATOL: f32 = 1e-7;

/// Elements outside `|a − b| <= ATOL + RTOL·|b|`, as (index, ours, torch); NaN is outside.
#[allow(clippy::neg_cmp_op_on_partial_ord)]
fn outside(a: &[f32], b: &[f32]) -> Vec<(usize, f32, f32)> {
    a.iter()
        .zip(b)
        .enumerate()
        .filter(|(_, (x, y))| !((*x - *y).abs() <= ATOL + RTOL * y.abs()))
        .map(|(i, (x, y))| (i, *x, *y))
        .collect()
}

fn run_case(name: &str) {
    let c = case("torch", name);
    let bytes = read(c["file"].as_str().unwrap());
    let o = Oracle::new(&bytes);
    let n = c["num_params"].as_u64().unwrap() as usize;
    let steps = c["num_steps"].as_u64().unwrap() as usize;
    let mut run = Run::new(&o, n, config_for(&c, StateFormat::Fp32));
    for t in 0..steps {
        run.step(&o, t);
        for i in 0..n {
            let want = f32s(&row(&o, &format!("p{i}.params"), t));
            let bad = outside(&run.param_f32(i), &want);
            assert!(
                bad.is_empty(),
                "{name} step {t} p{i}: {} elements outside tolerance, first {:?}",
                bad.len(),
                &bad[..bad.len().min(3)]
            );
        }
    }
    let keys: Vec<String> = c["state_keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap().to_string())
        .collect();
    for i in 0..n {
        let mut ours = run.opt.state_keys(i).unwrap();
        ours.sort();
        assert_eq!(ours, keys, "{name} p{i}: state keys");
        for k in &keys {
            let want = o.f32(&format!("p{i}.state.{k}"));
            let got = run.opt.get_state(i, k).unwrap().to_f32().unwrap();
            let bad = outside(&got, &want);
            assert!(
                bad.is_empty(),
                "{name} p{i} final {k}: {} outside, first {:?}",
                bad.len(),
                &bad[..bad.len().min(3)]
            );
        }
    }
}

macro_rules! torch_cases {
    ($($test:ident => $name:literal,)*) => {$(
        #[test]
        fn $test() { run_case($name) }
    )*};
}

torch_cases! {
    adamw_defaults_matches_torch_every_step => "adamw_defaults",
    adamw_lr3e2_b08_095_wd01_matches_torch_every_step => "adamw_lr3e-2_b0.8_0.95_wd0.1",
    adamw_nowd_matches_torch_every_step => "adamw_nowd_b0.9_0.99",
    adamw_eps1e3_matches_torch_every_step => "adamw_eps1e-3_b0.95_0.9995",
    adam_l2_wd1e2_matches_torch_every_step => "adam_l2_wd1e-2",
    adam_l2_wd05_matches_torch_every_step => "adam_l2_wd0.5_b0.5_0.9",
    sgd_plain_matches_torch_every_step => "sgd_plain",
    sgd_plain_wd_matches_torch_every_step => "sgd_plain_wd1e-2",
    sgd_momentum_matches_torch_every_step => "sgd_momentum0.9",
    sgd_dampening_leaves_first_step_undampened_like_torch => "sgd_momentum0.9_dampening0.1",
    sgd_nesterov_matches_torch_every_step => "sgd_nesterov0.9",
    sgd_nesterov_wd_matches_torch_every_step => "sgd_nesterov0.8_wd5e-3",
    lion_defaults_matches_lion_pytorch_every_step => "lion_defaults",
    lion_b095_098_wd01_matches_lion_pytorch_every_step => "lion_b0.95_0.98_wd0.1",
    lion_decoupled_wd_matches_lion_pytorch_every_step => "lion_decoupled_wd1e-2",
}

#[test]
fn every_fp32_torch_case_is_covered() {
    let m = manifest();
    let fp32: Vec<&str> = m["torch_reference"]["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["param_dtype"] == "float32")
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(fp32.len(), 15);
    let src = include_str!("optim_torch.rs");
    for n in fp32 {
        assert!(src.contains(&format!("\"{n}\"")), "case {n} has no test");
    }
}

/// The `param_dtype` format on bf16 params (bf16 state, FlashOptim arithmetic) against
/// torch's bf16 AdamW (bf16 state, torch arithmetic): different roundings, so compared by
/// FlashOptim's accuracy bar rather than bit for bit, after every step.
fn bf16_case(name: &str) {
    let c = case("torch", name);
    let bytes = read(c["file"].as_str().unwrap());
    let o = Oracle::new(&bytes);
    let n = c["num_params"].as_u64().unwrap() as usize;
    let mut cfg = config_for(&c, StateFormat::ParamDtype);
    cfg.master_weight_bits = 0;
    let mut run = Run::new(&o, n, cfg);
    assert_eq!(run.dtype, fo::DType::BF16);
    for t in 0..c["num_steps"].as_u64().unwrap() as usize {
        run.step(&o, t);
        let got: Vec<f32> = (0..n).flat_map(|i| run.param_f32(i)).collect();
        let want: Vec<f32> = (0..n)
            .flat_map(|i| {
                let all = o.f32(&format!("p{i}.params"));
                let per = all.len() / 25;
                all[t * per..(t + 1) * per].to_vec()
            })
            .collect();
        let (cos, nmse) = cosine_nmse(&got, &want);
        assert!(
            cos > 0.99 && nmse < 0.01,
            "{name} step {t}: cosine {cos}, nmse {nmse}"
        );
    }
    // State is held in bf16: 2 + 2 bytes per element, read back exactly as bf16.
    let numel: usize = run.shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    assert_eq!(run.opt.total_state_bytes(), 4 * numel);
    let m = run.opt.get_state_as(0, "exp_avg", fo::DType::BF16).unwrap();
    assert_eq!(m.dtype, fo::DType::BF16);
}

#[test]
fn param_dtype_state_on_bf16_params_tracks_torch_bf16_adamw() {
    bf16_case("adamw_bf16_defaults");
    bf16_case("adamw_bf16_lr1e-2_b0.9_0.95_wd0.1");
}
