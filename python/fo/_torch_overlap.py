"""fo.torch's overlapped step (`overlap=True`, measured by fo._torch_overlap_tune: kept only
where it makes the loop's iterations faster; `overlap="always"`, never measured); the
optimizer-side clip (`max_grad_norm=`) it closes with is fo._torch_clip's.

With overlap on, every parameter gets a post-accumulate-grad hook: the first hand-over of
an iteration opens fo's step (`fo_optimizer_step_begin`); each parameter's final gradient
is handed over (`fo_optimizer_grads_ready`) once its hooks have all run (at the next hook,
or when backward ends; CUDA ones in buckets) and fo steps it on its own pool while
backward goes on; `optimizer.step()` hands over whatever has a gradient and was not handed
over yet, and closes the step (`fo_optimizer_step_end`). The result has the bits of the
plain step with the same gradients (`overlap=False`), clipping included: fo keeps an undo
record of each early step and re-steps with the clipped gradients when the clip coefficient
is below 1.

What a real loop does between backward and `step()` is honoured, never silently wrong:
- A gradient whose copy is still in flight is not read: FSDP2 with `CPUOffloadPolicy`
  (pinned memory) copies each reduced gradient to the host with `non_blocking=True` and
  records `fsdp_param.grad_offload_event` before calling the hooks (torch 2.11 does; 2.15
  copies synchronously when a hook is registered). The hand-over waits for that event
  without blocking backward: the gradient is queued and handed over by a later hook once
  the event has completed, or by `step()`.
- A gradient changed after its hand-over (a clip that scales, `GradScaler.unscale_`, an
  edit through `.data`; a replaced `.grad`; fo._torch_overlap_edits tells an edit that
  changed bits from one that did not) makes `step()` roll every early step back and step
  again with the final gradients (`last_step_stats["redone"]` says why). After two such
  steps in a row the hooks stop handing over (a warning says so and what to use instead:
  `max_grad_norm=`): the step then costs what `overlap=False` costs, never more.
- Whatever else reads or writes a parameter stepped early before `step()` (a forward, a
  backward that keeps its graph, an in-place edit): fo._torch_overlap_params.
- A step left open when the state is read or written (`state_dict()`, `opt.state[p]`, a
  checkpoint) or by `zero_grad()` is rolled back first: parameters and state exactly as
  before the backward, as torch drops a step that never ran.

Early steps take cores. When backward itself runs on the host CPU with a team of torch
intra-op threads covering every core this process may use (`torch.get_num_threads()` >= 2
and >= the cores), any core fo takes stalls that team at its next barrier: measured on 2
cores, FSDP2 on gloo, 1.12-1.19x the sequential iteration. There the hooks hand nothing over
and `step()` steps everything (the cost of overlap=False; a warning says so once, and
`last_step_stats["not_overlapped"]` why). Backward on a GPU (parameters on CUDA, or FSDP2
shards on the host of a CUDA mesh) leaves the host cores to fo.

CUDA parameters step early on their GPU, handed over in buckets (fo._torch_overlap_cuda).

Only `fo.torch` imports this module (it needs torch)."""
import contextlib
import ctypes
import os
import sys
import warnings
import weakref

import torch

from . import optim as _optim
from ._ffi import FoError, check
from ._torch_args import INVALID_ARGUMENT, TorchArg, error, is_dtensor, local
from ._torch_cuda import is_cuda
from ._torch_overlap_amp import GradScaling
from ._torch_overlap_cuda import CudaBuckets
from ._torch_overlap_edits import changed_since_hand_over, grad_mark, keep_full_fingerprints, same_grad
from ._torch_overlap_params import AfterTheirHooks, keeps_graph, param_mark, raise_touched, touched, track_open
from ._torch_overlap_tune import Measured

UNDO_KEYS = ("rolled_back", "rolled_back_bytes", "rollback_ns")
OPTION_KEYS = ("overlap", "max_grad_norm", "norm_type", "error_if_nonfinite", "undo_budget_bytes")


def overlap_options(overlap=False, max_grad_norm=None, norm_type=2.0, error_if_nonfinite=False,
                    undo_budget_bytes=0):
    """fo.torch's overlap and clip arguments, checked (a TypeError names an unknown one)."""
    if not (isinstance(overlap, bool) or (isinstance(overlap, str) and overlap == "always")):
        raise ValueError(f"overlap must be True (measured: kept where it makes iterations faster), 'always' "
                         f"(hand over in every backward) or False, got {overlap!r}")
    if max_grad_norm is not None and not float(max_grad_norm) > 0:
        raise ValueError(f"max_grad_norm must be > 0 (or None: no clipping), got {max_grad_norm!r}")
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
    if int(undo_budget_bytes) < 0:
        raise ValueError(f"undo_budget_bytes must be >= 0 (0: no bound), got {undo_budget_bytes!r}")
    return dict(overlap=overlap, max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
                norm_type=norm_type, error_if_nonfinite=bool(error_if_nonfinite),
                undo_budget_bytes=int(undo_budget_bytes))


