//! The in-process group: ranks are threads that meet in shared memory. Every collective
//! is one all-gather round (each rank deposits a payload, all read all payloads), which
//! keeps the protocol small enough to be obviously right. A round that waits longer than
//! the timeout, or a handle that is dropped, poisons the group: every rank then fails
//! with the reason instead of hanging.
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Backend, Comm, ReduceOp};
use crate::error::{Error, Result};

#[derive(Debug, Clone)]
pub struct LocalGroupOptions {
    /// How long a rank waits for the others in one collective before the group fails.
    pub timeout: Duration,
}

impl Default for LocalGroupOptions {
    fn default() -> Self {
        LocalGroupOptions {
            timeout: Duration::from_secs(600),
        }
    }
}

/// The most ranks an in-process group may have: each rank is a host thread.
pub const MAX_LOCAL_WORLD: usize = 1024;
/// The longest collective timeout accepted, in seconds (one week): longer is a hang.
pub const MAX_TIMEOUT_S: f64 = 604_800.0;

impl LocalGroupOptions {
    /// A timeout from a caller's seconds: finite, > 0 and at most `MAX_TIMEOUT_S`, so no
    /// value (NaN, inf, negative) turns a collective into a wait without end.
    pub fn with_timeout_s(timeout_s: f64) -> Result<LocalGroupOptions> {
        if !(timeout_s.is_finite() && timeout_s > 0.0 && timeout_s <= MAX_TIMEOUT_S) {
            return Err(Error::invalid(
                "timeout_s",
                format!("{timeout_s} is not a finite number of seconds in (0, {MAX_TIMEOUT_S}]"),
            ));
        }
        Ok(LocalGroupOptions {
            timeout: Duration::from_secs_f64(timeout_s),
        })
    }
}

/// `world_size` checked against `1..=MAX_LOCAL_WORLD` before anything is allocated.
pub(super) fn check_world(world_size: usize) -> Result<()> {
    if world_size == 0 || world_size > MAX_LOCAL_WORLD {
        return Err(Error::invalid(
            "world_size",
            format!("{world_size} ranks: an in-process group has 1..={MAX_LOCAL_WORLD}"),
        ));
    }
    Ok(())
}

struct Deposit {
    op: &'static str,
    data: Vec<u8>,
    /// A scatter root's parts, handed over without a copy.
    parts: Vec<Vec<u8>>,
}

struct State {
    /// Rounds completed so far.
    round: u64,
    slots: Vec<Option<Deposit>>,
    arrived: usize,
    /// The last completed round's deposits, in rank order.
    result: Arc<Vec<Deposit>>,
    poisoned: Option<String>,
}

struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

pub(super) fn group(world_size: usize, opts: LocalGroupOptions) -> Vec<Comm> {
    let shared = Arc::new(Shared {
        world: world_size,
        timeout: opts.timeout,
        state: Mutex::new(State {
            round: 0,
            slots: (0..world_size).map(|_| None).collect(),
            arrived: 0,
            result: Arc::new(Vec::new()),
            poisoned: None,
        }),
        cv: Condvar::new(),
    });
    (0..world_size)
        .map(|rank| {
            Comm::from_backend(
                rank,
                world_size,
                Box::new(Local {
                    rank,
                    shared: shared.clone(),
                }),
            )
            .expect("rank < world_size")
        })
        .collect()
}

struct Local {
    rank: usize,
    shared: Arc<Shared>,
}

impl Local {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock leaves valid state: recover it.
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One round: deposit `data`, wait for all ranks, return everyone's deposits.
    fn exchange(&self, op: &'static str, data: Vec<u8>) -> Result<Arc<Vec<Deposit>>> {
        self.exchange_parts(op, data, Vec::new())
    }

