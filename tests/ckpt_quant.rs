//! Compressed (quant8) state across shardings (codec: fo::optim::math::quant8, checked against
//! FlashOptim's oracle in tests/optim_codecs.rs): same-layout loads copy codes and scales exactly; other layouts
//! dequantize with the saved groups exactly and requantize within the documented bound;
//! portable state quantizes on load exactly as a fresh quantization would.
use std::path::Path;

use fo::ckpt::{local_shard, save, Checkpoint, PackOptions, Packed, StateEntry};
use fo::shard::{mesh_coords, Placement, ShardSpec};
use fo::{DType, Tensor};
use half::f16;

/// A saving rank: its spec, momentum codes and scales, variance codes and scales.
type SavedRank = (ShardSpec, Vec<u8>, Vec<f16>, Vec<u8>, Vec<f16>);

fn f16_bytes(s: &[f16]) -> Vec<u8> {
    s.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
}

/// The codec the checkpoint uses (fo::optim::math::quant8) as byte vectors.
mod q8 {
    use fo::optim::math::quant8 as q;
    use half::f16;
    pub fn quantize_signed(x: &[f32]) -> (Vec<u8>, Vec<f16>) {
        let mut c = vec![0i8; x.len()];
        let mut s = vec![f16::ZERO; q::num_groups(x.len())];
        q::quantize_signed(x, &mut c, &mut s);
        (c.into_iter().map(|v| v as u8).collect(), s)
    }
    pub fn quantize_unsigned_sqrt(x: &[f32]) -> (Vec<u8>, Vec<f16>) {
        let mut c = vec![0u8; x.len()];
        let mut s = vec![f16::ZERO; q::num_groups(x.len())];
        q::quantize_unsigned_sqrt(x, &mut c, &mut s);
        (c, s)
    }
    pub fn decode_signed(c: i8, s: f32) -> f32 {
        let mut o = [0f32];
        q::decode_signed_group(&[c], f16::from_f32(s), &mut o);
        o[0]
    }
    pub fn decode_unsigned_sqrt(c: u8, s: f32) -> f32 {
        let mut o = [0f32];
        q::decode_unsigned_sqrt_group(&[c], f16::from_f32(s), &mut o);
        o[0]
    }
}

fn layouts() -> Vec<(Vec<usize>, Vec<Placement>)> {
    use Placement::*;
    vec![
        (vec![1], vec![Replicate]),
        (vec![2], vec![Shard(0)]),
        (vec![3], vec![Shard(0)]),
        (
            vec![4],
            vec![StridedShard {
                dim: 0,
                split_factor: 2,
            }],
        ),
        (vec![5], vec![Shard(1)]),
        (vec![2, 2], vec![Shard(0), Shard(1)]),
        (vec![2, 2], vec![Replicate, Shard(0)]),
    ]
}

fn values(n: usize, seed: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 * 0.7 + seed).sin() * (1.0 + (i % 13) as f32)).powi(3))
        .collect()
}

/// Each rank quantizes its own local momentum and variance (as the optimizer does) and
/// saves codes and scales; returns every rank's (spec, m codes, m scales, v codes, v scales).
fn save_compressed(
    dir: &Path,
    mesh: &[usize],
    pl: &[Placement],
    m: &Tensor,
    v: &Tensor,
) -> Vec<SavedRank> {
    let coords = mesh_coords(mesh);
    let mut ranks = vec![];
    let packs: Vec<Packed> = coords
        .iter()
        .enumerate()
        .map(|(r, c)| {
            let s = ShardSpec::new(m.shape.clone(), mesh.to_vec(), c.clone(), pl.to_vec()).unwrap();
            let (mq, ms) = q8::quantize_signed(&local_shard(m, &s).to_f32().unwrap());
            let (vq, vs) = q8::quantize_unsigned_sqrt(&local_shard(v, &s).to_f32().unwrap());
            let shape = s.local_shape();
            let t = |d, b: &[u8], sh: Vec<usize>| Tensor::new(d, sh, b.to_vec()).unwrap();
            let entries = vec![
                StateEntry::new(
                    "state.w.exp_avg::quantized",
                    t(DType::I8, &mq, shape.clone()),
                    Some(s.clone()),
                ),
                StateEntry::group_scales(
                    "state.w.exp_avg::scales",
                    t(DType::F16, &f16_bytes(&ms), vec![ms.len()]),
                    "state.w.exp_avg::quantized",
                ),
                StateEntry::new(
                    "state.w.exp_avg_sq::quantized",
                    t(DType::U8, &vq, shape),
                    Some(s.clone()),
                ),
                StateEntry::group_scales(
                    "state.w.exp_avg_sq::scales",
                    t(DType::F16, &f16_bytes(&vs), vec![vs.len()]),
                    "state.w.exp_avg_sq::quantized",
                ),
            ];
            ranks.push((s, mq, ms, vq, vs));
            let mut o = PackOptions::new(r, coords.len());
            o.mode = "compressed".into();
            Packed::new(entries, o).unwrap()
        })
        .collect();
    save(dir, &packs).unwrap();
    ranks
}