def _fsdp_offload_event(p, frame):
    """FSDP2's event for the non-blocking device-to-host copy of p's gradient, or None.
    FSDP2's `foreach_reduce` records it on `fsdp_param.grad_offload_event` and then calls
    `hook(fsdp_param.sharded_param)`, so it is a local of the hook's caller; FSDP2 itself
    waits for it only in its final callback, after every hook ran."""
    for _ in range(3):
        if frame is None:
            return None
        fsdp_param = frame.f_locals.get("fsdp_param")
        if fsdp_param is not None and getattr(fsdp_param, "sharded_param", None) is p:
            return getattr(fsdp_param, "grad_offload_event", None)
        frame = frame.f_back
    return None


_SKIP_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep)


def _warn(message):
    """warnings.warn pointing at the first frame outside torch and fo: the user's
    `loss.backward()` or `optimizer.step()` line, however deep torch's wrappers are."""
    f, level = sys._getframe(1), 2
    while f is not None and f.f_code.co_filename.startswith(_SKIP_DIRS):
        f, level = f.f_back, level + 1
    warnings.warn(message, stacklevel=level)


def _host_cores():
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _computes_on_host(p):
    """Whether forward and backward of p's module run on the host CPU. An FSDP2 shard kept on
    the host (CPUOffloadPolicy) is computed on its mesh's device."""
    if is_dtensor(p):
        return p.device_mesh.device_type == "cpu"
    return p.device.type == "cpu"


def _hook(ref):
    @torch.compiler.disable  # runs eagerly in backward; traced, every call would break a graph
    def hook(p):
        opt = ref()
        if (opt is not None and not opt._accumulating and not opt._deferred and opt._probe_hands_over()
                and not opt._cores_taken() and not opt._graph_kept()):
            event = _fsdp_offload_event(p, sys._getframe(1))
            if is_cuda(p):
                opt._from_backward(p, event)  # on the stream that made it: queued in a bucket
            else:
                opt._after_its_hooks(p, event)  # once the hooks registered after fo's have run
    return hook


