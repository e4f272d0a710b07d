//! Async saves (`fo_state_save_async`): the call plans the save, registers a
//! copy-on-write snapshot of the optimizer's state (`snapshot.rs`) and returns; a
//! background writer streams the state through the synchronous path's writer
//! (`writer::stage_rank_file`, same plan, same fetches), so the files are byte-identical
//! to a synchronous save of the state as of the call. Nothing is visible before the
//! commit, which is the synchronous path's too:
//! - without a communicator, the writer publishes its files and drops its done marker in
//!   the background; the last rank of the save commits it (`commit::finish_rank`);
//! - with one, the ranks agree on the save id at the call (a collective on the caller's
//!   thread), the writer stages in the background, and the commit collective runs in
//!   [`AsyncSave::wait`], on the caller's thread again: the communicator is never used
//!   from the writer thread, so it is never used from two threads at once.
//!
//! Lifecycle: a second async save of the same optimizer, or into the same directory from
//! another optimizer of the process, waits for the first's commit, or is refused (Busy)
//! while the first's communicator commit waits for its `wait` (`in_flight`); the
//! optimizer refuses `add_param` while the writer reads it, and its drop waits for the
//! writer to let go of it; dropping an `AsyncSave` joins its writer. Device-resident
//! state is staged to the host at the call (what the synchronous path reads), outside
//! the pool's budget. Registered parameters are the caller's memory: while a save is in
//! flight the caller must change them only through the step (which copies what the save
//! still needs first).
use std::any::Any;
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::collective::{agree_arguments, agree_save_id, commit_collective};
use super::commit::mark_done;
use super::in_flight::{self, Phase, Registration};
use super::live_reader::LiveReader;
use super::optim::{pack_options, plan_entries, SaveOptions};
use super::snapshot::{Snapshot, SnapshotStats};
use super::writer::{check_dir, finish, publish, resolve_save_id, stage_rank_file};
use crate::comm::{agree, Comm};
use crate::error::{Error, Result};
use crate::optim::{Optimizer, SaveHook};

/// What the writer thread leaves for `wait`.
#[derive(Default)]
struct Outcome {
    done: bool,
    result: Option<Result<()>>,
}

/// An async save in flight (or finished). Dropping it waits for its writer.
pub struct AsyncSave {
    snap: Arc<Snapshot>,
    outcome: Arc<(Mutex<Outcome>, Condvar)>,
    thread: Option<JoinHandle<()>>,
    dir: PathBuf,
    save_id: String,
    world_size: usize,
    /// With a communicator: the commit collective still to run at `wait`.
    commit_pending: bool,
    /// The whole save's outcome once `wait` has seen it (repeated waits return it).
    settled: Option<Result<()>>,
    /// Its entry among the process's saves in flight (`in_flight`).
    registration: Registration,
}

/// How many times `stage_rank_file` fetches each entry (once per run of its chunks).
fn fetch_runs(plan: &super::pack::Plan, num_entries: usize) -> Vec<usize> {
    let mut runs = vec![0; num_entries];
    let mut last = None;
    for c in &plan.chunks {
        if last != Some(c.entry) {
            runs[c.entry] += 1;
        }
        last = Some(c.entry);
    }
    runs
}

/// The optimizer reaches a save in flight through the hook it defines (`optim::SaveHook`),
/// so that it never names the checkpoints above it.
impl SaveHook for Snapshot {
    fn before_write(&self, opt: &Optimizer, i: usize) -> Result<()> {
        Snapshot::before_write(self, opt, i)
    }
    fn is_reading(&self) -> bool {
        Snapshot::is_reading(self)
    }
    fn wait_released(&self) {
        Snapshot::wait_released(self)
    }
    fn begin_step(&self) {
        Snapshot::begin_step(self)
    }
    fn end_step(&self) {
        Snapshot::end_step(self)
    }
    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }
}

