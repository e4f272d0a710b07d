//! The copy-on-write snapshot behind an async save (`async_save.rs`).
//!
//! At the call, every parameter whose state the save writes is *pending*: its entries
//! (the tensors a synchronous save fetches, same keys, dtypes and order) will be read by
//! the background writer from the optimizer's live state, unless something is about to
//! change that state first. Every mutation of a parameter's state or memory (the step,
//! `set_states`, a load, `write_param`) calls `Optimizer::before_write(i)`, which lands
//! in `Snapshot::before_write`: if parameter `i` still has entries the writer has not
//! taken, the parameter is copied into a staging pool first (its stored state cloned,
//! plus its elements when an entry reads them: a memcpy on the mutator's path; the
//! writer encodes the entries from the copy exactly as from the live state); when the
//! pool is over its budget the mutator waits until the writer has freed enough (or has
//! read `i` itself). The writer takes a staged copy when there is one and
//! reads the live state otherwise, so the file holds the state as of the call. While a
//! step runs (`Optimizer::mark_step`) the writer pauses before its next fetch, unless a
//! mutator waits for it or a step has ended since its last fetch: the step keeps the
//! cores and the memory bus, the save ends later, and steps back to back never starve it.
//!
//! Granularity: one parameter's state is copied at once (the unit a step writes). A
//! parameter is read by the writer while its slot is `Reading`, and every mutator of that
//! parameter waits meanwhile; a mutator copying it holds it `Copying`. The live state is
//! reached through shallow copies taken at the call (`LiveReader` in `live_reader.rs`,
//! whose doc states the aliasing invariant that makes the writer's reads sound): the
//! writer reads a parameter's heap buffers only while it holds it `Reading`, and no
//! mutator creates a `&mut` over them before `before_write` has returned.
#[path = "stage_copy.rs"]
pub(super) mod stage_copy;
use stage_copy::{copy_state, Recycled};
pub use stage_copy::{default_staging_budget, FALLBACK_STAGING_BUDGET};

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::optim::Source;
use crate::error::{Error, Result};
use crate::optim::math::state::ParamState;
use crate::optim::placement::staging::StagedParam;
use crate::optim::Optimizer;
use crate::tensor::Tensor;

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
    /// Parameter -> its copy and the pool bytes it holds (0: staged at the call).
    staged: HashMap<usize, (Arc<Copy>, usize)>,
    /// Entry -> how many more times the writer fetches it.
    runs_left: Vec<usize>,
    used: usize,
    /// The writer no longer reads the optimizer: mutations go ahead freely.
    released: bool,
    /// Tests hold the writer before its next fetch (`AsyncSave::hold_writer`).
    held: bool,
    /// Steps running (`StepMark`): the writer pauses before its next fetch so the step
    /// has the cores and the memory bus to itself, unless a mutator waits for the writer.
    steps: usize,
    /// Steps ended so far, and the count at the writer's last fetch: after each step's
    /// end the writer fetches at least once, so steps back to back never starve it.
    steps_ended: u64,
    writer_epoch: u64,
    /// Mutators waiting for the writer (room in the pool, a parameter it reads).
    waiting: usize,
    stats: SnapshotStats,
}

/// A parameter as the save needs it, copied before a mutation: its state as stored (a
/// plain clone: the step's critical path pays a memcpy, not the entries' encoding) and
/// its elements when an entry reads them (params saved as stored or as masters).
struct Copy {
    state: Option<ParamState>,
    param: Option<Tensor>,
}

impl Copy {
    fn nbytes(&self) -> usize {
        self.state.as_ref().map_or(0, ParamState::nbytes)
            + self.param.as_ref().map_or(0, |t| t.data.len())
    }
}

