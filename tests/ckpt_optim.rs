//! Checkpoints through the optimizer: save on N ranks, load on M, and the loaded
//! optimizers continue exactly like the unsharded reference.
mod ckpt_util;
use ckpt_util::*;

use fo::ckpt::{
    consolidate, load, pack, save_optimizer, Checkpoint, LoadOptions, Mode, ParamsAs, SaveOptions,
};
use fo::optim::StateFormat;
use fo::DType;

fn save_all(ranks: &[Rank], dir: &std::path::Path, mode: Mode) {
    for (r, rank) in ranks.iter().enumerate() {
        let mut o = SaveOptions::new(r, ranks.len(), mode);
        o.save_id = "s1".into();
        o.params = Some(ParamsAs::Stored);
        save_optimizer(&rank.opt, dir, &o).unwrap();
    }
}

#[test]
fn fp32_state_saved_on_n_ranks_loads_on_m_and_continues_like_unsharded() {
    let cfg = config(StateFormat::Fp32, 0);
    let ref_dir = tmp("optim-ref");
    save_all(&ranks(1, &cfg, DType::F32, 3), &ref_dir, Mode::Portable);
    // What an unsharded run holds after one more step.
    let mut after = ranks(1, &cfg, DType::F32, 4);
    let ref_full = std::fs::read(
        consolidate(&ref_dir, &ref_dir.join("c"), &mut |_, _| {})
            .unwrap()
            .file,
    )
    .unwrap();
    for n in 1..=5 {
        let dir = tmp(&format!("optim-n{n}"));
        save_all(&ranks(n, &cfg, DType::F32, 3), &dir, Mode::Portable);
        // Elementwise state does not depend on sharding: consolidated files are identical.
        let full = std::fs::read(
            consolidate(&dir, &dir.join("c"), &mut |_, _| {})
                .unwrap()
                .file,
        )
        .unwrap();
        assert!(
            full == ref_full,
            "consolidated {n}-rank checkpoint equals the unsharded one"
        );
        for m in [1, 2, 3, 5] {
            let mut loaded: Vec<Rank> = (0..m)
                .map(|r| Rank::new(m, r, cfg.clone(), DType::F32))
                .collect();
            for rank in &mut loaded {
                let rep = load(
                    &mut rank.opt,
                    &dir,
                    &LoadOptions {
                        params: true,
                        ..Default::default()
                    },
                )
                .unwrap();
                assert!(rep.missing.is_empty() && rep.unexpected.is_empty());
                rank.step(3);
            }
            for rank in &loaded {
                for (k, (fqn, ..)) in MODEL.iter().enumerate() {
                    let want =
                        fo::ckpt::local_shard(&after[0].params[k].view_tensor(), &rank.specs[k]);
                    assert_eq!(
                        rank.params[k].bytes(),
                        &want.data[..],
                        "{n}->{m}: param {fqn} after a step"
                    );
                }
            }
        }
    }
}

trait ViewTensor {
    fn view_tensor(&mut self) -> fo::Tensor;
}
impl ViewTensor for Buf {
    fn view_tensor(&mut self) -> fo::Tensor {
        unsafe { self.view().to_tensor() }
    }
}

#[test]
fn compressed_state_is_bit_exact_on_the_same_sharding_and_requantized_otherwise() {
    let cfg = config(StateFormat::Quant8, 24);
    let src = ranks(3, &cfg, DType::BF16, 2);
    let dir = tmp("optim-q8");
    save_all(&src, &dir, Mode::Compressed);
    let ck = Checkpoint::open(&dir).unwrap();
    assert!(
        ck.keys.contains_key("state.fc.weight.exp_avg::quantized")
            && ck.keys.contains_key("state.fc.weight.error_bits")
    );
    assert!(
        !ck.keys
            .keys()
            .any(|k| k.starts_with("state.frozen.") || k.starts_with("state.empty.")),
        "no state, no chunk"
    );
    for (r, s) in src.iter().enumerate() {
        let mut d = Rank::new(3, r, cfg.clone(), DType::BF16);
        let rep = load(&mut d.opt, &dir, &LoadOptions::default()).unwrap();
        assert!(rep.requantized.is_empty());
        for i in 0..MODEL.len() {
            if s.opt.param(i).numel() == 0 {
                continue; // 0-element params produce no chunk
            }
            for key in s.opt.state_keys(i).unwrap() {
                assert_eq!(
                    d.opt.get_state(i, &key).unwrap(),
                    s.opt.get_state(i, &key).unwrap(),
                    "rank {r} param {i} {key}"
                );
            }
        }
    }
    let mut d = Rank::new(2, 1, cfg.clone(), DType::BF16);
    let rep = load(&mut d.opt, &dir, &LoadOptions::default()).unwrap();
    assert!(
        rep.requantized
            .contains(&"state.fc.weight.exp_avg".to_string()),
        "{rep:?}"
    );
    // Portable view of the loaded state vs the saved dequantized state: within the bound.
    let want = ck.read_f32("state.fc.weight.exp_avg", &d.specs[0]).unwrap();
    let got = d.opt.get_state(0, "exp_avg").unwrap().to_f32().unwrap();
    for (g, (a, b)) in got
        .chunks(32)
        .zip(want.chunks(32))
        .enumerate()
        .flat_map(|(g, (a, b))| a.iter().zip(b).map(move |x| (g, x)))
    {
        let amax = want[g * 32..(g * 32 + 32).min(want.len())]
            .iter()
            .fold(0f32, |m, x| m.max(x.abs()));
        assert!(
            (a - b).abs() <= amax * (1.0 / 127.0 + 1.0 / 1024.0),
            "{a} vs {b}"
        );
    }
}

