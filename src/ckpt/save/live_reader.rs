//! How an async save's writer reads the live state (`LiveReader`): shallow copies of each
//! parameter's state taken at the call, under the aliasing invariant that makes it sound.
use std::mem::ManuallyDrop;

use super::optim::Source;
use super::snapshot::fetch_entry;
use crate::error::Result;
use crate::optim::math::state::ParamState;
use crate::optim::placement::staging::StagedParam;
use crate::optim::Optimizer;
use crate::tensor::Tensor;

/// What the writer thread reads the live state through: a detached copy of the
/// optimizer's tables (groups, parameter views; no state) and, per planned parameter, a
/// shallow copy of its live state taken at the call (its own `Vec` headers and scalars,
/// pointing at the optimizer's heap buffers; never dropped).
///
/// # The aliasing invariant (why the writer's reads are sound)
/// The caller's thread keeps `&mut Optimizer` and steps while the writer reads, so the
/// writer must never read memory over which that thread may create a `&mut` (even one
/// that writes nothing: a `&mut` asserts exclusive access to every byte it covers).
/// - The writer never reads the optimizer's own memory (the `Optimizer` struct, its
///   `Vec<Param>` buffer, the `ParamState` headers inside each `Param`): those are
///   reborrowed mutably all the time (`params.iter_mut()` in the step covers every
///   parameter, stepped or not). It reads its detached view and its shallow copies.
/// - It reads the *heap buffers* of parameter `i`'s state (`Moment` / `ErrorBits`
///   vectors) and the caller's memory of parameter `i` only while the snapshot holds `i`
///   `Reading`. Every mutation of `i` — anything that writes, reallocates, frees or
///   mutably borrows those buffers or the parameter's elements (`&mut [T]` over them):
///   the step's kernels, `set_states`, `store_state`, a load, `write_param`, a numerics
///   roll-back — runs only after `Optimizer::before_write(i)` has returned, which waits
///   while `i` is `Reading` and returns with `i` `Free` (its entries staged into the
///   pool or already written), after which the writer never reads `i`'s live memory
///   again. The hand-off is through the snapshot's mutex (acquire/release), so the
///   writer's reads happen-before the mutation.
/// - Heap buffers do not move while `i` is pending: nothing reallocates them without
///   `before_write(i)` first. A `Vec<Param>` reallocation (`add_param`, refused anyway
///   while a save reads) would move only the headers, which the writer does not read.
///
/// Whoever adds a path that mutates state or parameter memory (e.g. an overlapped step)
/// must call `before_write(i)` before creating any `&mut` over parameter `i`'s state
/// buffers or elements.
pub(super) struct LiveReader {
    pub(super) view: Optimizer,
    live: Vec<Option<ManuallyDrop<ParamState>>>,
}

// SAFETY: the shallow copies' buffers and the view's parameter memory are read only by
// the writer, under the invariant above; nothing in them is thread-bound.
unsafe impl Send for LiveReader {}

impl LiveReader {
    pub(super) fn new(opt: &Optimizer) -> LiveReader {
        LiveReader {
            view: opt.detached_view(),
            live: (0..opt.num_params())
                .map(|i| {
                    opt.host_state(i).map(|s| {
                        // SAFETY: a bitwise copy sharing `s`'s heap buffers; wrapped in
                        // ManuallyDrop it never frees them, and it is read only while
                        // the invariant above keeps them alive and unchanged.
                        ManuallyDrop::new(unsafe { std::ptr::read(s) })
                    })
                })
                .collect(),
        }
    }

    /// Entry `src` of parameter `i`, from `copy` (a staged copy of its state and
    /// elements) or, when None, from the live state.
    ///
    /// # Safety
    /// With `copy` None, parameter `i` must be held `Reading` by the snapshot (see the
    /// invariant on [`LiveReader`]).
    pub(super) unsafe fn read(
        &self,
        i: usize,
        copy: Option<(&ParamState, Option<Tensor>)>,
        src: &Source,
    ) -> Result<Tensor> {
        let (state, param) = match copy {
            Some((st, param)) => (Some(st), param),
            None => (self.live[i].as_deref(), None),
        };
        let mut sp = StagedParam {
            i,
            state: state.map(std::borrow::Cow::Borrowed),
            param,
        };
        fetch_entry(&self.view, &mut sp, src)
    }
}
