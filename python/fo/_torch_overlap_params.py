"""Who reads or writes the parameters fo stepped early, between their hand-over and `step()`
(fo._torch_overlap). An early step writes its parameter in place while backward goes on, so
until `step()` that parameter holds its new values; whatever reads it there must either see
the values from before (fo puts its early steps back first) or not run with early steps at
all, and an edit of it there cannot be carried over (it applied to the stepped values):

- A backward that keeps its graph (`retain_graph=True`, `create_graph=True`) hands nothing
  over: another backward through that graph (two losses, a gradient penalty) would read the
  parameters its forward saved.
- A forward outside backward of a module that holds a handed-over parameter, its own or a
  submodule's (so a whole model called, or its `torch.compile` wrapper, counts), puts the
  early steps back before it runs; so does a forward recomputed inside backward (activation
  checkpointing) of such a module (a layer used in several checkpointed segments).
- A handed-over parameter edited in place (its version counter moved: `p.clamp_()` under
  no_grad, `model.load_state_dict`, a SAM perturbation) or given new storage (`p.data =
  ...`) before `step()`: fo puts its early steps back and raises, naming the parameter and
  what to do. fo's own pointer stays valid meanwhile (fo._torch_args.TorchArg holds the old
  storage).
- A hook registered on the parameter after fo's (a per-parameter clip of its gradient, a
  decay that reads the parameter) runs before fo takes the gradient: a host gradient is
  handed over at the next hook fo gets, or when backward ends (`AfterTheirHooks`), so the
  hook reads the parameter as it was and fo the gradient as it leaves. (CUDA gradients go
  over in buckets, fo._torch_overlap_cuda, later still.)

Not seen (docs/python.md says so): reads (an EMA update, `model.state_dict()`) and edits
through `.data` of those parameters between backward and `step()`.

Only fo._torch_overlap imports this module (it needs torch)."""
import weakref

import torch

from ._torch_args import INVALID_ARGUMENT, error, local

# `retain_graph`/`create_graph` of the backward running the calling hook (torch >= 2.1).
_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: False)


def keeps_graph():
    """Whether the backward calling this hook keeps its graph for another backward."""
    return torch._C._current_graph_task_id() != -1 and _keep_graph()


def param_mark(p):
    """What tells whether a parameter was written by anyone but fo since its hand-over: where
    its memory is, and its in-place edit counters (fo's own writes move neither)."""
    t = local(p)
    try:
        return t.data_ptr(), p._version, t._version  # fo._torch_args.version: a DTensor has two
    except RuntimeError:  # an inference-mode tensor has no version counter: storage only
        return t.data_ptr(), None, None


def touched(opt):
    """(name, how) of each parameter stepped early whose storage or contents someone else
    changed since its hand-over."""
    out = []
    for p, mark in opt._pmarks.items():
        now = param_mark(p)
        if now[0] != mark[0]:
            out.append((opt._name.get(p, "?"), "new storage"))
        elif now[1:] != mark[1:]:
            out.append((opt._name.get(p, "?"), "edited"))
    return out


_HOW = {
    "edited": ("was edited in place (p.clamp_() under no_grad, load_state_dict, a SAM perturbation, ...)",
               "that edit applied to the stepped values, so overlap=False's result cannot be had. fo put its "
               "early steps back: the parameter holds its values from before that backward again, without the "
               "edit"),
    "new storage": ("was given new storage (p.data = ..., module.to(...))",
                    "what was copied into it may hold the early step, so overlap=False's result cannot be had. fo "
                    "put its early steps back in the old storage; the new one holds what was copied"),
}


def raise_touched(opt, found):
    """The error for `touched` parameters, raised once fo put its early steps back."""
    name, how = found[0]
    what, result = _HOW[how]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    raise error(INVALID_ARGUMENT, (
        f"{type(opt).__name__} (overlap={opt._ov['overlap']!r}): parameter {name}{more} {what} between backward "
        f"and optimizer.step(), after fo had stepped it early during backward; {result}. Change parameters after "
        "optimizer.step() or before backward, or run that backward inside `with optimizer.no_handover():`"))


