//! `broadcast_state_dict` on in-process groups of 1 to 8 ranks, with randomized keys,
//! shapes, dtypes, meshes and placements (uneven, empty and strided shards): every rank's
//! destination must equal rank 0's full tensor sliced by the shard indices, bit for bit
//! where no cast applies, and each rank must receive only its shard bytes plus the table.
mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{group, run_ranks, Buf, Rng};
use fo::broadcast::{
    broadcast_state_dict, BroadcastDest, BroadcastOptions, BroadcastStats, Strategy, Table,
};
use fo::shard::{rank_to_coord, Placement, ShardSpec};
use fo::tensor::contiguous_strides;
use fo::DType;
use half::{bf16, f16};

#[derive(Clone, Debug)]
struct Key {
    key: String,
    src: DType,
    dst: DType,
    shape: Vec<usize>,
    /// Row-major bytes of the full tensor.
    full: Vec<u8>,
    /// Rank 0 holds the full tensor as a transposed (non-contiguous) view.
    full_transposed: bool,
    placements: Option<Vec<Placement>>,
    dest_transposed: bool,
}

#[derive(Clone, Debug)]
struct Case {
    mesh: Vec<usize>,
    keys: Vec<Key>,
    strategy: Strategy,
    seed: u64,
}

fn random_mesh(world: usize, rng: &mut Rng) -> Vec<usize> {
    let mut mesh = vec![];
    let mut left = world;
    while left > 1 && mesh.len() < 2 {
        let divs: Vec<usize> = (2..=left).filter(|d| left.is_multiple_of(*d)).collect();
        let d = divs[rng.below(divs.len())];
        mesh.push(d);
        left /= d;
    }
    if left > 1 {
        mesh.push(left);
    }
    if mesh.is_empty() || rng.chance(1, 4) {
        mesh.push(1);
    }
    mesh
}

fn random_case(world: usize, seed: u64) -> Case {
    let mut rng = Rng::new(seed);
    let mesh = random_mesh(world, &mut rng);
    let nkeys = 2 + rng.below(5);
    let keys = (0..nkeys)
        .map(|i| {
            let ndim = rng.below(4);
            let shape: Vec<usize> = (0..ndim)
                .map(|_| {
                    if rng.chance(1, 8) {
                        0
                    } else {
                        1 + rng.below(9)
                    }
                })
                .collect();
            let src = DType::ALL[rng.below(DType::ALL.len())];
            let halfish = [DType::F32, DType::BF16, DType::F16];
            let dst = if halfish.contains(&src) && rng.chance(1, 3) {
                halfish[rng.below(3)]
            } else {
                src
            };
            let numel: usize = shape.iter().product();
            let placements = (!rng.chance(1, 4)).then(|| {
                mesh.iter()
                    .map(|_| match (ndim, rng.below(4)) {
                        (0, 0 | 1) | (_, 0) => Placement::Replicate,
                        (0, _) | (_, 1) => Placement::Partial,
                        (_, 2) => Placement::Shard(rng.below(ndim)),
                        _ => Placement::StridedShard {
                            dim: rng.below(ndim),
                            split_factor: 1 + rng.below(3),
                        },
                    })
                    .collect()
            });
            Key {
                key: format!("layers.{}.w{}", rng.below(100), i),
                src,
                dst,
                full: rng.bytes(numel * src.size()),
                full_transposed: ndim == 2 && rng.chance(1, 3),
                dest_transposed: ndim == 2 && rng.chance(1, 3),
                placements,
                shape,
            }
        })
        .collect();
    let strategy = if rng.chance(1, 5) {
        Strategy::FullBroadcast
    } else {
        Strategy::Scatter
    };
    Case {
        mesh,
        keys,
        strategy,
        seed,
    }
}

fn spec_at(k: &Key, mesh: &[usize], rank: usize) -> Option<ShardSpec> {
    k.placements.as_ref().map(|pl| {
        ShardSpec::new(
            k.shape.clone(),
            mesh.to_vec(),
            rank_to_coord(rank, mesh),
            pl.clone(),
        )
        .unwrap()
    })
}

/// The reference slice: every local element looked up through the per-dim indices.
fn reference_slice(k: &Key, spec: Option<&ShardSpec>) -> Vec<u8> {
    let Some(spec) = spec else {
        return k.full.clone();
    };
    let es = k.src.size();
    let idx: Vec<Vec<usize>> = (0..k.shape.len()).map(|d| spec.indices(d)).collect();
    let local: Vec<usize> = idx.iter().map(Vec::len).collect();
    let n: usize = local.iter().product();
    let gs = contiguous_strides(&k.shape);
    let mut out = Vec::with_capacity(n * es);
    for flat in 0..n {
        let (mut rem, mut off) = (flat, 0);
        for d in (0..local.len()).rev() {
            off += idx[d][rem % local[d]] * gs[d];
            rem /= local[d];
        }
        out.extend_from_slice(&k.full[off * es..off * es + es]);
    }
    out
}