class Overlap(Measured, CudaBuckets, GradScaling, AfterTheirHooks):
    """Mixed into fo.torch's optimizers (which provide `_fo`, `_index`, `_name`, `_names`,
    `_flush`, `_sync`, `_group_hp`, `_pushed`, `param_groups`, fo._torch_clip's `Clip` and
    fo._torch_cuda's `Streams`, and call `_after_step` when `step()` returns)."""

    def _overlap_init(self, options):
        self._ov = options
        self._accumulating = False
        self._open, self._in_backward = False, 0
        self._handed = {}  # param -> the TorchArg fo reads its gradient through until step_end
        self._marks = {}  # param -> _grad_mark of the gradient handed over
        self._pmarks = {}  # param stepped early -> its param_mark then (fo._torch_overlap_params)
        self._pending = []  # (param, event): gradients whose copy had not landed at their hook
        self._copy_events = [0, 0]  # hooks that found FSDP2's copy event, and found it in flight
        self._cuda_init()
        self._behind_init()
        self._deferred = None  # why the hooks no longer hand over (None: they do)
        self._redone_in_a_row = 0
        self._unscaled = False  # GradScaler unscaled every gradient since hand-over
        # An edit counter moved after hand-over (fo._torch_overlap_edits): fo keeps full
        # fingerprints from then on, on this optimizer's handle (a copy has its own).
        self._edit_seen = self._full_fingerprints = False
        self._undone = {}  # rollbacks since the last step(): UNDO_KEYS -> count
        self._warned = set()
        self._hooks = []
        self._host_backward = True  # every hooked parameter computes on the host CPU
        self._clip_comm = None  # fo._torch_clip's, made at the first clip
        self.last_step_stats = None
        self._measure_init(options["overlap"])
        if options["overlap"]:
            for g in self.param_groups:
                self._hook_params(g["params"])
            self.zero_grad = self._overlap_zero_grad
        self._hooked = True

    def _hook_params(self, params):
        ref = weakref.ref(self)
        for p in params:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(_hook(ref)))
                self._host_backward = self._host_backward and _computes_on_host(p)

    def _cores_taken(self, warn=True):
        """Why early steps would only slow backward down (None: they would not): backward
        runs on the host CPU with a team of torch threads on every core (module doc).
        `warn`: say so once (the hooks do; `step()` only records it)."""
        if not self._host_backward:
            return None
        threads, cores = torch.get_num_threads(), _host_cores()
        if threads < 2 or threads < cores:
            return None
        reason = (f"backward runs on the host CPU with {threads} torch intra-op threads on its {cores} cores; "
                  "stepping early would stall them")
        if warn:
            self._warn_once("cores", f"fo.torch overlap=True: {reason}, so gradients are handed over at "
                            "optimizer.step() (the cost of overlap=False). To overlap on the host, leave fo cores "
                            "of its own: torch.set_num_threads(n) with n below the cores, fo.set_num_threads(the "
                            "rest).")
        return reason

    def _graph_kept(self):
        """Whether this backward keeps its graph (fo._torch_overlap_params): it hands nothing over."""
        if not keeps_graph():
            return False
        self._warn_once("graph", "fo.torch overlap=True: a backward with retain_graph=True (or create_graph=True) "
                        "hands no gradient over (another backward through that graph reads the parameters); "
                        "optimizer.step() steps them")
        return True

    @property
    def overlap(self):
        return self._ov["overlap"]

    @contextlib.contextmanager
    def no_handover(self):
        """Backward passes inside hand no gradient over (gradient accumulation: every
        micro-batch but the last, like DDP's `no_sync`); the last one, outside, hands over
        the accumulated gradients."""
        before, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = before

    # -- the overlapped step ----------------------------------------------------------
    def _begin(self):
        self._flush()
        # Every parameter is registered now, in param-group order: none can be added while
        # the step is open, and the clip norm combines them in this order.
        self._sync(also={p for g in self.param_groups for p in g["params"]})
        self._use_current_stream()  # fo takes no new stream while the step is open
        o = self._ov
        opts = _optim.OverlapOptions()
        _optim._overlap_default(ctypes.byref(opts))
        opts.max_norm = o["max_grad_norm"] or 0.0
        opts.norm_type = o["norm_type"]
        opts.error_if_nonfinite = int(o["error_if_nonfinite"])
        opts.undo_budget_bytes = o["undo_budget_bytes"]
        check(_optim._step_begin(self._fo._handle, ctypes.byref(opts)))
        self._open, self._handed, self._marks, self._pmarks, self._in_backward = True, {}, {}, {}, 0
        track_open(self, True)

    def _from_backward(self, p, event):
        """A post-accumulate-grad hook: hands p's gradient over, or queues it while its copy
        (`event`) is in flight; first hands over the queued ones whose copy has landed. A
        CUDA parameter's gradient is handed over where the hook runs on the step's stream
        (module doc), else left for `step()`."""
        if is_cuda(p):
            if not self._open:
                self._begin()
            if self._on_step_stream(p):
                self._queue_cuda(p)  # fo._torch_overlap_cuda: handed over in buckets
            return
        self._poll_pending(wait=False)
        if event is not None:  # counted for the FSDP2 tests: was the copy found, was it in flight
            self._copy_events[0] += 1
        if event is not None and not event.query():
            self._copy_events[1] += 1
            if not self._open:
                self._begin()
            self._pending = [(q, e) for q, e in self._pending if q is not p] + [(p, event)]
            return
        if self._hand_over(p):
            self._in_backward += 1

    def _poll_pending(self, wait):
        """Hands over the queued gradients whose copy has landed (`wait`: all of them, waiting
        for each copy), in the order their hooks ran."""
        still = []
        for p, event in self._pending:
            if wait:
                event.synchronize()
            elif not event.query():
                still.append((p, event))
                continue
            if self._hand_over(p, at_end=wait) and not wait:
                self._in_backward += 1
        self._pending = still

    def _hand_over(self, p, at_end=False):
        """`_hand_over_many` of p alone: whether fo took p's gradient."""
        return self._hand_over_many([p], at_end) == 1

    def _hand_over_many(self, ps, at_end=False):
        """Hands the gradients of `ps` to fo in one call (opening the step if none is;
        `at_end`: from `step()`, so fo steps them at step_end with no undo record); returns
        how many it took (not those whose very gradient fo already holds, nor those without
        one). A gradient that changed since it was handed over means a second backward
        reached a parameter fo may have stepped already, from a forward fo's forward pre-hook
        did not see (fo._torch_overlap_params: any module forward puts the early steps back
        first): that backward may have read the stepped values, so the step is put back and
        fo raises. A gradient fo refuses fails the step: it is closed at once (nothing
        changed) and the error raised."""
        if not self._open:
            self._begin()
        give = []
        for p in ps:
            if p in self._handed:
                if same_grad(self._marks.get(p), p.grad):
                    continue
                self._settle_open()
                raise error(INVALID_ARGUMENT, (
                    f"{type(self).__name__} (overlap={self._ov['overlap']!r}): parameter {self._name.get(p, '?')} "
                    "got a second gradient after fo had stepped it early, from a forward that ran outside a "
                    "module call fo sees (a functional call, module.forward() called directly, or a forward run "
                    "before the previous backward); that backward may have read the stepped values. fo put its "
                    "early steps back. Run every backward but the last of a step inside `with "
                    "optimizer.no_handover():`, or call the model's modules"))
            if p.grad is not None:
                give.append(p)
        if not give:
            return 0
        args = []
        for p in give:
            name, g = self._name.get(p, "?"), p.grad
            if g.layout != torch.strided:
                self._fail(RuntimeError(f"{type(self).__name__} does not support sparse gradients "
                                        f"(parameter {name}) with overlap=True"))
            try:
                args.append(TorchArg(g, f"gradient of parameter {name}", empty_non_null=True))
            except FoError as e:
                self._fail(e)
        n = len(give)
        idx = (ctypes.c_int32 * n)(*(self._index[p] for p in give))
        arr = (type(args[0].struct) * n)(*(a.struct for a in args))
        for p, arg in zip(give, args):
            self._handed[p], self._marks[p] = arg, grad_mark(p.grad)
            if not at_end:  # stepped early: no one else may write it before step()
                self._pmarks[p] = param_mark(p)
        status = (_optim._grads_at_end if at_end else _optim._grads_ready)(self._fo._handle, idx, arr, n)
        if status:
            try:
                check(status)
            except FoError as e:
                self._fail(e)
        return n

    def _fail(self, error):
        """Closes the open step as failed (fo puts back what it stepped) and raises `error`."""
        self._drop_cuda_queue()
        self._abandon()
        self._undone = {}
        raise error

    def _abandon(self):
        """Closes the open step changing nothing (fo_optimizer_step_abort puts every early
        step back; local to this rank, no collective)."""
        self._pending = []
        stats = _optim.OverlapStats()
        status = _optim._step_abort(self._fo._handle, ctypes.byref(stats))
        self._probe_spoil()  # that iteration is no measure of the overlap's cost
        self._open, self._handed, self._marks, self._pmarks, self._unscaled = False, {}, {}, {}, False
        track_open(self, False)
        self.last_step_stats = _stats_dict(stats)
        for k in UNDO_KEYS:  # counted into the stats of the step() that follows
            self._undone[k] = self._undone.get(k, 0) + self.last_step_stats[k]
        check(status)

    def _settle_open(self):
        """A step left open (backward handed gradients over and `step()` was not called: a
        skipped step, or state read between backward and step) is rolled back before fo's
        state is read or written: parameters and state as before that backward."""
        if getattr(self, "_open", False):
            found = touched(self)
            self._abandon()
            if found:
                raise_touched(self, found)

    def _edited(self):
        """Names of the handed-over parameters whose gradient changed since (fo._torch_overlap_edits)."""
        changed, moved = changed_since_hand_over(self)
        if moved:
            self._edit_seen = True
        return [self._name.get(p, "?") for p in changed]

    def _end(self):
        """optimizer.step() with overlap=True: hands over the gradients no hook handed over
        (their parameters' hooks did not fire: set by hand, or only under no_handover),
        then closes the step. Also opens one when no hook fired (a plain step). Early steps
        that can no longer stand (hyper-parameters or gradients changed after backward
        handed them over) are rolled back and the step taken again: the bits of overlap=False."""
        self._drop_behind()  # (a backward that raised): handed over below
        self._poll_pending(wait=True)
        self._drop_cuda_queue()  # handed over below (at_end), or stepped by the plain step
        if self._open and touched(self):
            self._settle_open()  # puts the early steps back and raises, naming the parameters
        self._cuda_callback = False  # (a backward that raised never ran its callback)
        redone, in_backward = None, self._in_backward
        if self._open and (len(self.param_groups) != len(self._pushed) or any(
                self._group_hp(g) != hp for g, hp in zip(self.param_groups, self._pushed))):
            # param_groups changed between backward and step (an lr set just before step):
            # the early steps used the old values. Put them back and step with the new ones.
            _warn("fo.torch overlap=True: param_groups changed after backward started handing "
                  "gradients over; this step was redone without overlap. Change lr etc. "
                  "before backward (e.g. scheduler.step() after optimizer.step()).")
            redone = "param_groups changed after backward"
            self._abandon()
        unscaled = self._unscaled  # (cleared by _abandon)
        edited = self._edited() if self._open else []
        if edited:
            redone = f"{len(edited)} gradients changed after backward handed them over ({edited[0]}, ...)"
            self._abandon()
        self._redone_in_a_row = self._redone_in_a_row + 1 if edited else 0
        if self._redone_in_a_row >= 2 and self._deferred is None:
            self._deferred = redone
            if unscaled:
                advice = ("GradScaler.unscale_ divides every gradient by the scale after backward handed it over, "
                          "so an early step can never stand: with bf16 autocast no GradScaler is needed")
            else:
                advice = ("to overlap, clip with the optimizer's max_grad_norm= instead (HF Trainer: "
                          "max_grad_norm=0 and the optimizer's max_grad_norm=...; a clip that does not scale "
                          "leaves the bits, and overlap, as they were); under DistributedDataParallel, which "
                          "averages every gradient after its hook, no early step can stand: FSDP2 overlaps")
            _warn(
                f"fo.torch overlap=True: gradients changed between backward and optimizer.step() in two "
                f"steps in a row (e.g. parameter {edited[0]}: a clip that scaled, GradScaler.unscale_, an edit "
                "through .data, DistributedDataParallel's averaging), so every early step had to be redone; from "
                f"now on gradients are handed over at step() (the cost of overlap=False); {advice}")
        held = self._deferred or self._probe_held() or (self._cores_taken(warn=False) if in_backward == 0 else None)
        extra = dict(handed_over_in_backward=in_backward, redone=redone, not_overlapped=held, overlap_probe=None)
        undone, self._undone, self._in_backward = self._undone, {}, 0
        status = 0
        if not self._open:
            # Nothing is stepped yet (no hook handed a gradient over, or the early steps were
            # put back): the plain step, which keeps no undo record (nothing can undo it now).
            n = self._plain_step()  # clears _unscaled, as step_end's path below does
            clip = self.last_step_stats if self._ov["max_grad_norm"] is not None else {}
            stats = {f: 0 for f, _ in _optim.OverlapStats._fields_}
            stats.update(handed_over=n, deferred=n, total_norm=clip.get("total_norm", -1.0),
                         clipped=clip.get("clipped", False))
            self.last_step_stats = dict(stats, **extra)
        else:
            behind = self._order_after_current()  # CUDA gradients are ordered on the caller's stream
            self._hand_over_many([p for _, p, _ in self._names() if p.grad is not None and p not in self._handed],
                                 at_end=True)
            if self._ov["max_grad_norm"] is not None and self._stream is not None:
                # step_end takes CUDA gradients' norm and scales them on the comm's stream
                self._comm().set_stream(self._stream[0])
            stats = _optim.OverlapStats()
            status = _optim._step_end(self._fo._handle, self._comm_handle(), ctypes.byref(stats))
            self._order_current(behind)
            self._open, self._handed, self._marks, self._pmarks, self._unscaled = False, {}, {}, {}, False
            track_open(self, False)
            self.last_step_stats = dict(_stats_dict(stats), **extra)
        for k, v in undone.items():  # early steps put back before this step() closed
            self.last_step_stats[k] += v
        if self._edit_seen and not self._open:
            keep_full_fingerprints(self)
        check(status)

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            _warn(message)

    def _overlap_zero_grad(self, set_to_none=True):
        """torch's zero_grad (overlap=True only: an instance attribute, so overlap=False keeps
        torch's own, which torch.compile knows). While an overlapped step is open (backward handed gradients
        over, step() not called yet) it abandons that step first: nothing is changed, as
        torch drops those gradients."""
        self._settle_open()
        self._drop_cuda_queue()  # those gradients are dropped too
        self._drop_behind()
        self._undone = {}  # that step is dropped: its rollback is not the next step's
        type(self).zero_grad(self, set_to_none=set_to_none)

    def remove_hooks(self):
        """Removes the post-accumulate-grad hooks overlap=True registered (the optimizer then
        steps as with overlap=False); an open step is abandoned first."""
        self._settle_open()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._ov = dict(self._ov, overlap=False)
        self._measure_init(False)
        self.__dict__.pop("zero_grad", None)
        if self._fo is not None:  # no overlapped step comes: its undo records go back
            self._fo.release_undo()


def _stats_dict(st):
    out = {f: getattr(st, f) for f, _ in _optim.OverlapStats._fields_}
    out["clipped"] = bool(out["clipped"])
    return out
