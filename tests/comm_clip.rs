//! `clip_grad_norm` across in-process groups: the total norm counts every shard once and
//! replicated gradients once, matches a single-process computation over the global
//! gradients, scales exactly as torch does, and never leaves a rank waiting.
mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{group, run_ranks, Buf, Rng};
use fo::clip::clip_grad_norm;
use fo::DType;
use half::{bf16, f16};

fn encode(d: DType, v: &[f32]) -> Vec<u8> {
    match d {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::BF16 => v
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect(),
        DType::F16 => v
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_le_bytes())
            .collect(),
        _ => unreachable!(),
    }
}

fn decode(d: DType, b: &[u8]) -> Vec<f32> {
    match d {
        DType::F32 => b
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::BF16 => b
            .chunks(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::F16 => b
            .chunks(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => unreachable!(),
    }
}

/// One rank's gradients: (dtype, values as stored, is_shard).
type Grads = Vec<(DType, Vec<f32>, bool)>;

fn random_grads(world: usize, seed: u64) -> Vec<Grads> {
    let mut rng = Rng::new(seed);
    let dts = [DType::F32, DType::BF16, DType::F16];
    let replicated: Grads = (0..rng.below(3))
        .map(|_| {
            let d = dts[rng.below(3)];
            let v: Vec<f32> = (0..rng.below(20)).map(|_| rng.f32() * 4.0).collect();
            (d, decode(d, &encode(d, &v)), false)
        })
        .collect();
    (0..world)
        .map(|r| {
            // Some ranks (an expert that got no tokens) hold no shard at all.
            let n = if r % 3 == 2 { 0 } else { rng.below(4) };
            let mut g: Grads = (0..n)
                .map(|_| {
                    let d = dts[rng.below(3)];
                    let v: Vec<f32> = (0..rng.below(40)).map(|_| rng.f32() * 3.0).collect();
                    (d, decode(d, &encode(d, &v)), true)
                })
                .collect();
            g.extend(replicated.iter().cloned());
            g
        })
        .collect()
}

fn expected_total(all: &[Grads], p: f64) -> f64 {
    let shard = all
        .iter()
        .flatten()
        .filter(|g| g.2)
        .flat_map(|g| g.1.iter());
    let rep = all[0].iter().filter(|g| !g.2).flat_map(|g| g.1.iter());
    let vals: Vec<f64> = shard.chain(rep).map(|&x| (x as f64).abs()).collect();
    if p.is_infinite() {
        vals.iter().cloned().fold(0.0, f64::max)
    } else {
        vals.iter().map(|a| a.powf(p)).sum::<f64>().powf(1.0 / p)
    }
}

/// Per rank: the clip's result and each gradient's bytes afterwards.
type Outcome = Vec<(Result<f64, String>, Vec<Vec<u8>>)>;

fn run(all: Arc<Vec<Grads>>, max_norm: f64, p: f64, err_nonfinite: bool) -> Outcome {
    let world = all.len();
    run_ranks(group(world, 5.0), Duration::from_secs(15), move |comm| {
        let mine = &all[comm.rank()];
        let mut bufs: Vec<Buf> = mine
            .iter()
            .map(|(d, v, _)| Buf::from_bytes(&encode(*d, v)))
            .collect();
        let grads: Vec<(fo::TensorView, bool)> = mine
            .iter()
            .zip(bufs.iter_mut())
            .map(|((d, v, s), b)| (b.view(*d, &[v.len()]), *s))
            .collect();
        let r = unsafe { clip_grad_norm(&comm, &grads, max_norm, p, err_nonfinite) }
            .map_err(|e| e.to_string());
        (r, bufs.iter().map(|b| b.bytes().to_vec()).collect())
    })
}

#[test]
fn total_norm_counts_shards_and_replicated_grads_once_for_every_p() {
    for world in 1..=8 {
        for (i, p) in [2.0, 1.0, 3.5, 0.5, f64::INFINITY].into_iter().enumerate() {
            let seed = 31 * world as u64 + i as u64;
            let all = Arc::new(random_grads(world, seed));
            let want = expected_total(&all, p);
            let max_norm = want * 0.5 + 0.01;
            let out = run(all.clone(), max_norm, p, false);
            let total = *out[0].0.as_ref().unwrap();
            assert!(
                (total - want).abs() <= 1e-9 * want.max(1.0),
                "world {world} p {p}: {total} vs {want}"
            );
            for (rank, (r, bytes)) in out.iter().enumerate() {
                assert_eq!(
                    r.as_ref().unwrap().to_bits(),
                    total.to_bits(),
                    "rank {rank}: every rank gets the same total"
                );
                let coef = max_norm / (total + 1e-6);
                for ((d, v, _), b) in all[rank].iter().zip(bytes) {
                    let scaled: Vec<f32> = if coef < 1.0 {
                        v.iter().map(|&x| x * coef as f32).collect()
                    } else {
                        v.clone()
                    };
                    assert_eq!(
                        b,
                        &encode(*d, &scaled),
                        "world {world} p {p} rank {rank} {d}"
                    );
                }
            }
        }
    }
}

#[test]
fn no_gradients_anywhere_is_a_zero_norm_and_no_hang() {
    let out = run(Arc::new(vec![vec![]; 5]), 1.0, 2.0, true);
    assert!(out.iter().all(|(r, _)| *r.as_ref().unwrap() == 0.0));
}

#[test]
fn a_norm_under_max_norm_leaves_gradients_bit_identical() {
    let all = Arc::new(vec![
        vec![(DType::BF16, vec![0.1, -0.2], true)],
        vec![(DType::F16, vec![0.3], true)],
    ]);
    let out = run(all.clone(), 10.0, 2.0, false);
    assert_eq!(out[0].1[0], encode(DType::BF16, &all[0][0].1));
    assert_eq!(out[1].1[0], encode(DType::F16, &all[1][0].1));
}

#[test]
fn a_nan_on_one_rank_is_every_ranks_error_and_nothing_is_scaled() {
    let g = |v: f32| vec![(DType::F32, vec![v, 100.0], true)];
    let all = Arc::new(vec![g(1.0), g(f32::NAN), g(2.0)]);
    let out = run(all.clone(), 1.0, 2.0, true);
    for (rank, (r, bytes)) in out.iter().enumerate() {
        let e = r.as_ref().unwrap_err();
        assert!(
            e.contains("numerics error") && e.contains("NaN"),
            "rank {rank}: {e}"
        );
        assert_eq!(
            bytes[0],
            encode(DType::F32, &all[rank][0].1),
            "rank {rank}: grads must be untouched"
        );
    }
    // Without the check the total is NaN on every rank (torch then scales by NaN too).
    let out = run(all, 1.0, f64::INFINITY, false);
    assert!(out.iter().all(|(r, _)| r.as_ref().unwrap().is_nan()));
}

#[test]
fn an_inf_gradient_gives_an_infinite_total() {
    let all = Arc::new(vec![vec![(DType::F16, vec![f32::INFINITY], true)], vec![]]);
    let out = run(all, 1.0, 2.0, false);
    assert!(out
        .iter()
        .all(|(r, _)| *r.as_ref().unwrap() == f64::INFINITY));
}

#[test]
fn a_bad_argument_on_one_rank_fails_every_rank_without_a_hang() {
    let world = 4;
    let out = run_ranks(group(world, 5.0), Duration::from_secs(15), |comm| {
        let p = if comm.rank() == 3 { -1.0 } else { 2.0 };
        let mut b = Buf::from_bytes(&[0u8; 4]);
        let g = vec![(b.view(DType::I32, &[1]), true)];
        let none: Vec<(fo::TensorView, bool)> = vec![];
        let grads = if comm.rank() == 1 { &g } else { &none };
        unsafe { clip_grad_norm(&comm, grads, 1.0, p, false) }
            .unwrap_err()
            .to_string()
    });
    // Rank 1's I32 gradient is the lowest failing rank's error, reported everywhere.
    assert!(out.iter().all(|e| e == &out[0]), "{out:?}");
    assert!(
        out[0].contains("grads[0] is I32") && out[0].contains("(on rank 1)"),
        "{}",
        out[0]
    );
}