/// The snapshot behind an optimizer's save hook (every hook attached is one: `start`).
fn snapshot_of(hook: &Arc<dyn SaveHook>) -> Option<Arc<Snapshot>> {
    hook.clone().as_any().downcast::<Snapshot>().ok()
}

/// Starts saving `opt`'s state of this rank into `dir` in the background and returns
/// once the snapshot is registered. `comm` (its rank and world size must be the
/// options'): the save id is agreed at the call and the commit runs at `wait`, both
/// collectives every rank must enter. `staging_budget`: bytes the copy-on-write pool
/// may hold (0: `snapshot::default_staging_budget`).
pub fn save_async(
    opt: &mut Optimizer,
    dir: &Path,
    o: &SaveOptions,
    comm: Option<&Comm>,
    staging_budget: usize,
) -> Result<AsyncSave> {
    start(comm, Ok((opt, dir, o.clone(), staging_budget)), false)
}

/// `save_async` for callers whose arguments may have failed to convert on this rank (the
/// C ABI): with a communicator the ranks first agree on every rank's local checks, so
/// the first failing rank's error becomes every rank's at once.
pub(crate) fn save_async_checked(
    comm: Option<&Comm>,
    local: Result<(&mut Optimizer, &Path, SaveOptions, usize)>,
) -> Result<AsyncSave> {
    start(comm, local, false)
}

/// Test support: `save_async` with the writer held before its first fetch (let it go
/// with `AsyncSave::hold_writer(false)`), so a test knows the save is in flight.
#[doc(hidden)]
pub fn save_async_held(
    opt: &mut Optimizer,
    dir: &Path,
    o: &SaveOptions,
    comm: Option<&Comm>,
    staging_budget: usize,
) -> Result<AsyncSave> {
    start(comm, Ok((opt, dir, o.clone(), staging_budget)), true)
}

