//! The checkpoints PyTorch 2.15 wrote (tests/oracle/ckpt_*): fo reads them into 1..5
//! ranks under several placements and every shard equals the same slice of
//! `full.safetensors`; reassembling the shards gives `full.safetensors` bit for bit; and
//! `consolidate` reproduces every key of it, including the integer buffer and the 0-dim
//! `step`s that torch's own consolidation drops or zeroes.
use std::path::{Path, PathBuf};

use fo::ckpt::{consolidate, local_shard, verify, Checkpoint};
use fo::shard::{mesh_coords, Placement, ShardSpec};
use fo::{DType, Tensor};

const DIRS: [&str; 2] = ["ckpt_fsdp2_4ranks", "ckpt_fsdp_tp_2x2"];

fn oracle(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/oracle")
        .join(name)
}

fn load_full(path: &Path) -> Vec<(String, Tensor)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Tensor)> = st
        .tensors()
        .into_iter()
        .map(|(k, v)| {
            let dtype = DType::from_safetensors_name(&format!("{:?}", v.dtype())).unwrap();
            (
                k,
                Tensor::new(dtype, v.shape().to_vec(), v.data().to_vec()).unwrap(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Destination layouts for `m` ranks of a tensor with `ndim` dims.
fn targets(ndim: usize, m: usize) -> Vec<(Vec<usize>, Vec<Placement>)> {
    use Placement::*;
    if ndim == 0 {
        return vec![(vec![1], vec![Replicate])];
    }
    let mut v = vec![
        (vec![m], vec![Shard(0)]),
        (
            vec![m],
            vec![StridedShard {
                dim: 0,
                split_factor: 2,
            }],
        ),
    ];
    if ndim > 1 {
        v.push((vec![m], vec![Shard(ndim - 1)]));
    }
    v
}

/// Places every rank's shard back into a full tensor (the inverse of sharding).
fn reassemble(shards: &[(ShardSpec, Tensor)], like: &Tensor) -> Tensor {
    let mut full = Tensor::zeros(like.dtype, like.shape.clone());
    let es = like.dtype.size();
    let strides = fo::tensor::contiguous_strides(&like.shape);
    for (spec, t) in shards {
        let idx: Vec<Vec<usize>> = (0..like.shape.len()).map(|d| spec.indices(d)).collect();
        for (i, chunk) in t.data.chunks(es).enumerate() {
            let (mut rem, mut at) = (i, 0);
            for d in (0..idx.len()).rev() {
                at += idx[d][rem % idx[d].len()] * strides[d];
                rem /= idx[d].len();
            }
            full.data[at * es..(at + 1) * es].copy_from_slice(chunk);
        }
    }
    full
}

#[test]
fn loads_torch_checkpoints_into_one_to_five_ranks_bit_for_bit() {
    for name in DIRS {
        let ck = Checkpoint::open(&oracle(name).join("sharded")).unwrap();
        let full = load_full(&oracle(name).join("full.safetensors"));
        assert_eq!(full.len(), 48);
        assert_eq!(ck.keys.len(), 48, "{name}: every torch key is found");
        for (key, g) in &full {
            let info = ck.key(key).unwrap();
            assert_eq!(
                (info.dtype, &info.global_shape),
                (g.dtype, &g.shape),
                "{name} {key}"
            );
            for m in 1..=5 {
                for (mesh, pl) in targets(g.shape.len(), m) {
                    let shards: Vec<(ShardSpec, Tensor)> = mesh_coords(&mesh)
                        .into_iter()
                        .map(|c| {
                            let s = ShardSpec::new(g.shape.clone(), mesh.clone(), c, pl.clone())
                                .unwrap();
                            let t = ck
                                .read(key, &s)
                                .unwrap_or_else(|e| panic!("{name} {key} on {m} ranks: {e}"));
                            assert_eq!(t, local_shard(g, &s), "{name} {key} {pl:?} on {m} ranks");
                            (s, t)
                        })
                        .collect();
                    assert!(
                        reassemble(&shards, g) == *g,
                        "{name} {key}: {m} shards {pl:?} reassemble to full.safetensors"
                    );
                }
            }
        }
    }
}

#[test]
fn consolidates_torch_checkpoints_to_full_for_every_key() {
    for name in DIRS {
        let out =
            std::env::temp_dir().join(format!("fo-consolidate-{name}-{}", std::process::id()));
        let done = consolidate(&oracle(name).join("sharded"), &out, &mut |_, _| {}).unwrap();
        let got = load_full(&done.file);
        let want = load_full(&oracle(name).join("full.safetensors"));
        assert_eq!(got.len(), want.len());
        for ((k1, a), (k2, b)) in got.iter().zip(&want) {
            assert_eq!(k1, k2);
            assert!(
                a == b,
                "{name}: consolidated {k1} differs from full.safetensors"
            );
        }
        let step = got
            .iter()
            .find(|(k, _)| k == "state.fc1.weight.step")
            .unwrap();
        assert_eq!(
            step.1.to_f32().unwrap(),
            vec![3.0],
            "0-dim step keeps its value (torch writes 0.0)"
        );
        let index: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&done.index).unwrap()).unwrap();
        assert_eq!(
            index["weight_map"]["bn.num_batches_tracked"],
            "model-00001-of-00001.safetensors"
        );
        assert_eq!(index["weight_map"].as_object().unwrap().len(), 48);
        std::fs::remove_dir_all(&out).unwrap();
    }
}

#[test]
fn verifies_coverage_of_torch_checkpoints() {
    for name in DIRS {
        let v = verify(&oracle(name).join("sharded"), &mut |_, _| {}).unwrap();
        assert_eq!(v.files, 4);
        assert_eq!(v.checksummed_chunks, 0, "torch writes no checksums");
        assert!(v.chunks > 48);
    }
}

/// torch's checkpoint loaded through fo's optimizer: each of 3 ranks registers its
/// Shard(0) slice of every parameter; states, params and steps equal full.safetensors.
#[test]
fn loads_torch_checkpoint_into_fo_optimizers_on_three_ranks() {
    use fo::ckpt::{load, LoadOptions};
    use fo::optim::{Algorithm, OptimConfig, Optimizer, StateFormat};
    let full = load_full(&oracle("ckpt_fsdp2_4ranks").join("full.safetensors"));
    let get = |k: &str| {
        full.iter()
            .find(|(n, _)| n == k)
            .map(|(_, t)| t.clone())
            .unwrap()
    };
    let params: Vec<&str> = full
        .iter()
        .map(|(k, _)| k.as_str())
        .filter(|k| full.iter().any(|(s, _)| *s == format!("state.{k}.exp_avg")))
        .collect();
    assert_eq!(params.len(), 11);
    let mut cfg = OptimConfig::default_for(Algorithm::AdamW);
    cfg.state_format = StateFormat::Fp32;
    cfg.master_weight_bits = 0;
    for r in 0..3 {
        let mut opt = Optimizer::new(cfg.clone()).unwrap();
        let mut bufs: Vec<Vec<u64>> = vec![];
        let mut specs = vec![];
        for k in &params {
            let g = get(k);
            let s = ShardSpec::new(g.shape.clone(), vec![3], vec![r], vec![Placement::Shard(0)])
                .unwrap();
            let mut b = vec![0u64; (s.local_numel() * g.dtype.size()).div_ceil(8).max(1)];
            let shape: Vec<i64> = s.local_shape().iter().map(|&d| d as i64).collect();
            let t = unsafe {
                fo::tensor::TensorView::host(b.as_mut_ptr() as *mut u8, g.dtype, &shape, None, k)
                    .unwrap()
            };
            unsafe { opt.add_param(k, t, Some(s.clone()), 0).unwrap() };
            bufs.push(b);
            specs.push(s);
        }
        let rep = load(
            &mut opt,
            &oracle("ckpt_fsdp2_4ranks").join("sharded"),
            &LoadOptions {
                params: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(
            rep.unexpected.is_empty() && rep.missing.is_empty(),
            "{rep:?}"
        );
        for (i, k) in params.iter().enumerate() {
            if specs[i].local_numel() == 0 {
                continue;
            }
            let want = local_shard(&get(&format!("state.{k}.exp_avg")), &specs[i])
                .to_f32()
                .unwrap();
            assert_eq!(
                opt.get_state(i, "exp_avg").unwrap().to_f32().unwrap(),
                want,
                "rank {r} {k}"
            );
            assert_eq!(
                opt.get_state(i, "step").unwrap().to_f32().unwrap(),
                vec![3.0]
            );
            let p = local_shard(&get(k), &specs[i]);
            assert_eq!(unsafe { opt.param(i).to_tensor() }, p, "rank {r} param {k}");
        }
    }
}