/// The values a source rank's optimizer sees: its codes decoded with its own scales,
/// placed at global positions.
fn saved_dequantized(shape: &[usize], ranks: &[SavedRank], momentum: bool) -> Tensor {
    let mut full = Tensor::zeros(DType::F32, shape.to_vec());
    for (s, mq, ms, vq, vs) in ranks {
        let local: Vec<f32> = if momentum {
            mq.iter()
                .enumerate()
                .map(|(i, &q)| q8::decode_signed(q as i8, ms[i / 32].to_f32()))
                .collect()
        } else {
            vq.iter()
                .enumerate()
                .map(|(i, &q)| q8::decode_unsigned_sqrt(q, vs[i / 32].to_f32()))
                .collect()
        };
        let strides = fo::tensor::contiguous_strides(shape);
        let idx: Vec<Vec<usize>> = (0..shape.len()).map(|d| s.indices(d)).collect();
        for (i, x) in local.iter().enumerate() {
            let (mut rem, mut at) = (i, 0);
            for d in (0..idx.len()).rev() {
                at += idx[d][rem % idx[d].len()] * strides[d];
                rem /= idx[d].len();
            }
            full.data[at * 4..at * 4 + 4].copy_from_slice(&x.to_le_bytes());
        }
    }
    full
}

#[test]
fn compressed_state_reshards_exactly_or_within_the_requantization_bound() {
    let shape = vec![11, 37];
    let m = Tensor::from_f32(shape.clone(), &values(11 * 37, 0.3)).unwrap();
    let v = Tensor::from_f32(
        shape.clone(),
        &values(11 * 37, 1.1)
            .iter()
            .map(|x| x * x)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let root = std::env::temp_dir().join(format!("fo-quant-{}", std::process::id()));
    let (mut exact, mut requant) = (0, 0);
    for (i, (smesh, spl)) in layouts().into_iter().enumerate() {
        let dir = root.join(format!("s{i}"));
        let ranks = save_compressed(&dir, &smesh, &spl, &m, &v);
        let ck = Checkpoint::open(&dir).unwrap();
        let (md, vd) = (
            saved_dequantized(&shape, &ranks, true),
            saved_dequantized(&shape, &ranks, false),
        );
        for (dmesh, dpl) in layouts() {
            for c in mesh_coords(&dmesh) {
                let d = ShardSpec::new(shape.clone(), dmesh.clone(), c, dpl.clone()).unwrap();
                // Portable view: exactly what the saving ranks decoded.
                let mf = ck.read_f32("state.w.exp_avg", &d).unwrap();
                assert_eq!(
                    Tensor::from_f32(d.local_shape(), &mf).unwrap(),
                    local_shard(&md, &d)
                );
                let vf = ck.read_f32("state.w.exp_avg_sq", &d).unwrap();
                assert_eq!(
                    Tensor::from_f32(d.local_shape(), &vf).unwrap(),
                    local_shard(&vd, &d)
                );
                let qm = ck.read_quant8("state.w.exp_avg", &d, true).unwrap();
                let qv = ck.read_quant8("state.w.exp_avg_sq", &d, false).unwrap();
                let same = ranks
                    .iter()
                    .find(|r| (0..2).all(|k| r.0.runs(k).unwrap() == d.runs(k).unwrap()));
                if let Some((_, mq, ms, vq, vs)) = same {
                    assert!(qm.exact && qv.exact);
                    assert_eq!((&qm.codes.data, &qm.scales.data), (mq, &f16_bytes(ms)));
                    assert_eq!((&qv.codes.data, &qv.scales.data), (vq, &f16_bytes(vs)));
                    exact += 1;
                    continue;
                }
                assert!(!qm.exact && !qv.exact);
                requant += 1;
                let ms: Vec<f32> = qm.scales.to_f32().unwrap();
                let vs: Vec<f32> = qv.scales.to_f32().unwrap();
                for (j, (&x, (&q, &qv_))) in mf
                    .iter()
                    .zip(qm.codes.data.iter().zip(&qv.codes.data))
                    .enumerate()
                {
                    let g = j / 32;
                    let am = mf[g * 32..(g * 32 + 32).min(mf.len())]
                        .iter()
                        .fold(0f32, |a, b| a.max(b.abs()));
                    let x2 = q8::decode_signed(q as i8, ms[g]);
                    assert!(
                        (x2 - x).abs() <= am * (1.0 / 127.0 + 1.0 / 1024.0),
                        "momentum {j}: {x2} vs {x}"
                    );
                    let av = vf[g * 32..(g * 32 + 32).min(vf.len())]
                        .iter()
                        .fold(0f32, |a, b| a.max(b.sqrt()));
                    let v2 = q8::decode_unsigned_sqrt(qv_, vs[g]);
                    assert!(
                        (v2.sqrt() - vf[j].sqrt()).abs() <= av * (1.0 / 510.0 + 1.0 / 1024.0),
                        "variance {j}"
                    );
                }
            }
        }
    }
    assert!(
        exact > 10 && requant > 50,
        "both paths exercised: {exact} exact, {requant} requantized"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn portable_state_quantizes_on_load_like_a_fresh_quantization() {
    let dir = std::env::temp_dir().join(format!("fo-quant-portable-{}", std::process::id()));
    let m = Tensor::from_f32(vec![70], &values(70, 2.0)).unwrap();
    let packs: Vec<Packed> = (0..3)
        .map(|r| {
            let s = ShardSpec::new(vec![70], vec![3], vec![r], vec![Placement::Shard(0)]).unwrap();
            Packed::new(
                vec![StateEntry::new(
                    "state.w.exp_avg",
                    local_shard(&m, &s),
                    Some(s),
                )],
                PackOptions::new(r, 3),
            )
            .unwrap()
        })
        .collect();
    save(&dir, &packs).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    for r in 0..2 {
        let d = ShardSpec::new(vec![70], vec![2], vec![r], vec![Placement::Shard(0)]).unwrap();
        let q = ck.read_quant8("state.w.exp_avg", &d, true).unwrap();
        let (codes, scales) = q8::quantize_signed(&local_shard(&m, &d).to_f32().unwrap());
        assert_eq!((q.codes.data, q.scales.data), (codes, f16_bytes(&scales)));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn consolidation_writes_flashoptim_unsharded_layout() {
    use fo::ckpt::consolidate;
    let shape = vec![11, 37];
    let m = Tensor::from_f32(shape.clone(), &values(11 * 37, 0.3)).unwrap();
    let v = Tensor::from_f32(
        shape.clone(),
        &values(11 * 37, 1.1)
            .iter()
            .map(|x| x * x)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let root = std::env::temp_dir().join(format!("fo-quant-cons-{}", std::process::id()));
    for (i, (mesh, pl)) in [
        (vec![1], vec![Placement::Replicate]),
        (vec![3], vec![Placement::Shard(0)]),
    ]
    .into_iter()
    .enumerate()
    {
        let dir = root.join(format!("s{i}"));
        let ranks = save_compressed(&dir, &mesh, &pl, &m, &v);
        let out = consolidate(&dir, &dir.join("full"), &mut |_, _| {}).unwrap();
        let bytes = std::fs::read(&out.file).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let codes = st.tensor("state.w.exp_avg::quantized").unwrap();
        let scales = st.tensor("state.w.exp_avg::scales").unwrap();
        assert_eq!(codes.shape(), &[11, 37]);
        assert_eq!(
            scales.shape(),
            &[13],
            "one scale per 32 elements of the full tensor"
        );
        if i == 0 {
            // Saved unsharded: copied bit for bit.
            assert_eq!(
                (codes.data(), scales.data()),
                (&ranks[0].1[..], &f16_bytes(&ranks[0].2)[..])
            );
        } else {
            // Saved on 3 ranks: the saved values, requantized in full-tensor groups.
            let md = saved_dequantized(&shape, &ranks, true).to_f32().unwrap();
            let (c, s) = q8::quantize_signed(&md);
            assert_eq!((codes.data(), scales.data()), (&c[..], &f16_bytes(&s)[..]));
        }
    }
    std::fs::remove_dir_all(&root).unwrap();
}