# Optimizers with an overlapped step open. While there is one, a global forward pre-hook
# rolls their early steps back before a forward that reads their parameters runs (the next
# micro-batch of gradient accumulation without no_handover(), an evaluation, the next
# iteration after a skipped step, a recomputation in backward): it must see the parameters
# as they were, which no later rollback could repair. The hook exists only while a step is
# open, so a loop that runs backward then step() never calls it outside backward (nor does
# torch.compile trace it).
_OPEN = weakref.WeakSet()
_forward_hook = None


def _reads_handed(module, opt):
    """Whether `module`'s forward reads a parameter handed over to `opt` (its own or a
    submodule's: a container, a whole model or a compiled wrapper runs its children)."""
    handed = opt._handed
    return bool(handed) and any(p in handed for p in module.parameters())


@torch.compiler.disable  # fo's bookkeeping, not model code: Dynamo never traces it
def _before_forward(module, args):
    in_backward = torch._C._current_graph_task_id() != -1
    for opt in list(_OPEN):
        if not _reads_handed(module, opt):
            continue  # another model's forward (or one recomputed before its hand-over)
        if in_backward:
            opt._warn_once("recompute", "fo.torch overlap=True: a forward recomputed inside backward (activation "
                           "checkpointing) reads a parameter fo had already stepped early (a layer in several "
                           "checkpointed segments); fo put its early steps back (same result, less overlap)")
        else:
            opt._warn_once("forward", "fo.torch overlap=True: a forward ran between backward and optimizer.step() "
                           "(gradient accumulation without `with optimizer.no_handover():`, an evaluation, or a "
                           "step skipped); fo put its early steps back so the forward sees the parameters as "
                           "before (same result, less overlap)")
        opt._settle_open()


def track_open(opt, is_open):
    global _forward_hook
    if is_open:
        _OPEN.add(opt)
        if _forward_hook is None:
            _forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(_before_forward)
    else:
        _OPEN.discard(opt)
        if not _OPEN and _forward_hook is not None:
            _forward_hook.remove()
            _forward_hook = None


def _at_backward_end(ref, task):
    @torch.compiler.disable  # run by autograd at the end of backward, eagerly: never traced
    def flush():
        opt = ref()
        if opt is not None:
            if opt._behind_callback == task:
                opt._behind_callback = None
            opt._flush_behind()
    return flush


class AfterTheirHooks:
    """Mixed into fo._torch_overlap's `Overlap` (which provides `_from_backward`): the host
    parameter whose hook ran last waits until the next hook or the end of its backward, when
    every hook of its own has run (torch runs a parameter's post-accumulate-grad hooks one
    after another, in the order they were registered). A backward inside backward (reentrant
    activation checkpointing) is a graph task of its own, with its own end."""

    def _behind_init(self):
        self._behind = None  # (param, event): its hooks registered after fo's may still run
        self._behind_callback = None  # the graph task whose end flushes it (None: none queued)

    def _after_its_hooks(self, p, event):
        prev, self._behind = self._behind, (p, event)
        if prev is not None and prev[0] is not p:
            self._from_backward(*prev)
        task = torch._C._current_graph_task_id()
        if self._behind_callback != task:
            try:
                queue = torch.autograd.Variable._execution_engine.queue_callback
                queue(_at_backward_end(weakref.ref(self), task))
                self._behind_callback = task
            except RuntimeError:  # not inside a backward (the hook called directly): no one runs after
                self._flush_behind()

    def _drop_behind(self):
        """Forgets the one behind (`step()` hands every gradient over itself; a dropped step
        hands nothing), and any flush a backward that raised left queued."""
        self._behind, self._behind_callback = None, None

    def _flush_behind(self):
        prev, self._behind = self._behind, None
        if prev is not None:
            self._from_backward(*prev)
