//! The copy-on-write snapshot behind an async save (`async_save.rs`).
//!
//! At the call, every parameter whose state the save writes is *pending*: its entries
//! (the tensors a synchronous save fetches, same keys, dtypes and order) will be read by
//! the background writer from the optimizer's live state, unless something is about to
//! change that state first. Every mutation of a parameter's state or memory (the step,
//! `set_states`, a load, `write_param`) calls `Optimizer::before_write(i)`, which lands
//! in [`Snapshot::before_write`]: if parameter `i` still has entries the writer has not
//! taken, they are copied (as the writer would have fetched them) into a staging pool
//! first; when the pool is over its budget the mutator waits until the writer has taken
//! enough (or has read `i` itself). The writer takes a staged copy when there is one and
//! reads the live state otherwise, so the file holds the state as of the call.
//!
//! Granularity: one parameter's pending entries are copied together (the unit a step
//! writes). A parameter is read by the writer while its slot is `Reading`, and every
//! mutator of that parameter waits meanwhile; a mutator copying it holds it `Copying`.
//! The live state is reached through a pointer taken at the call: the optimizer refuses
//! `add_param` while a save reads it (its parameter table must not move), and replaces
//! a parameter's state only after `before_write`.
use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};

use super::optim::Source;
use crate::error::{Error, Result};
use crate::optim::staging::StagedParam;
use crate::optim::state::ParamState;
use crate::optim::Optimizer;
use crate::tensor::Tensor;

/// The staging pool's budget when the caller gives none (0): 256 MiB. Correctness never
/// depends on it: a mutation that does not fit waits for the writer instead.
pub const DEFAULT_STAGING_BUDGET: usize = 256 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// Not written by this save, or everything it needs is written or staged.
    Free,
    /// Entries left that only the live state holds.
    Pending,
    /// The writer is reading the live state.
    Reading,
    /// A mutator is copying the live state into the pool.
    Copying,
}

/// Counters an async save reports (`fo_save_stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SnapshotStats {
    /// Bytes of state the writer has taken so far (entries as fetched: header excluded).
    pub bytes_written: u64,
    /// Bytes of state the save writes in all.
    pub bytes_total: u64,
    /// The largest the staging pool has been (bytes copied and not yet written).
    pub staging_high_water: u64,
    /// The pool's budget.
    pub staging_budget: u64,
    /// Bytes of device-resident state staged to the host at the call (not in the pool).
    pub device_staged: u64,
    /// How many parameters were copied into the pool before a mutation.
    pub copies: u64,
}

struct Inner {
    slots: Vec<Slot>,
    /// Entry -> its staged copy and the pool bytes it holds (0: staged at the call).
    staged: HashMap<usize, (Tensor, usize)>,
    /// Entry -> how many more times the writer fetches it.
    runs_left: Vec<usize>,
    used: usize,
    /// The writer no longer reads the optimizer: mutations go ahead freely.
    released: bool,
    /// Tests hold the writer before its next fetch (`AsyncSave::hold_writer`).
    held: bool,
    stats: SnapshotStats,
}

/// One save's snapshot, shared by the optimizer (its mutators) and the writer thread.
pub struct Snapshot {
    inner: Mutex<Inner>,
    cv: Condvar,
    budget: usize,
    /// Entry -> (parameter, source, bytes).
    entries: Vec<(usize, Source, usize)>,
    /// Parameter -> its entries.
    by_param: HashMap<usize, Vec<usize>>,
}

fn entry_bytes(t: &Tensor) -> usize {
    t.data.len()
}

/// Entry `e` of parameter `sp.i` as a synchronous save fetches it (`optim::Fetcher`).
pub(super) fn fetch_entry(
    opt: &Optimizer,
    sp: &mut StagedParam<'_>,
    src: &Source,
) -> Result<Tensor> {
    match src {
        Source::State { key, dtype, .. } => opt.get_state_as_staged(sp, key, *dtype),
        Source::Param(_) => match sp.param.take() {
            Some(t) => Ok(t),
            None => opt.param_tensor(sp.i),
        },
    }
}