#[test]
fn portable_and_compressed_convert_on_load() {
    let q = config(StateFormat::Quant8, 24);
    let f = config(StateFormat::Fp32, 24);
    let src = ranks(2, &q, DType::BF16, 2);
    let dir = tmp("optim-conv");
    save_all(&src, &dir, Mode::Compressed);
    let mut d = Rank::new(2, 0, f.clone(), DType::BF16);
    load(&mut d.opt, &dir, &LoadOptions::default()).unwrap();
    // fp32 optimizer holds exactly the dequantized compressed state.
    assert_eq!(
        d.opt.get_state(0, "exp_avg").unwrap(),
        src[0].opt.get_state(0, "exp_avg").unwrap()
    );
    let pdir = tmp("optim-conv-p");
    save_all(&src, &pdir, Mode::Portable);
    assert!(Checkpoint::open(&pdir)
        .unwrap()
        .keys
        .contains_key("state.fc.weight.exp_avg"));
    let mut d = Rank::new(2, 0, q.clone(), DType::BF16);
    load(&mut d.opt, &pdir, &LoadOptions::default()).unwrap();
    // Requantizing what the codes decode to reproduces the codes.
    assert_eq!(
        d.opt.get_state(0, "exp_avg::quantized").unwrap(),
        src[0].opt.get_state(0, "exp_avg::quantized").unwrap()
    );
}

#[test]
fn never_stepped_optimizer_packs_to_param_groups_only_and_params_can_be_included() {
    let cfg = config(StateFormat::Quant8, 24);
    let fresh = Rank::new(2, 0, cfg.clone(), DType::BF16);
    let p = pack(&fresh.opt, &SaveOptions::new(0, 2, Mode::Compressed)).unwrap();
    assert!(p.plan.chunks.is_empty());
    assert_eq!(p.opts.param_groups[0]["lr"], 1e-2);
    let stepped = ranks(2, &cfg, DType::BF16, 1);
    let mut o = SaveOptions::new(0, 2, Mode::Portable);
    o.params = Some(ParamsAs::Master);
    let p = pack(&stepped[0].opt, &o).unwrap();
    let c = p.plan.chunks.iter().find(|c| c.key == "fc.weight").unwrap();
    assert_eq!((c.dtype, c.global_shape.clone()), (DType::F32, vec![10, 7]));
}