fn start(
    comm: Option<&Comm>,
    local: Result<(&mut Optimizer, &Path, SaveOptions, usize)>,
    held: bool,
) -> Result<AsyncSave> {
    // Every rank's own checks first, then (with a communicator) agreement on them and on
    // the arguments, all before anything waits or writes: a rank's mistake fails every
    // rank at once with that rank's error, never as a collective timeout elsewhere.
    let local = local.and_then(|(opt, dir, o, budget)| {
        check_local(dir, &o, comm)?;
        Ok((opt, dir, o, budget))
    });
    let (opt, dir, o, staging_budget) = match comm {
        Some(c) => agree(c, local)?,
        None => local?,
    };
    let o = &o;
    let save_id = match comm {
        Some(c) => {
            agree_arguments(c, dir, o)?;
            agree_save_id(c, &o.save_id)?
        }
        None => resolve_save_id(&o.save_id, o.world_size)?,
    };
    // No two commits into one directory at once (`in_flight`): waits for earlier saves
    // that commit on their own, refuses (Busy) while one's commit waits for its `wait`.
    let entered = in_flight::enter(
        opt.last_save().and_then(snapshot_of).as_ref(),
        dir,
        &save_id,
        o.rank,
        o.world_size,
        comm.is_some(),
    );
    let registration = match comm {
        Some(c) => agree(c, entered)?,
        None => entered?,
    };
    // The previous save's writer is done (one snapshot at a time); its pool's kept
    // buffers serve this save's copies (`stage_copy`).
    let recycled = match opt.take_save() {
        Some(prev) => {
            prev.wait_released();
            snapshot_of(&prev)
                .map(|s| s.take_recycled())
                .unwrap_or_default()
        }
        None => Default::default(),
    };
    let planned = (|| {
        let (metas, srcs) = plan_entries(opt, o)?;
        let mut popts = pack_options(opt, o);
        popts.save_id = save_id.clone();
        let plan = super::pack::plan(&metas, &popts)?;
        Ok((metas, srcs, popts, plan))
    })();
    // With a communicator every rank must learn that one failed to plan.
    let (metas, srcs, popts, plan) = match comm {
        Some(c) => agree(c, planned)?,
        None => planned?,
    };
    let runs = fetch_runs(&plan, metas.len());
    let bytes = metas
        .iter()
        .map(|m| m.local_shape.iter().product::<usize>() * m.dtype.size())
        .collect();
    let at_call: Vec<usize> = {
        let mut seen = HashMap::new();
        for s in &srcs {
            let i = match s {
                super::optim::Source::State { i, .. } | super::optim::Source::Param(i) => *i,
            };
            // Device state, and host state lent out live (a borrower may write it
            // at any time), are copied at the call.
            seen.entry(i)
                .or_insert(opt.param_device(i).is_cuda() || opt.lends_state(i));
        }
        seen.into_iter()
            .filter(|&(_, d)| d)
            .map(|(i, _)| i)
            .collect()
    };
    let snap = Arc::new(Snapshot::new(
        opt,
        srcs,
        runs,
        bytes,
        staging_budget,
        recycled,
    ));
    for i in at_call {
        snap.stage_now(opt, i)?;
    }
    let reader = LiveReader::new(opt);
    registration.0.attach(&snap);
    snap.hold(held);
    opt.attach_save(snap.clone());
    let outcome: Arc<(Mutex<Outcome>, Condvar)> = Arc::default();
    let with_comm = comm.is_some();
    let thread = {
        let (snap, outcome, dir) = (snap.clone(), outcome.clone(), dir.to_path_buf());
        let ticket = registration.0.clone();
        let at = dir.clone();
        std::thread::Builder::new()
            .name("fo-save".into())
            .spawn(move || {
                let reader = reader;
                let staged = stage_rank_file(&dir, &plan, &popts, &mut |e| {
                    // SAFETY: `take` calls this only while the parameter is held Reading.
                    snap.take(e, &mut |i, copy, src| unsafe { reader.read(i, copy, src) })
                        .map(Cow::Owned)
                });
                snap.release();
                drop(reader);
                let result = staged.and_then(|staged| {
                    if with_comm {
                        let parts = staged.num_parts();
                        let digest = publish(&dir, staged)?;
                        mark_done(
                            &dir,
                            &popts.save_id,
                            popts.rank,
                            popts.world_size,
                            &digest,
                            parts,
                        )
                    } else {
                        finish(&dir, staged)
                    }
                });
                // Without a communicator the commit is done (or failed): a later save
                // into the directory may go on.
                if !with_comm {
                    ticket.settle();
                }
                let (m, cv) = &*outcome;
                let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
                (g.done, g.result) = (true, Some(result));
                cv.notify_all();
            })
            .map_err(|e| Error::io(at, e))
    };
    let thread = match thread {
        Ok(t) => t,
        Err(e) => {
            snap.release();
            return Err(e);
        }
    };
    Ok(AsyncSave {
        snap,
        outcome,
        thread: Some(thread),
        dir: dir.to_path_buf(),
        save_id,
        world_size: o.world_size,
        commit_pending: with_comm,
        settled: None,
        registration,
    })
}

/// This rank's own checks of a save's arguments (no collective).
fn check_local(dir: &Path, o: &SaveOptions, comm: Option<&Comm>) -> Result<()> {
    o.validate()?;
    check_dir(dir)?;
    match comm {
        Some(c) if o.rank != c.rank() || o.world_size != c.world_size() => Err(Error::invalid(
            "options.rank",
            format!(
                "rank {} of {} differs from the communicator's rank {} of {}",
                o.rank,
                o.world_size,
                c.rank(),
                c.world_size()
            ),
        )),
        _ => Ok(()),
    }
}

impl AsyncSave {
    /// The save's id (agreed across ranks with a communicator).
    pub fn save_id(&self) -> &str {
        &self.save_id
    }

    /// Whether the background work is over (then `wait` does not block, apart from the
    /// commit collective of a save with a communicator).
    pub fn is_done(&self) -> bool {
        let (m, _) = &*self.outcome;
        m.lock().unwrap_or_else(|e| e.into_inner()).done
    }