/// One save's snapshot, shared by the optimizer (its mutators) and the writer thread.
pub(crate) struct Snapshot {
    inner: Mutex<Inner>,
    /// Buffers of copies the writer is done with, for later copies (`stage_copy`); kept
    /// bytes plus `Inner::used` stay within the budget. Locked after `inner`, never
    /// before it.
    recycled: Mutex<Recycled>,
    cv: Condvar,
    budget: usize,
    /// Entry -> (parameter, source, bytes).
    entries: Vec<(usize, Source, usize)>,
    /// Parameter -> its entries.
    by_param: HashMap<usize, Vec<usize>>,
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

/// How the writer computes an entry of parameter `i`: from a copy (its state and
/// elements) or, given None, from the live state.
pub(super) type ReadEntry<'a> =
    dyn FnMut(usize, Option<(&ParamState, Option<Tensor>)>, &Source) -> Result<Tensor> + 'a;

/// Whether an entry reads the parameter's elements (not only its state).
fn reads_param(src: &Source) -> bool {
    matches!(src, Source::Param(_)) || matches!(src, Source::State { key, .. } if key == "master")
}

/// Bytes a copy of parameter `i` holds for its entries `es` (of `entries`): its stored
/// state, plus its elements when an entry reads them.
fn copy_bytes(
    opt: &Optimizer,
    entries: &[(usize, Source, usize)],
    i: usize,
    es: &[usize],
) -> usize {
    let param = if es.iter().any(|&e| reads_param(&entries[e].1)) {
        opt.param(i).nbytes()
    } else {
        0
    };
    opt.state_nbytes(i) + param
}

impl Snapshot {
    /// A snapshot of `opt`'s `srcs` (entry -> source, as planned), whose entries the
    /// writer fetches `runs[e]` times, with entry sizes `bytes`; `budget` 0: the default
    /// (`default_staging_budget`).
    pub(super) fn new(
        opt: &Optimizer,
        srcs: Vec<Source>,
        runs: Vec<usize>,
        bytes: Vec<usize>,
        budget: usize,
        mut recycled: Recycled,
    ) -> Snapshot {
        let mut slots = vec![Slot::Free; opt.num_params()];
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
            // Device state is staged at the call, outside the pool (`stage_now`).
            let full_copy = by_param
                .iter()
                .filter(|(&i, _)| opt.param_device(i).is_host())
                .map(|(&i, es)| copy_bytes(opt, &entries, i, es))
                .fold(0usize, usize::saturating_add);
            default_staging_budget(full_copy, crate::sys::available_memory())
        } else {
            budget
        };
        recycled.trim(budget);
        Snapshot {
            recycled: Mutex::new(recycled),
            inner: Mutex::new(Inner {
                slots,
                staged: HashMap::new(),
                runs_left: runs,
                used: 0,
                released: false,
                held: false,
                steps: 0,
                steps_ended: 0,
                writer_epoch: 0,
                waiting: 0,
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

    /// A mutator's wait on the writer: counted, so a writer paused for a step goes on.
    fn wait_for_writer<'a>(&self, mut g: MutexGuard<'a, Inner>) -> MutexGuard<'a, Inner> {
        g.waiting += 1;
        self.cv.notify_all();
        let mut g = self.wait(g);
        g.waiting -= 1;
        g
    }

    /// Marks a step running until `end_step` (the optimizer's `StepMark` drops): the
    /// writer pauses before its next fetch meanwhile (a step with a save in flight lost up
    /// to a fifth of a synchronous save's time to the writer's copies and checksums on 2
    /// cores), except while a mutator waits for it.
    pub(super) fn begin_step(&self) {
        self.lock().steps += 1;
    }

    /// The step marked by `begin_step` has ended: the writer goes on.
    pub(super) fn end_step(&self) {
        let mut g = self.lock();
        g.steps -= 1;
        g.steps_ended += 1;
        self.cv.notify_all();
    }

    /// Entries of `i` the writer still fetches.
    fn left_of(&self, g: &Inner, i: usize) -> Vec<usize> {
        self.by_param.get(&i).map_or(vec![], |es| {
            es.iter().copied().filter(|e| g.runs_left[*e] > 0).collect()
        })
    }

    /// Copies parameter `i` as its remaining entries `es` need it.
    fn copy(&self, opt: &Optimizer, i: usize, es: &[usize], kit: &mut Recycled) -> Result<Copy> {
        let needs_param = es.iter().any(|&e| reads_param(&self.entries[e].1));
        Ok(Copy {
            // A host parameter's state is borrowed: copied into huge pages (the step's
            // cost); a device one's was just read back into a fresh buffer.
            state: opt.staged_state(i)?.map(|c| match c {
                std::borrow::Cow::Borrowed(st) => copy_state(st, kit),
                std::borrow::Cow::Owned(st) => st,
            }),
            param: if needs_param {
                Some(opt.param_tensor(i)?)
            } else {
                None
            },
        })
    }

    /// Copies parameter `i` now, outside the pool (device state at the call: the step's
    /// kernels would change it where the writer cannot see; host state lent out live
    /// likewise: its borrower writes it without `before_write`).
    pub(super) fn stage_now(&self, opt: &Optimizer, i: usize) -> Result<()> {
        let es = self.left_of(&self.lock(), i);
        if es.is_empty() {
            return Ok(());
        }
        let c = self.copy(opt, i, &es, &mut Recycled::default())?;
        let mut g = self.lock();
        g.stats.device_staged += c.nbytes() as u64;
        g.staged.insert(i, (Arc::new(c), 0));
        g.slots[i] = Slot::Free;
        Ok(())
    }

    /// Called before anything changes parameter `i`'s state or memory: copies what the
    /// writer still needs of it into the pool, or waits (see the module doc).
    pub(crate) fn before_write(&self, opt: &Optimizer, i: usize) -> Result<()> {
        let mut g = self.lock();
        let (es, need, mut kit) = loop {
            if g.released || i >= g.slots.len() {
                return Ok(());
            }
            match g.slots[i] {
                Slot::Free => return Ok(()),
                Slot::Reading | Slot::Copying => g = self.wait_for_writer(g),
                Slot::Pending => {
                    let es = self.left_of(&g, i);
                    let need = copy_bytes(opt, &self.entries, i, &es);
                    // A copy that does not fit waits: the writer frees the pool as it
                    // writes copies, or reads this parameter itself (it gets there in order).
                    if g.used + need <= self.budget {
                        g.used += need;
                        g.stats.staging_high_water = g.stats.staging_high_water.max(g.used as u64);
                        g.slots[i] = Slot::Copying;
                        // The kept buffers this copy reuses; the rest stay within what
                        // the budget leaves.
                        let mut r = self.recycled();
                        let kit = match opt.staged_state(i) {
                            Ok(Some(std::borrow::Cow::Borrowed(st))) => r.kit_for(st),
                            _ => Recycled::default(),
                        };
                        r.trim(self.budget - g.used);
                        break (es, need, kit);
                    }
                    g = self.wait_for_writer(g);
                }
            }
        };
        drop(g);
        let copied = self.copy(opt, i, &es, &mut kit);
        let mut g = self.lock();
        match copied {
            Ok(c) if c.nbytes() <= need => {
                g.used -= need - c.nbytes();
                let room = self.budget - g.used;
                self.recycled().absorb(kit, room);
                let b = c.nbytes();
                g.staged.insert(i, (Arc::new(c), b));
                g.slots[i] = Slot::Free;
                g.stats.copies += 1;
                self.cv.notify_all();
                Ok(())
            }
            other => {
                g.used -= need;
                g.slots[i] = Slot::Pending;
                self.cv.notify_all();
                match other {
                    Err(err) => Err(err),
                    Ok(c) => Err(Error::Internal(format!(
                        "async save: parameter {i} copied as {} bytes, {need} reserved",
                        c.nbytes()
                    ))),
                }
            }
        }
    }

    /// The writer's fetch of entry `e`: from the parameter's copy when there is one, else
    /// from the live state while the parameter is held `Reading`. `read(i, copy, src)`
    /// computes the entry (`copy` None: from the live state).
    pub(super) fn take(&self, e: usize, read: &mut ReadEntry<'_>) -> Result<Tensor> {
        let (i, src, b) = &self.entries[e];
        let mut g = self.lock();
        while g.held || (g.steps > 0 && g.waiting == 0 && g.writer_epoch == g.steps_ended) {
            g = self.wait(g);
        }
        g.writer_epoch = g.steps_ended;
        g.stats.bytes_written += *b as u64;
        if g.runs_left[e] == 0 {
            return Err(Error::Internal(format!(
                "async save: entry {e} fetched more often than planned"
            )));
        }
        loop {
            if let Some((c, _)) = g.staged.get(i) {
                let c = c.clone();
                drop(g);
                let empty = ParamState {
                    step: 0,
                    m: None,
                    v: None,
                    error_bits: None,
                    m_valid: false,
                };
                let t = read(
                    *i,
                    Some((c.state.as_ref().unwrap_or(&empty), c.param.clone())),
                    src,
                );
                drop(c);
                let mut g = self.lock();
                g.runs_left[e] -= 1;
                if self.left_of(&g, *i).is_empty() {
                    if let Some((c, held)) = g.staged.remove(i) {
                        g.used -= held;
                        self.recycle(c, self.budget - g.used);
                    }
                    self.cv.notify_all();
                }
                return t;
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
        let t = read(*i, None, src);
        let mut g = self.lock();
        g.runs_left[e] -= 1;
        g.slots[*i] = if self.left_of(&g, *i).is_empty() {
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
        for (_, (c, _)) in std::mem::take(&mut g.staged) {
            self.recycle(c, self.budget);
        }
        g.used = 0;
        self.cv.notify_all();
    }

    fn recycled(&self) -> MutexGuard<'_, Recycled> {
        self.recycled.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps the buffers of a copy the writer is done with (while within `max` bytes).
    fn recycle(&self, c: Arc<Copy>, max: usize) {
        if let Ok(Copy {
            state: Some(st), ..
        }) = Arc::try_unwrap(c)
        {
            self.recycled().put_state(st, max);
        }
    }

    /// The buffers this save kept, for the next save of the same optimizer (its writer
    /// must be done: `wait_released`).
    pub(super) fn take_recycled(&self) -> Recycled {
        std::mem::take(&mut *self.recycled())
    }

    /// Holds (or lets go of) the writer before its next fetch: for tests that need a
    /// save to stay in flight.
    pub(super) fn hold(&self, on: bool) {
        self.lock().held = on;
        self.cv.notify_all();
    }

    /// Whether the writer still reads the optimizer.
    pub(crate) fn is_reading(&self) -> bool {
        !self.lock().released
    }

    /// Blocks until the writer no longer reads the optimizer (its drop waits here).
    pub(crate) fn wait_released(&self) {
        let mut g = self.lock();
        while !g.released {
            g = self.wait(g);
        }
    }

    pub(crate) fn stats(&self) -> SnapshotStats {
        self.lock().stats
    }
}