    fn exchange_parts(
        &self,
        op: &'static str,
        data: Vec<u8>,
        parts: Vec<Vec<u8>>,
    ) -> Result<Arc<Vec<Deposit>>> {
        let sh = &self.shared;
        let mut st = self.lock();
        if let Some(why) = &st.poisoned {
            return Err(Error::Comm(format!("{op} on rank {}: {why}", self.rank)));
        }
        let my_round = st.round;
        st.slots[self.rank] = Some(Deposit { op, data, parts });
        st.arrived += 1;
        if st.arrived == sh.world {
            let deposits: Vec<Deposit> = st.slots.iter_mut().map(|s| s.take().unwrap()).collect();
            st.result = Arc::new(deposits);
            st.arrived = 0;
            st.round += 1;
            sh.cv.notify_all();
        } else {
            let deadline = Instant::now() + sh.timeout;
            while st.round == my_round {
                if let Some(why) = &st.poisoned {
                    return Err(Error::Comm(format!("{op} on rank {}: {why}", self.rank)));
                }
                let now = Instant::now();
                if now >= deadline {
                    let missing: Vec<usize> =
                        (0..sh.world).filter(|&r| st.slots[r].is_none()).collect();
                    let why = format!(
                        "timed out after {:.1?} on rank {} waiting for ranks {missing:?} of {}",
                        sh.timeout, self.rank, sh.world
                    );
                    st.poisoned = Some(why.clone());
                    sh.cv.notify_all();
                    return Err(Error::Comm(format!("{op}: {why}")));
                }
                st = sh
                    .cv
                    .wait_timeout(st, deadline - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        let result = st.result.clone();
        drop(st);
        if let Some(other) = result.iter().position(|d| d.op != op) {
            return Err(Error::Comm(format!(
                "collective mismatch: rank {} called {op} while rank {other} called {}",
                self.rank, result[other].op
            )));
        }
        Ok(result)
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        let mut st = self.lock();
        if st.poisoned.is_none() {
            st.poisoned = Some(format!(
                "rank {} left the group (its handle was dropped)",
                self.rank
            ));
        }
        self.shared.cv.notify_all();
    }
}

impl Backend for Local {
    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<()> {
        let mine = if self.rank == root {
            buf.to_vec()
        } else {
            Vec::new()
        };
        let all = self.exchange("broadcast", mine)?;
        let src = &all[root].data;
        if src.len() != buf.len() {
            return Err(Error::Comm(format!(
                "broadcast: rank {} expects {} bytes, root {root} sent {}",
                self.rank,
                buf.len(),
                src.len()
            )));
        }
        if self.rank != root {
            buf.copy_from_slice(src);
        }
        Ok(())
    }

    fn all_reduce_f64(&self, vals: &mut [f64], op: ReduceOp) -> Result<()> {
        let mut mine: Vec<u8> = Vec::with_capacity(vals.len() * 8 + 1);
        mine.push(op.code() as u8);
        mine.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
        let all = self.exchange("all_reduce_f64", mine)?;
        for (r, d) in all.iter().enumerate() {
            if d.data.len() != vals.len() * 8 + 1 || d.data[0] != op.code() as u8 {
                return Err(Error::Comm(format!(
                    "all_reduce_f64: rank {r} reduced {} values with op {}, rank {} {} values with op {}",
                    (d.data.len().max(1) - 1) / 8,
                    d.data.first().copied().unwrap_or(0),
                    self.rank,
                    vals.len(),
                    op.code()
                )));
            }
        }
        // Every rank reduces in rank order, so all get bit-identical results.
        for (i, v) in vals.iter_mut().enumerate() {
            let at = |r: usize| {
                f64::from_le_bytes(all[r].data[1 + i * 8..9 + i * 8].try_into().unwrap())
            };
            *v = (1..all.len()).fold(at(0), |acc, r| op.combine(acc, at(r)));
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.exchange("barrier", Vec::new()).map(|_| ())
    }

    fn supports_scatter(&self) -> bool {
        true
    }

    fn scatter(&self, parts: Option<Vec<Vec<u8>>>, recv: &mut [u8], root: usize) -> Result<()> {
        let mine = parts.filter(|_| self.rank == root).unwrap_or_default();
        let all = self.exchange_parts("scatter", Vec::new(), mine)?;
        let Some(part) = all[root].parts.get(self.rank) else {
            return Err(Error::Comm(format!(
                "scatter: root {root} sent no part to rank {}",
                self.rank
            )));
        };
        if part.len() != recv.len() {
            return Err(Error::Comm(format!(
                "scatter: rank {} expects {} bytes, root {root} sent it {}",
                self.rank,
                recv.len(),
                part.len()
            )));
        }
        recv.copy_from_slice(part);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    fn short() -> LocalGroupOptions {
        LocalGroupOptions {
            timeout: Duration::from_millis(500),
        }
    }

    #[test]
    fn broadcast_all_reduce_and_scatter_agree_on_every_rank() {
        let handles: Vec<_> = Comm::local_group_with(3, short())
            .into_iter()
            .map(|c| {
                thread::spawn(move || {
                    let r = c.rank();
                    let mut b = if r == 1 { vec![7u8, 8, 9] } else { vec![0; 3] };
                    c.broadcast(&mut b, 1).unwrap();
                    let mut v = [r as f64, -(r as f64)];
                    c.all_reduce_f64(&mut v, ReduceOp::Sum).unwrap();
                    let mut m = [r as f64, if r == 2 { f64::NAN } else { 0.0 }];
                    c.all_reduce_f64(&mut m, ReduceOp::Max).unwrap();
                    let parts: Vec<Vec<u8>> = (0..3).map(|i| vec![i as u8; i]).collect();
                    let mut recv = vec![0u8; r];
                    c.scatter((r == 0).then_some(parts), &mut recv, 0).unwrap();
                    c.barrier().unwrap();
                    (b, v, m, recv)
                })
            })
            .collect();
        for (r, h) in handles.into_iter().enumerate() {
            let (b, v, m, recv) = h.join().unwrap();
            assert_eq!(b, vec![7, 8, 9]);
            assert_eq!(v, [3.0, -3.0]);
            assert_eq!(m[0], 2.0);
            assert!(m[1].is_nan(), "max must propagate NaN");
            assert_eq!(recv, vec![r as u8; r]);
        }
    }

    #[test]
    fn f32_sums_accumulate_in_f64_and_agree_across_ranks() {
        let handles: Vec<_> = Comm::local_group_with(4, short())
            .into_iter()
            .map(|c| {
                thread::spawn(move || {
                    // 1 + 3 * 2^-24 rounds to 1 + 2^-22 only when accumulated wider than f32.
                    let mut v = vec![
                        if c.rank() == 0 {
                            1.0f32
                        } else {
                            2f32.powi(-24)
                        },
                        c.rank() as f32,
                    ];
                    c.all_reduce_f32_sum(&mut v).unwrap();
                    c.all_reduce_f32_sum(&mut []).unwrap();
                    v
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), vec![1.0 + 2f32.powi(-22), 6.0]);
        }
    }

    #[test]
    fn a_missing_rank_times_out_every_waiting_rank() {
        let mut comms = Comm::local_group_with(3, short());
        let absent = comms.pop().unwrap();
        let t0 = Instant::now();
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| thread::spawn(move || c.barrier()))
            .collect();
        for h in handles {
            let e = h.join().unwrap().unwrap_err().to_string();
            assert!(e.contains("timed out") && e.contains("[2]"), "{e}");
        }
        assert!(t0.elapsed() < Duration::from_secs(3));
        drop(absent);
    }

    #[test]
    fn a_dropped_handle_fails_the_others_at_once() {
        let mut comms = Comm::local_group_with(
            2,
            LocalGroupOptions {
                timeout: Duration::from_secs(30),
            },
        );
        let gone = comms.pop().unwrap();
        let c = comms.pop().unwrap();
        let h = thread::spawn(move || c.all_reduce_f64(&mut [1.0], ReduceOp::Sum));
        thread::sleep(Duration::from_millis(50));
        let t0 = Instant::now();
        drop(gone);
        let e = h.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("rank 1 left the group"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn mismatched_collectives_are_reported_not_misread() {
        let comms = Comm::local_group_with(2, short());
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                thread::spawn(move || {
                    if c.rank() == 0 {
                        c.barrier()
                    } else {
                        c.all_reduce_f64(&mut [1.0], ReduceOp::Sum)
                    }
                })
            })
            .collect();
        for h in handles {
            let e = h.join().unwrap().unwrap_err().to_string();
            assert!(e.contains("collective mismatch"), "{e}");
        }
    }
}