    pub fn stats(&self) -> SnapshotStats {
        self.snap.stats()
    }

    /// Test support: holds the writer before its next fetch (`true`) or lets it go, so
    /// a test can keep a save in flight while it steps, sets state or adds parameters.
    #[doc(hidden)]
    pub fn hold_writer(&self, on: bool) {
        self.snap.hold(on);
    }

    /// Waits up to `timeout` (None: forever) for the background work; false on timeout.
    fn wait_background(&self, timeout: Option<Duration>) -> bool {
        self.background().wait(timeout)
    }

    /// A handle that waits for this save's background work, usable from another owner
    /// (a communicator's destroy waits for the saves that would commit through it).
    pub fn background(&self) -> Background {
        Background(self.outcome.clone())
    }

    /// The whole save's outcome, its commit included: waits up to `timeout` for the
    /// writer (`Error::Timeout` past it: the save goes on, wait again), then with a
    /// communicator runs the commit collective (`comm` must be the one given at the call;
    /// every rank must wait). A failure names the path and cause; it leaves the previous
    /// checkpoint the visible one. Later waits return the same outcome.
    pub fn wait(&mut self, timeout: Option<Duration>, comm: Option<&Comm>) -> Result<()> {
        if self.commit_pending && comm.is_none() && self.settled.is_none() {
            return Err(Error::invalid(
                "comm",
                "this save was started with a communicator: its commit runs at wait, on the same communicator",
            ));
        }
        self.settle(timeout, comm.map(Ok))
    }

    /// `wait` for a save whose communicator is gone before its commit ran (the C ABI's
    /// `fo_comm_destroy`): waits for the writer like `wait`, then settles the save as
    /// failed with `why` (or the writer's own failure), never committed.
    pub fn wait_without_commit(&mut self, timeout: Option<Duration>, why: Error) -> Result<()> {
        self.settle(timeout, Some(Err(why)))
    }

    /// `wait`'s body: `comm` is the communicator to commit through, or why there is none.
    fn settle(&mut self, timeout: Option<Duration>, comm: Option<Result<&Comm>>) -> Result<()> {
        if let Some(s) = &self.settled {
            return s.as_ref().map(|_| ()).map_err(Error::clone);
        }
        if !self.wait_background(timeout) {
            return Err(Error::Timeout(format!(
                "save {:?} into {} is still being written after {:.3} s",
                self.save_id,
                self.dir.display(),
                timeout.unwrap_or_default().as_secs_f64()
            )));
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let bg = {
            let (m, _) = &*self.outcome;
            let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
            g.result
                .take()
                .unwrap_or_else(|| Err(Error::Internal("the save's writer left no outcome".into())))
        };
        let result = match (self.commit_pending, comm) {
            (true, Some(Ok(c))) => {
                self.commit_pending = false;
                // From here the commit no longer waits for the caller: a later save into
                // the directory waits for it instead of being refused.
                self.registration.0.set_phase(Phase::Committing);
                commit_collective(c, &self.dir, &self.save_id, self.world_size, bg)
            }
            (true, Some(Err(why))) => {
                self.commit_pending = false;
                bg.and(Err(why))
            }
            _ => bg,
        };
        self.settled = Some(result.as_ref().map(|_| ()).map_err(Error::clone));
        self.registration.0.settle();
        result
    }
}

/// Waits for an async save's writer (see [`AsyncSave::background`]).
#[derive(Clone)]
pub struct Background(Arc<(Mutex<Outcome>, Condvar)>);

impl Background {
    /// Waits up to `timeout` (None: forever) for the writer to be done; false on timeout.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        let (m, cv) = &*self.0;
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
        while !g.done {
            g = match deadline {
                None => cv.wait(g).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return false;
                    }
                    cv.wait_timeout(g, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
        true
    }
}

impl Drop for AsyncSave {
    fn drop(&mut self) {
        // A held writer (tests) would never finish: let it go before joining.
        self.snap.hold(false);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