fn cast_ref(b: &[u8], src: DType, dst: DType) -> Vec<u8> {
    if src == dst {
        return b.to_vec();
    }
    let vals: Vec<f32> = match src {
        DType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => unreachable!(),
    };
    match dst {
        DType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => vals
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        DType::F16 => vals
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        _ => unreachable!(),
    }
}

/// Rank `rank`'s part of a case: returns its stats and each key's destination bytes (row-major).
fn run_rank(case: &Case, comm: fo::comm::Comm) -> (BroadcastStats, Vec<(String, Vec<u8>)>) {
    let rank = comm.rank();
    let mut rng = Rng::new(case.seed ^ ((rank as u64 + 1) * 7919));
    // Rank 0's full tensors, some as transposed views over column-major storage.
    let mut full_bufs: Vec<Buf> = case
        .keys
        .iter()
        .map(|k| {
            if k.full_transposed {
                let (r, c, es) = (k.shape[0], k.shape[1], k.src.size());
                let mut t = vec![0u8; k.full.len()];
                for i in 0..r {
                    for j in 0..c {
                        t[(j * r + i) * es..(j * r + i + 1) * es]
                            .copy_from_slice(&k.full[(i * c + j) * es..(i * c + j + 1) * es]);
                    }
                }
                Buf::from_bytes(&t)
            } else {
                Buf::from_bytes(&k.full)
            }
        })
        .collect();
    let mut full: Vec<(String, fo::TensorView)> = case
        .keys
        .iter()
        .zip(full_bufs.iter_mut())
        .map(|(k, b)| {
            let t = if k.full_transposed {
                b.strided(k.src, &k.shape, &[1, k.shape[0]])
            } else {
                b.view(k.src, &k.shape)
            };
            (k.key.clone(), t)
        })
        .collect();
    full.reverse(); // pairing is by name, never by position
    let mut dest_bufs: Vec<(usize, Buf, Vec<usize>)> = vec![];
    for (i, k) in case.keys.iter().enumerate() {
        let spec = spec_at(k, &case.mesh, rank);
        let shape = spec
            .as_ref()
            .map(|s| s.local_shape())
            .unwrap_or(k.shape.clone());
        let n: usize = shape.iter().product();
        dest_bufs.push((i, Buf::filled(n * k.dst.size(), 0xAB), shape));
    }
    let mut dests: Vec<BroadcastDest> = dest_bufs
        .iter_mut()
        .map(|(i, b, shape)| {
            let k = &case.keys[*i];
            let tensor = if k.dest_transposed {
                b.strided(k.dst, shape, &[1, shape[0].max(1)])
            } else {
                b.view(k.dst, shape)
            };
            BroadcastDest {
                key: k.key.clone(),
                tensor,
                spec: spec_at(k, &case.mesh, rank),
            }
        })
        .collect();
    for i in (1..dests.len()).rev() {
        dests.swap(i, rng.below(i + 1));
    }
    let opts = BroadcastOptions {
        strategy: case.strategy,
        ..Default::default()
    };
    let stats =
        unsafe { broadcast_state_dict(&comm, (rank == 0).then_some(&full[..]), &dests, &opts) }
            .unwrap_or_else(|e| panic!("seed {}: rank {rank}: {e}", case.seed));
    let out = dests
        .iter()
        .map(|d| (d.key.clone(), unsafe { d.tensor.to_tensor() }.data))
        .collect();
    (stats, out)
}

fn check_case(world: usize, seed: u64) {
    let case = Arc::new(random_case(world, seed));
    let c2 = case.clone();
    let results = run_ranks(group(world, 10.0), Duration::from_secs(20), move |comm| {
        run_rank(&c2, comm)
    });
    let table_len = 8 + {
        let mut bufs: Vec<Buf> = case.keys.iter().map(|k| Buf::from_bytes(&k.full)).collect();
        let full: Vec<(String, fo::TensorView)> = case
            .keys
            .iter()
            .zip(bufs.iter_mut())
            .map(|(k, b)| (k.key.clone(), b.view(k.src, &k.shape)))
            .collect();
        Table::from_full(&full).unwrap().encode().len() as u64
    };
    let mut sent_expected = 0u64;
    for (rank, (stats, got)) in results.iter().enumerate() {
        let mut expect_bytes = 0u64;
        for k in &case.keys {
            let spec = spec_at(k, &case.mesh, rank);
            let slice = reference_slice(k, spec.as_ref());
            let wire = match (case.strategy, &spec) {
                (Strategy::Scatter, Some(_)) => slice.len() as u64,
                _ => k.full.len() as u64,
            };
            expect_bytes += wire;
            if rank != 0 {
                sent_expected += wire;
            }
            let want = cast_ref(&slice, k.src, k.dst);
            let (_, have) = got.iter().find(|(key, _)| key == &k.key).unwrap();
            assert!(
                have == &want,
                "seed {seed} world {world} mesh {:?} rank {rank} key {} ({:?})",
                case.mesh,
                k.key,
                k
            );
        }
        assert_eq!(
            stats.bytes_received, expect_bytes,
            "seed {seed} rank {rank}: received bytes"
        );
        assert_eq!(
            stats.table_bytes, table_len,
            "seed {seed} rank {rank}: table bytes"
        );
        assert_eq!(stats.tensors, case.keys.len() as u64);
    }
    assert_eq!(
        results[0].0.bytes_sent, sent_expected,
        "seed {seed}: bytes sent by rank 0"
    );
}