impl Snapshot {
    /// A snapshot of `srcs` (entry -> source, as planned), whose entries the writer
    /// fetches `runs[e]` times, with entry sizes `bytes`.
    pub(super) fn new(
        num_params: usize,
        srcs: Vec<Source>,
        runs: Vec<usize>,
        bytes: Vec<usize>,
        budget: usize,
    ) -> Snapshot {
        let mut slots = vec![Slot::Free; num_params];
        let mut by_param: HashMap<usize, Vec<usize>> = HashMap::new();
        let mut entries = Vec::with_capacity(srcs.len());
        for (e, (src, b)) in srcs.into_iter().zip(bytes).enumerate() {
            let i = match &src {
                Source::State { i, .. } | Source::Param(i) => *i,
            };
            if runs[e] > 0 {
                slots[i] = Slot::Pending;
                by_param.entry(i).or_default().push(e);
            }
            entries.push((i, src, b));
        }
        let total = entries
            .iter()
            .zip(&runs)
            .map(|((_, _, b), &r)| (b * r) as u64)
            .sum();
        let budget = if budget == 0 {
            DEFAULT_STAGING_BUDGET
        } else {
            budget
        };
        Snapshot {
            inner: Mutex::new(Inner {
                slots,
                staged: HashMap::new(),
                runs_left: runs,
                used: 0,
                released: false,
                held: false,
                stats: SnapshotStats {
                    bytes_total: total,
                    staging_budget: budget as u64,
                    ..Default::default()
                },
            }),
            cv: Condvar::new(),
            budget,
            entries,
            by_param,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves counters only; keep going.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, g: MutexGuard<'a, Inner>) -> MutexGuard<'a, Inner> {
        self.cv.wait(g).unwrap_or_else(|e| e.into_inner())
    }

    /// Entries of `i` the writer still needs that only the live state holds.
    fn pending_of(&self, g: &Inner, i: usize) -> Vec<usize> {
        self.by_param.get(&i).map_or(vec![], |es| {
            es.iter()
                .copied()
                .filter(|e| g.runs_left[*e] > 0 && !g.staged.contains_key(e))
                .collect()
        })
    }

    /// Copies parameter `i`'s pending entries now, outside the pool (device state at the
    /// call: the step's kernels would change it where the writer cannot see).
    pub(super) fn stage_now(&self, opt: &Optimizer, i: usize) -> Result<()> {
        let es = self.pending_of(&self.lock(), i);
        let mut sp = opt.stage(i)?;
        let mut copies = Vec::with_capacity(es.len());
        for e in es {
            copies.push((e, fetch_entry(opt, &mut sp, &self.entries[e].1)?));
        }
        let mut g = self.lock();
        for (e, t) in copies {
            g.stats.device_staged += entry_bytes(&t) as u64;
            g.staged.insert(e, (t, 0));
        }
        g.slots[i] = Slot::Free;
        Ok(())
    }

    /// Called before anything changes parameter `i`'s state or memory: copies what the
    /// writer still needs of it into the pool, or waits (see the module doc).
    pub(crate) fn before_write(&self, opt: &Optimizer, i: usize) -> Result<()> {
        let mut g = self.lock();
        let es = loop {
            if g.released || i >= g.slots.len() {
                return Ok(());
            }
            match g.slots[i] {
                Slot::Free => return Ok(()),
                Slot::Reading | Slot::Copying => g = self.wait(g),
                Slot::Pending => {
                    let es = self.pending_of(&g, i);
                    let need: usize = es.iter().map(|&e| self.entries[e].2).sum();
                    // An empty pool always takes one parameter's copy only if it fits;
                    // otherwise the writer reads it live (it gets there in order).
                    if g.used + need <= self.budget {
                        g.used += need;
                        g.stats.staging_high_water = g.stats.staging_high_water.max(g.used as u64);
                        g.slots[i] = Slot::Copying;
                        break es;
                    }
                    g = self.wait(g);
                }
            }
        };
        drop(g);
        let copied = (|| {
            let mut sp = opt.stage(i)?;
            es.iter()
                .map(|&e| Ok((e, fetch_entry(opt, &mut sp, &self.entries[e].1)?)))
                .collect::<Result<Vec<_>>>()
        })();
        let mut g = self.lock();
        match copied {
            Ok(ts) => {
                for (e, t) in ts {
                    let b = self.entries[e].2;
                    if entry_bytes(&t) != b {
                        // The pool's accounting is by plan; a mismatch is a bug, and the
                        // writer's shape check would refuse the tensor anyway.
                        g.used -= b;
                        g.slots[i] = Slot::Pending;
                        self.cv.notify_all();
                        return Err(Error::Internal(format!(
                            "async save: entry {e} copied as {} bytes, planned {b}",
                            entry_bytes(&t)
                        )));
                    }
                    g.staged.insert(e, (t, b));
                }
                g.slots[i] = Slot::Free;
                g.stats.copies += 1;
                self.cv.notify_all();
                Ok(())
            }
            Err(err) => {
                g.used -= es.iter().map(|&e| self.entries[e].2).sum::<usize>();
                g.slots[i] = Slot::Pending;
                self.cv.notify_all();
                Err(err)
            }
        }
    }

    /// The writer's fetch of entry `e`: the staged copy, else the live state read through
    /// `read` while the parameter is held `Reading`.
    pub(super) fn take(
        &self,
        e: usize,
        read: &mut dyn FnMut(usize, &Source) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let (i, src, b) = &self.entries[e];
        let mut g = self.lock();
        while g.held {
            g = self.wait(g);
        }
        g.stats.bytes_written += *b as u64;
        loop {
            if g.runs_left[e] == 0 {
                return Err(Error::Internal(format!(
                    "async save: entry {e} fetched more often than planned"
                )));
            }
            if g.staged.contains_key(&e) {
                g.runs_left[e] -= 1;
                let t = if g.runs_left[e] == 0 {
                    let (t, held) = g.staged.remove(&e).expect("checked above");
                    g.used -= held;
                    self.cv.notify_all();
                    t
                } else {
                    g.staged[&e].0.clone()
                };
                return Ok(t);
            }
            match g.slots[*i] {
                Slot::Copying => g = self.wait(g),
                Slot::Pending => break,
                s => {
                    return Err(Error::Internal(format!(
                        "async save: entry {e} is neither staged nor pending ({s:?})"
                    )))
                }
            }
        }
        g.slots[*i] = Slot::Reading;
        drop(g);
        let t = read(*i, src);
        let mut g = self.lock();
        g.runs_left[e] -= 1;
        g.slots[*i] = if self.pending_of(&g, *i).is_empty() {
            Slot::Free
        } else {
            Slot::Pending
        };
        self.cv.notify_all();
        t
    }

    /// The writer is done with the optimizer (finished, or failed): mutators go ahead,
    /// and the pool is emptied.
    pub(super) fn release(&self) {
        let mut g = self.lock();
        g.released = true;
        g.staged.clear();
        g.used = 0;
        self.cv.notify_all();
    }

    /// Holds (or lets go of) the writer before its next fetch: for tests that need a
    /// save to stay in flight.
    pub(super) fn hold(&self, on: bool) {
        self.lock().held = on;
        self.cv.notify_all();
    }

    /// Whether the writer still reads the optimizer.
    pub fn is_reading(&self) -> bool {
        !self.lock().released
    }

    /// Blocks until the writer no longer reads the optimizer (its drop waits here).
    pub fn wait_released(&self) {
        let mut g = self.lock();
        while !g.released {
            g = self.wait(g);
        }
    }

    pub fn stats(&self) -> SnapshotStats {
        self.lock().stats
    }
}

/// What the writer thread reads the live state through: a detached copy of the
/// optimizer's tables (groups, parameter views; no state) and a pointer to each planned
/// parameter's live state, taken at the call.
pub(super) struct LiveReader {
    pub(super) view: Optimizer,
    pub(super) live: Vec<Option<*const ParamState>>,
}

// SAFETY: the pointers are dereferenced only by the writer, for a parameter held
// `Reading` in the snapshot, during which every mutator of that parameter waits (see the
// module doc); the view holds parameter views of caller memory under the same rule.
unsafe impl Send for LiveReader {}

impl LiveReader {
    pub(super) fn new(opt: &Optimizer) -> LiveReader {
        LiveReader {
            view: opt.detached_view(),
            live: (0..opt.num_params())
                .map(|i| opt.params[i].state.as_ref().map(|s| s as *const ParamState))
                .collect(),
        }
    }

    /// Entry `src` of parameter `i`, read from the live state.
    ///
    /// # Safety
    /// Parameter `i` must be held `Reading` by the snapshot.
    pub(super) unsafe fn read(&self, i: usize, src: &Source) -> Result<Tensor> {
        let state = self.live[i].map(|p| std::borrow::Cow::Borrowed(&*p));
        let mut sp = StagedParam {
            i,
            state,
            param: None,
        };
        fetch_entry(&self.view, &mut sp, src)
    }
}
