"""fo.torch's overlapped step (`overlap=True`) and the optimizer-side clip (`max_grad_norm=`).

With `overlap=True` every parameter gets a post-accumulate-grad hook: the first hook of an
iteration opens fo's step (`fo_optimizer_step_begin`), each hook hands that parameter's
final gradient over (`fo_optimizer_grads_ready`) and fo steps it on its own pool while
backward goes on; `optimizer.step()` hands over whatever has a gradient and was not handed
over yet, and closes the step (`fo_optimizer_step_end`). The result has the bits of the
plain step with the same gradients (`overlap=False`), clipping included: fo keeps an undo
record of each early step and re-steps with the clipped gradients when the clip coefficient
is below 1. So the gradients handed over must not change until `step()`: a second backward
(gradient accumulation) runs under `opt.no_handover()`, and `zero_grad()` while a step is
open abandons it (nothing changed, as torch drops the gradients).

Clipping is an optimizer argument (`max_grad_norm`, `norm_type`, `error_if_nonfinite`),
since the step starts before the user could call `clip_grad_norm_`; it means the same with
`overlap=False` (fo's `fo_clip_grad_norm` over the gradients in param-group order, then the
step), so both modes follow the same trajectory bit for bit. DTensor parameters count as
shards in the norm when a placement is `Shard`/`_StridedShard`; the norm is combined over
torch.distributed's default group.

Only `fo.torch` imports this module (it needs torch)."""
import contextlib
import ctypes
import warnings
import weakref

import torch

from . import comm as _comm
from . import optim as _optim
from ._codes import FO_ERR_INVALID_ARGUMENT
from ._ffi import FoError, check
from ._torch_args import TorchArg, is_dtensor

OPTION_KEYS = ("overlap", "max_grad_norm", "norm_type", "error_if_nonfinite", "undo_budget_bytes")


def overlap_options(overlap=False, max_grad_norm=None, norm_type=2.0, error_if_nonfinite=False,
                    undo_budget_bytes=0):
    """fo.torch's overlap and clip arguments, checked (a TypeError names an unknown one)."""
    if max_grad_norm is not None and not float(max_grad_norm) > 0:
        raise ValueError(f"max_grad_norm must be > 0 (or None: no clipping), got {max_grad_norm!r}")
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
    if int(undo_budget_bytes) < 0:
        raise ValueError(f"undo_budget_bytes must be >= 0 (0: no bound), got {undo_budget_bytes!r}")
    return dict(overlap=bool(overlap), max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
                norm_type=norm_type, error_if_nonfinite=bool(error_if_nonfinite),
                undo_budget_bytes=int(undo_budget_bytes))


def _is_shard(p):
    """Whether p's gradient is a shard in the clip norm (as fo decides from its shard spec)."""
    return is_dtensor(p) and any(pl.is_shard() for pl in p.placements)


def _torch_comm():
    """An fo Comm over torch.distributed's default group (the clip norm's all-reduce)."""
    dist = torch.distributed

    def broadcast(buf, root):
        if buf.size:
            dist.broadcast(torch.from_numpy(buf), src=root)

    def all_reduce_f64(vals, op):
        if vals.size:
            dist.all_reduce(torch.from_numpy(vals), op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)

    return _comm.Comm.from_callbacks(dist.get_rank(), dist.get_world_size(), broadcast, all_reduce_f64,
                                     dist.barrier)


def _hook(ref):
    def hook(p):
        opt = ref()
        if opt is not None and not opt._accumulating:
            opt._hand_over(p)
            opt._in_backward += 1
    return hook


