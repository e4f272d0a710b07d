//! Failure injection: a callback failing on one rank, a key missing on rank 0, shapes or
//! dtypes that disagree, ranks that disagree on layout, a cast failing on one rank. Every
//! rank must return an error within a bounded time (run_ranks fails the test on a hang),
//! agreed errors must be identical on every rank, and no destination may change.
mod common;

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{group, run_ranks, Buf};
use fo::broadcast::{broadcast_state_dict, BroadcastDest, BroadcastOptions};
use fo::comm::{Callbacks, Comm, ReduceOp};
use fo::shard::{rank_to_coord, Placement, ShardSpec};
use fo::{DType, Error};

const SENTINEL: u8 = 0xAB;

/// One rank's destinations: (key, dtype, global shape, sharded over the 1-D mesh?).
type DestList = Vec<(&'static str, DType, Vec<usize>, bool)>;
type DestsOf = Arc<dyn Fn(usize) -> DestList + Send + Sync>;

/// What one rank does: its destinations (key, dtype, global shape, sharded?) and what rank 0 holds.
#[derive(Clone)]
struct Setup {
    full: Vec<(&'static str, DType, Vec<usize>)>,
    dests: DestsOf,
    opts: BroadcastOptions,
}

/// Runs the broadcast on `comm`; returns the result and whether every destination is untouched.
fn attempt(s: &Setup, comm: &Comm) -> (Result<(), Error>, bool) {
    let rank = comm.rank();
    let world = comm.world_size();
    let mut full_bufs: Vec<Buf> = s
        .full
        .iter()
        .map(|(_, d, sh)| {
            let n: usize = sh.iter().product();
            // Values that fit every integer dtype: small counts.
            let bytes: Vec<u8> = match d {
                DType::I64 => (0..n)
                    .flat_map(|i| (i as i64 + 250).to_le_bytes())
                    .collect(),
                _ => vec![1u8; n * d.size()],
            };
            Buf::from_bytes(&bytes)
        })
        .collect();
    let full: Vec<(String, fo::TensorView)> = s
        .full
        .iter()
        .zip(full_bufs.iter_mut())
        .map(|((k, d, sh), b)| (k.to_string(), b.view(*d, sh)))
        .collect();
    let mut bufs = vec![];
    let mut metas = vec![];
    for (k, d, shape, sharded) in (s.dests)(rank) {
        let spec = sharded.then(|| {
            ShardSpec::new(
                shape.clone(),
                vec![world],
                rank_to_coord(rank, &[world]),
                vec![Placement::Shard(0)],
            )
            .unwrap()
        });
        let local = spec
            .as_ref()
            .map(|s| s.local_shape())
            .unwrap_or(shape.clone());
        let n: usize = local.iter().product();
        bufs.push(Buf::filled(n * d.size(), SENTINEL));
        metas.push((k, d, local, spec));
    }
    let dests: Vec<BroadcastDest> = bufs
        .iter_mut()
        .zip(metas)
        .map(|(b, (k, d, local, spec))| BroadcastDest {
            key: k.to_string(),
            tensor: b.view(d, &local),
            spec,
        })
        .collect();
    let r =
        unsafe { broadcast_state_dict(comm, (rank == 0).then_some(&full[..]), &dests, &s.opts) }
            .map(|_| ());
    let untouched = bufs
        .iter()
        .all(|b| b.bytes().iter().all(|&x| x == SENTINEL));
    (r, untouched)
}

/// Every rank fails, within `bound`, with the same message; no destination changed.
fn expect_agreed_failure(world: usize, s: Setup, needle: &str) -> String {
    let t0 = Instant::now();
    let out = run_ranks(group(world, 5.0), Duration::from_secs(15), move |c| {
        attempt(&s, &c)
    });
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t0.elapsed()
    );
    let first = out[0].0.as_ref().unwrap_err().to_string();
    for (rank, (r, untouched)) in out.iter().enumerate() {
        let e = r.as_ref().expect_err("every rank must fail").to_string();
        assert_eq!(e, first, "rank {rank} reports a different error");
        assert!(
            *untouched,
            "rank {rank}: a destination was written despite the error"
        );
    }
    assert!(first.contains(needle), "{first}");
    first
}

fn same_everywhere(d: DestList) -> DestsOf {
    Arc::new(move |_| d.clone())
}

#[test]
fn a_key_missing_on_rank_0_fails_every_rank_with_the_same_message() {
    let s = Setup {
        full: vec![("a", DType::F32, vec![8])],
        dests: same_everywhere(vec![
            ("a", DType::F32, vec![8], true),
            ("b", DType::F32, vec![4], false),
        ]),
        opts: Default::default(),
    };
    let e = expect_agreed_failure(4, s, "\"b\"");
    assert!(
        e.starts_with("not found")
            && e.contains("not in rank 0's state dict")
            && e.contains("(on rank 0)"),
        "{e}"
    );
}

#[test]
fn a_shape_mismatch_on_one_rank_fails_every_rank() {
    let s = Setup {
        full: vec![("a", DType::F32, vec![8, 2])],
        dests: Arc::new(|r| {
            vec![(
                "a",
                DType::F32,
                if r == 2 { vec![8, 3] } else { vec![8, 2] },
                true,
            )]
        }),
        opts: Default::default(),
    };
    let e = expect_agreed_failure(4, s, "global shape is [8, 3]");
    assert!(
        e.starts_with("shape mismatch") && e.ends_with("(on rank 2)"),
        "{e}"
    );
}

#[test]
fn float8_to_bf16_and_unopted_int_to_float_fail_every_rank() {
    let s = Setup {
        full: vec![("q", DType::F8E4M3, vec![4])],
        dests: Arc::new(|r| {
            vec![(
                "q",
                if r == 1 { DType::BF16 } else { DType::F8E4M3 },
                vec![4],
                false,
            )]
        }),
        opts: Default::default(),
    };
    expect_agreed_failure(3, s, "float8 values are never converted implicitly");
    let s = Setup {
        full: vec![("step", DType::I64, vec![])],
        dests: same_everywhere(vec![("step", DType::F32, vec![], false)]),
        opts: Default::default(),
    };
    expect_agreed_failure(3, s, "allow_int_float_cast");
}

#[test]
fn ranks_that_disagree_on_keys_or_sharding_fail_together() {
    let s = Setup {
        full: vec![("a", DType::F32, vec![8]), ("b", DType::F32, vec![8])],
        dests: Arc::new(|r| {
            let mut v = vec![("a", DType::F32, vec![8], true)];
            if r != 1 {
                v.push(("b", DType::F32, vec![8], true));
            }
            v
        }),
        opts: Default::default(),
    };
    expect_agreed_failure(4, s, "key \"b\": ranks disagree");
    let s = Setup {
        full: vec![("a", DType::F32, vec![8])],
        dests: Arc::new(|r| vec![("a", DType::F32, vec![8], r != 3)]),
        opts: Default::default(),
    };
    expect_agreed_failure(4, s, "key \"a\": ranks disagree");
}

#[test]
fn a_cast_failing_on_one_rank_leaves_every_rank_untouched() {
    // 250.. as I64: fits I64 everywhere, not U8 on rank 2 (values 250..257).
    let s = Setup {
        full: vec![("a", DType::F32, vec![8]), ("step", DType::I64, vec![8])],
        dests: Arc::new(|r| {
            vec![
                ("a", DType::F32, vec![8], true),
                (
                    "step",
                    if r == 2 { DType::U8 } else { DType::I64 },
                    vec![8],
                    false,
                ),
            ]
        }),
        opts: BroadcastOptions {
            allow_int_float_cast: true,
            ..Default::default()
        },
    };
    let e = expect_agreed_failure(4, s, "does not fit U8");
    assert!(
        e.starts_with("numerics error") && e.contains("key \"step\""),
        "{e}"
    );
}

#[test]
fn a_duplicate_key_in_rank_0s_dict_fails_every_rank() {
    let s = Setup {
        full: vec![("a", DType::F32, vec![2]), ("a", DType::F32, vec![2])],
        dests: same_everywhere(vec![("a", DType::F32, vec![2], false)]),
        opts: Default::default(),
    };
    expect_agreed_failure(2, s, "appears twice");
}

// ---- a callback communicator whose transport is an in-process group -------------------

struct Transport {
    comm: Comm,
    /// Fail the n-th broadcast call (0-based) with this code.
    fail_broadcast: Option<(usize, i32)>,
    broadcasts: usize,
}

unsafe fn t<'a>(user: *mut c_void) -> &'a mut Transport {
    &mut *(user as *mut Transport)
}

unsafe extern "C" fn cb_broadcast(user: *mut c_void, buf: *mut c_void, n: usize, root: i32) -> i32 {
    let tr = t(user);
    let call = tr.broadcasts;
    tr.broadcasts += 1;
    if let Some((at, code)) = tr.fail_broadcast {
        if at == call {
            return code;
        }
    }
    let b = if n == 0 {
        &mut [][..]
    } else {
        std::slice::from_raw_parts_mut(buf as *mut u8, n)
    };
    tr.comm.broadcast(b, root as usize).map_or(1, |_| 0)
}

unsafe extern "C" fn cb_all_reduce(user: *mut c_void, v: *mut f64, n: usize, op: i32) -> i32 {
    let vals = if n == 0 {
        &mut [][..]
    } else {
        std::slice::from_raw_parts_mut(v, n)
    };
    let op = if op == 0 {
        ReduceOp::Sum
    } else {
        ReduceOp::Max
    };
    t(user).comm.all_reduce_f64(vals, op).map_or(1, |_| 0)
}

unsafe extern "C" fn cb_barrier(user: *mut c_void) -> i32 {
    t(user).comm.barrier().map_or(1, |_| 0)
}

fn callback_comm(tr: &mut Transport) -> Comm {
    let (rank, world) = (tr.comm.rank(), tr.comm.world_size());
    let cb = Callbacks {
        user: tr as *mut Transport as *mut c_void,
        broadcast: cb_broadcast,
        all_reduce_f64: cb_all_reduce,
        barrier: cb_barrier,
        scatter: None,
    };
    Comm::from_callbacks(rank, world, cb).unwrap()
}

#[test]
fn a_callback_failing_on_one_rank_fails_every_rank_in_bounded_time() {
    let s = Setup {
        full: vec![("a", DType::F32, vec![16]), ("b", DType::BF16, vec![3, 2])],
        dests: same_everywhere(vec![
            ("a", DType::F32, vec![16], true),
            ("b", DType::BF16, vec![3, 2], false),
        ]),
        opts: Default::default(),
    };
    // Broadcasts 0 and 1 carry the table, 2 and 3 the data ("a" whole, as there is no
    // scatter callback, then "b"): the failing rank stops at each point of the protocol.
    for fail_at in [0usize, 1, 2, 3] {
        let s = s.clone();
        let t0 = Instant::now();
        let out = run_ranks(group(4, 5.0), Duration::from_secs(15), move |comm| {
            let failing = comm.rank() == 2;
            let mut tr = Transport {
                comm,
                fail_broadcast: failing.then_some((fail_at, 42)),
                broadcasts: 0,
            };
            let cc = callback_comm(&mut tr);
            let r = attempt(&s, &cc);
            drop(cc);
            drop(tr); // leaving the group releases the ranks still waiting for this one
            r
        });
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "took {:?}",
            t0.elapsed()
        );
        for (rank, (r, untouched)) in out.iter().enumerate() {
            let e = r.as_ref().expect_err("every rank must fail").to_string();
            assert!(e.starts_with("communication error"), "rank {rank}: {e}");
            if rank == 2 {
                assert_eq!(
                    e,
                    "communication error: broadcast callback returned 42 on rank 2"
                );
            }
            assert!(*untouched, "rank {rank}: destination written");
        }
    }
}