#[test]
fn failed_loads_name_the_key_and_leave_the_optimizer_unchanged() {
    let cfg = config(StateFormat::Fp32, 0);
    let src = ranks(2, &cfg, DType::F32, 2);
    let dir = tmp("optim-fail");
    save_all(&src, &dir, Mode::Portable);
    // A checkpoint lacking a key the optimizer has state for: strict fails, nothing changes.
    let mut d = ranks(2, &cfg, DType::F32, 1).remove(0);
    let before: Vec<_> = (0..MODEL.len())
        .flat_map(|i| {
            d.opt
                .state_keys(i)
                .unwrap()
                .into_iter()
                .map(move |k| (i, k))
        })
        .map(|(i, k)| d.opt.get_state(i, &k).unwrap())
        .collect();
    std::fs::create_dir_all(dir.join("partial")).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let mut entries = vec![];
    for (k, info) in &ck.keys {
        if k.starts_with("state.fc.bias.") {
            continue;
        }
        let spec = fo::ShardSpec::unsharded(info.global_shape.clone()).unwrap();
        entries.push(fo::ckpt::StateEntry::new(
            k.clone(),
            ck.read(k, &spec).unwrap(),
            None,
        ));
    }
    fo::ckpt::save_rank(
        &dir.join("partial"),
        &fo::ckpt::Packed::new(entries, fo::ckpt::PackOptions::new(0, 1)).unwrap(),
    )
    .unwrap();
    let e = load(&mut d.opt, &dir.join("partial"), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("state.fc.bias.exp_avg") && e.contains("missing"),
        "{e}"
    );
    let after: Vec<_> = (0..MODEL.len())
        .flat_map(|i| {
            d.opt
                .state_keys(i)
                .unwrap()
                .into_iter()
                .map(move |k| (i, k))
        })
        .map(|(i, k)| d.opt.get_state(i, &k).unwrap())
        .collect();
    assert_eq!(before, after);
    // Non-strict: loads the rest and reports the missing keys.
    let rep = load(
        &mut d.opt,
        &dir.join("partial"),
        &LoadOptions {
            strict: false,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(
        rep.missing.contains(&"state.fc.bias.exp_avg".to_string()),
        "{rep:?}"
    );
    // A shape that does not match: the error names key and shapes.
    let mut other = fo::optim::Optimizer::new(cfg.clone()).unwrap();
    let mut b = Buf::new(fo::Tensor::zeros(DType::F32, vec![10, 6]));
    unsafe { other.add_param("fc.weight", b.view(), None, 0).unwrap() };
    let e = load(
        &mut other,
        &dir,
        &LoadOptions {
            strict: false,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("state.fc.weight.exp_avg") && e.contains("[10, 7]") && e.contains("[10, 6]"),
        "{e}"
    );
    assert!(!other.has_state(0));
}

#[test]
fn sgd_momentum_and_quant8_wide_states_reshard() {
    use fo::optim::{Algorithm, OptimConfig};
    let mut sgd = OptimConfig::default_for(Algorithm::Sgd);
    sgd.momentum = 0.9;
    sgd.state_format = StateFormat::Quant8;
    sgd.master_weight_bits = 24;
    let wide = config(StateFormat::Quant8Wide, 24);
    for (name, cfg) in [("sgd", sgd), ("wide", wide)] {
        let src = ranks(2, &cfg, DType::BF16, 2);
        let dir = tmp(&format!("optim-{name}"));
        save_all(&src, &dir, Mode::Compressed);
        let ck = Checkpoint::open(&dir).unwrap();
        if name == "sgd" {
            assert!(ck.is_compressed("state.fc.weight.momentum_buffer"));
        } else {
            // quant8_wide variance (4th-root codes) is saved dequantized; momentum compressed.
            assert!(
                ck.keys.contains_key("state.fc.weight.exp_avg_sq")
                    && ck.is_compressed("state.fc.weight.exp_avg")
            );
        }
        let key = if name == "sgd" {
            "momentum_buffer"
        } else {
            "exp_avg_sq"
        };
        let want = ck
            .read_f32(
                &format!("state.fc.weight.{key}"),
                &fo::ShardSpec::unsharded(vec![10, 7]).unwrap(),
            )
            .unwrap();
        for r in 0..3 {
            let mut d = Rank::new(3, r, cfg.clone(), DType::BF16);
            load(&mut d.opt, &dir, &LoadOptions::default()).unwrap();
            let got = d.opt.get_state(0, key).unwrap().to_f32().unwrap();
            let s = &d.specs[0];
            let rows = s.indices(0);
            let amax = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (j, g) in got.iter().enumerate() {
                let w = want[rows[j / 7] * 7 + j % 7];
                assert!(
                    (g - w).abs() <= amax * 0.02 + 1e-12,
                    "{name} rank {r} element {j}: {g} vs {w}"
                );
            }
            assert_eq!(
                d.opt.get_state(0, "error_bits").unwrap(),
                ck.read("state.fc.weight.error_bits", s).unwrap()
            );
        }
    }
}

#[test]
fn params_saved_as_stored_reload_with_their_error_bits() {
    let cfg = config(StateFormat::Quant8, 24);
    let src = ranks(2, &cfg, DType::BF16, 3);
    let dir = tmp("optim-stored");
    for (r, rank) in src.iter().enumerate() {
        let mut o = SaveOptions::new(r, 2, Mode::Compressed);
        o.params = Some(ParamsAs::Stored);
        o.save_id = "stored".into();
        save_optimizer(&rank.opt, &dir, &o).unwrap();
    }
    for (r, s) in src.iter().enumerate() {
        let mut d = Rank::new(2, r, cfg.clone(), DType::BF16);
        load(
            &mut d.opt,
            &dir,
            &LoadOptions {
                params: true,
                ..Default::default()
            },
        )
        .unwrap();
        for i in 0..MODEL.len() {
            assert_eq!(d.params[i].bytes(), s.params[i].bytes(), "param {i}");
            if s.opt.param(i).numel() > 0 && s.opt.has_state(i) {
                assert_eq!(
                    d.opt.get_state(i, "error_bits").unwrap(),
                    s.opt.get_state(i, "error_bits").unwrap()
                );
                assert_eq!(
                    d.opt.get_state(i, "master").unwrap(),
                    s.opt.get_state(i, "master").unwrap()
                );
            }
        }
    }
}

#[test]
fn error_bits_without_a_master_split_are_unexpected() {
    let src = ranks(1, &config(StateFormat::Fp32, 24), DType::BF16, 1);
    let dir = tmp("optim-bits");
    save_all(&src, &dir, Mode::Portable);
    let mut d = Rank::new(1, 0, config(StateFormat::Fp32, 0), DType::BF16);
    let e = load(&mut d.opt, &dir, &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unexpected keys [state.fc.bias.error_bits"),
        "{e}"
    );
    assert!(!d.opt.has_state(0), "strict failure changed nothing");
    let rep = load(
        &mut d.opt,
        &dir,
        &LoadOptions {
            strict: false,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        rep.unexpected
            .iter()
            .filter(|k| *k == "state.fc.weight.error_bits")
            .count(),
        1,
        "{rep:?}"
    );
    assert!(d.opt.has_state(0));
}