#[test]
fn randomized_groups_of_1_to_8_ranks_get_exactly_their_slices() {
    for world in 1..=8 {
        for trial in 0..30 {
            check_case(world, 1000 * world as u64 + trial);
        }
    }
}

#[test]
fn a_rank_with_an_empty_shard_receives_only_the_table() {
    // (6,) over 4 ranks: rank 3 holds nothing; (3, 5) with _StridedShard(0, 2) over 4: rank 3 holds nothing.
    let full_a: Vec<u8> = (0..24).collect();
    let case = Arc::new(Case {
        mesh: vec![4],
        keys: vec![
            Key {
                key: "a".into(),
                src: DType::F32,
                dst: DType::F32,
                shape: vec![6],
                full: full_a,
                full_transposed: false,
                placements: Some(vec![Placement::Shard(0)]),
                dest_transposed: false,
            },
            Key {
                key: "b".into(),
                src: DType::U8,
                dst: DType::U8,
                shape: vec![3, 5],
                full: (0..15).collect(),
                full_transposed: false,
                placements: Some(vec![Placement::StridedShard {
                    dim: 0,
                    split_factor: 2,
                }]),
                dest_transposed: false,
            },
        ],
        strategy: Strategy::Scatter,
        seed: 7,
    });
    let c2 = case.clone();
    let results = run_ranks(group(4, 10.0), Duration::from_secs(20), move |comm| {
        run_rank(&c2, comm)
    });
    assert_eq!(results[3].0.bytes_received, 0);
    // rank 0: rows {0, 1} of a (8 bytes), rows {0, 2} of b (10 bytes).
    assert_eq!(results[0].0.bytes_received, 8 + 10);
    assert!(results[3].1.iter().all(|(_, b)| b.is_empty()));
}

#[test]
fn scatter_moves_a_shard_where_full_broadcast_moves_everything() {
    let full: Vec<u8> = (0..4 * 64 * 4).map(|i| i as u8).collect();
    let mk = |strategy| {
        Arc::new(Case {
            mesh: vec![4],
            keys: vec![Key {
                key: "w".into(),
                src: DType::F32,
                dst: DType::F32,
                shape: vec![64, 4],
                full: full.clone(),
                full_transposed: false,
                placements: Some(vec![Placement::Shard(0)]),
                dest_transposed: false,
            }],
            strategy,
            seed: 1,
        })
    };
    let (s, f) = (mk(Strategy::Scatter), mk(Strategy::FullBroadcast));
    let rs = run_ranks(group(4, 10.0), Duration::from_secs(20), move |c| {
        run_rank(&s, c).0
    });
    let rf = run_ranks(group(4, 10.0), Duration::from_secs(20), move |c| {
        run_rank(&f, c).0
    });
    for r in 0..4 {
        assert_eq!(rs[r].bytes_received, 256, "rank {r}: a quarter of 1 KiB");
        assert_eq!(rf[r].bytes_received, 1024, "rank {r}: the full tensor");
    }
    assert_eq!(rs[0].bytes_sent, 768);
    assert_eq!(rf[0].bytes_sent, 3072);
}

#[test]
fn keys_no_rank_asks_for_are_listed_but_never_sent() {
    let out = run_ranks(group(3, 10.0), Duration::from_secs(20), |comm| {
        let rank = comm.rank();
        let mut a = Buf::from_bytes(&[1u8; 16]);
        let mut opt = Buf::from_bytes(&[2u8; 4096]);
        let full = [
            ("a".to_string(), a.view(DType::F32, &[4])),
            ("optim.exp_avg".to_string(), opt.view(DType::F32, &[1024])),
        ];
        let mut d = Buf::filled(16, 0);
        let dests = [BroadcastDest {
            key: "a".into(),
            tensor: d.view(DType::F32, &[4]),
            spec: None,
        }];
        let st = unsafe {
            broadcast_state_dict(
                &comm,
                (rank == 0).then_some(&full[..]),
                &dests,
                &Default::default(),
            )
        }
        .unwrap();
        (st, d.bytes().to_vec())
    });
    for (st, d) in out {
        assert_eq!((st.tensors, st.bytes_received), (1, 16));
        assert_eq!(d, vec![1u8; 16]);
    }
}