#[test]
fn callbacks_without_scatter_still_deliver_exact_shards() {
    let out = run_ranks(group(3, 5.0), Duration::from_secs(15), |comm| {
        let rank = comm.rank();
        let mut tr = Transport {
            comm,
            fail_broadcast: None,
            broadcasts: 0,
        };
        let cc = callback_comm(&mut tr);
        let mut src = Buf::from_bytes(
            &(0..7u32)
                .flat_map(|x| (x as f32).to_le_bytes())
                .collect::<Vec<_>>(),
        );
        let full = [("w".to_string(), src.view(DType::F32, &[7]))];
        let spec = ShardSpec::new(vec![7], vec![3], vec![rank], vec![Placement::Shard(0)]).unwrap();
        let n = spec.local_numel();
        let mut dst = Buf::filled(n * 2, 0);
        let d = vec![BroadcastDest {
            key: "w".into(),
            tensor: dst.view(DType::BF16, &[n]),
            spec: Some(spec),
        }];
        let st = unsafe {
            broadcast_state_dict(
                &cc,
                (rank == 0).then_some(&full[..]),
                &d,
                &Default::default(),
            )
        }
        .unwrap();
        let vals: Vec<f32> = dst
            .bytes()
            .chunks(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        (st.bytes_received, vals)
    });
    assert_eq!(out[0].1, vec![0., 1., 2.]);
    assert_eq!(out[2].1, vec![6.]);
    // Without a scatter callback the whole tensor travels: 7 f32.
    assert!(out.iter().all(|(b, _)| *b == 28));
}