class Overlap:
    """Mixed into fo.torch's optimizers (which provide `_fo`, `_index`, `_name`, `_names`,
    `_flush`, `_sync`, `_group_hp`, `_pushed` and `param_groups`)."""

    def _overlap_init(self, options):
        self._ov = options
        self._accumulating = False
        self._open, self._in_backward = False, 0
        self._handed = {}  # param -> the TorchArg fo reads its gradient through until step_end
        self._hooks = []
        self._clip_comm = None
        self.last_step_stats = None
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

    # -- the comm for the clip norm ---------------------------------------------------
    def _comm(self):
        dist = torch.distributed
        if self._clip_comm is None:
            live = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            self._clip_comm = _torch_comm() if live else _comm.Comm.local_group(1)[0]
        return self._clip_comm

    def _comm_handle(self):
        """The comm step_end combines the norm through (None: this rank alone)."""
        return self._comm()._h if self._ov["max_grad_norm"] is not None else None

    # -- overlap=False with max_grad_norm: fo's clip, then the step ---------------------
    def _clip_now(self):
        """fo_clip_grad_norm over every gradient in param-group order (scaled in place when
        the total exceeds max_grad_norm), as the overlapped step combines them."""
        o = self._ov
        args, flags = [], []
        for _, p, name in self._names():
            if p.grad is not None:
                args.append(TorchArg(p.grad, f"gradient of parameter {name}", empty_non_null=True))
                flags.append(int(_is_shard(p)))
        arr = (_comm._Grad * max(len(args), 1))(*[_comm._Grad(a.struct, s) for a, s in zip(args, flags)])
        total = ctypes.c_double()
        check(_comm._clip(self._comm()._h, arr, len(args), o["max_grad_norm"], o["norm_type"],
                          int(o["error_if_nonfinite"]), ctypes.byref(total)))
        clipped = o["max_grad_norm"] / (total.value + 1e-6) < 1
        self.last_step_stats = {"total_norm": total.value, "clipped": clipped}

    # -- the overlapped step ----------------------------------------------------------
    def _begin(self):
        self._flush()
        # Every parameter is registered now, in param-group order: none can be added while
        # the step is open, and the clip norm combines them in this order.
        self._sync(also={p for g in self.param_groups for p in g["params"]})
        o = self._ov
        opts = _optim.OverlapOptions()
        _optim._overlap_default(ctypes.byref(opts))
        opts.max_norm = o["max_grad_norm"] or 0.0
        opts.norm_type = o["norm_type"]
        opts.error_if_nonfinite = int(o["error_if_nonfinite"])
        opts.undo_budget_bytes = o["undo_budget_bytes"]
        check(_optim._step_begin(self._fo._handle, ctypes.byref(opts)))
        self._open, self._handed, self._in_backward = True, {}, 0

    def _hand_over(self, p):
        """Hands p's gradient to fo (opening the step if none is). A gradient fo refuses
        fails the step: it is closed at once (nothing changed) and the error raised."""
        if not self._open:
            self._begin()
        name = self._name.get(p, "?")
        if p in self._handed:
            # A second backward accumulated into gradients fo is reading: the step cannot
            # stand: close it now, changing nothing.
            self._fail(RuntimeError(
                f"the gradient of parameter {name} was handed over twice in one step: a second "
                "backward ran before optimizer.step(). Run every micro-batch but the last under "
                "`with optimizer.no_handover():` (gradient accumulation); this step was abandoned, "
                "nothing changed"))
        g = p.grad
        if g.layout != torch.strided:
            self._fail(RuntimeError(f"{type(self).__name__} does not support sparse gradients "
                                    f"(parameter {name}) with overlap=True"))
        try:
            arg = TorchArg(g, f"gradient of parameter {name}", empty_non_null=True)
        except FoError as e:
            self._fail(e)
        idx = (ctypes.c_int32 * 1)(self._index[p])
        arr = (type(arg.struct) * 1)(arg.struct)
        self._handed[p] = arg
        status = _optim._grads_ready(self._fo._handle, idx, arr, 1)
        if status:
            try:
                check(status)
            except FoError as e:
                self._fail(e)

    def _fail(self, error):
        """Closes the open step as failed (fo puts back what it stepped) and raises `error`."""
        self._abandon()
        raise error

    def _abandon(self):
        """Closes the open step changing nothing (fo_optimizer_step_abort puts every early
        step back; local to this rank, no collective)."""
        stats = _optim.OverlapStats()
        status = _optim._step_abort(self._fo._handle, ctypes.byref(stats))
        self._open, self._handed = False, {}
        self.last_step_stats = _stats_dict(stats)
        check(status)

    def _end(self):
        """optimizer.step() with overlap=True: hands over the gradients no hook handed over
        (their parameters' hooks did not fire: set by hand, or only under no_handover),
        then closes the step. Also opens one when no hook fired (a plain step)."""
        if self._open and (len(self.param_groups) != len(self._pushed) or any(
                self._group_hp(g) != hp for g, hp in zip(self.param_groups, self._pushed))):
            # param_groups changed between backward and step (an lr set just before step):
            # the early steps used the old values. Put them back and step with the new ones.
            warnings.warn("fo.torch overlap=True: param_groups changed after backward started handing "
                          "gradients over; this step was redone without overlap. Change lr etc. "
                          "before backward (e.g. scheduler.step() after optimizer.step()).", stacklevel=3)
            self._abandon()
        if not self._open:
            self._begin()
        for _, p, _ in self._names():
            if p.grad is not None and p not in self._handed:
                self._hand_over(p)
        stats = _optim.OverlapStats()
        status = _optim._step_end(self._fo._handle, self._comm_handle(), ctypes.byref(stats))
        self._open, self._handed = False, {}
        self.last_step_stats = dict(_stats_dict(stats), handed_over_in_backward=self._in_backward)
        check(status)

    def _overlap_zero_grad(self, set_to_none=True):
        """torch's zero_grad (overlap=True only: an instance attribute, so overlap=False keeps
        torch's own, which torch.compile knows). While an overlapped step is open (backward handed gradients
        over, step() not called yet) it abandons that step first: nothing is changed, as
        torch drops those gradients."""
        if self._open:
            self._abandon()
        type(self).zero_grad(self, set_to_none=set_to_none)

    def remove_hooks(self):
        """Removes the post-accumulate-grad hooks overlap=True registered (the optimizer then
        steps as with overlap=False); an open step is abandoned first."""
        if self._open:
            self._abandon()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._ov = dict(self._ov, overlap=False)
        self.__dict__.pop("zero_grad", None)


def _stats_dict(st):
    out = {f: getattr(st, f) for f, _ in _optim.OverlapStats._fields_}
    out["clipped"] = bool(out["clipped"])
    return out
