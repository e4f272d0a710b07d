"""fo.torch's clip: `fo.torch.clip_grad_norm_` (torch's function through fo's FSDP2-safe norm)
and the optimizer-side clip (`max_grad_norm=`, `norm_type=`, `error_if_nonfinite=`).

Clipping is an optimizer argument (`max_grad_norm`, `norm_type`, `error_if_nonfinite`),
since the step starts before the user could call `clip_grad_norm_`; it means the same with
`overlap=False` (fo's `fo_clip_grad_norm` over the gradients in param-group order, then the
step), so both modes follow the same trajectory bit for bit. DTensor parameters count as
shards in the norm when a placement is `Shard`/`_StridedShard`; the norm is combined over
torch.distributed's default group (through CUDA tensors where that group is NCCL alone).

CUDA gradients are summed and scaled by fo's kernels on the clip comm's stream
(`fo_comm_set_stream`), which is set to torch's current stream of their device before each
clip, so the norm reads them after backward's work; gradients on several CUDA devices are
clipped on their default streams only (fo._torch_cuda.choose_stream). In the overlapped
step, fo takes the norm at `step_end` (fo._torch_overlap).

Only `fo.torch` imports this module (it needs torch)."""
import ctypes

import torch

from . import comm as _comm
from ._ffi import check
from ._torch_args import UNSUPPORTED, TorchArg, error, is_dtensor, local
from ._torch_cuda import choose_stream


def _is_shard(t):
    """Whether a gradient (or its parameter) `t` is a shard in the clip norm: a DTensor with a
    `Shard`/`_StridedShard` placement (fo's shard spec says the same)."""
    return is_dtensor(t) and any(pl.is_shard() for pl in t.placements)


def _collective_device():
    """Where torch.distributed's default group takes tensors for the norm's collectives: a
    group with NCCL alone takes CUDA tensors only ("cpu:gloo,cuda:nccl" and gloo take host
    ones), so fo's host values travel through a CUDA tensor there."""
    dist = torch.distributed
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _torch_comm():
    """An fo Comm over torch.distributed's default group (the clip norm's all-reduce)."""
    dist = torch.distributed
    dev = _collective_device()

    def through(buf, collective):
        t = torch.from_numpy(buf)
        if dev is None:
            collective(t)
        else:
            on = t.to(dev)
            collective(on)
            t.copy_(on.cpu())

    def broadcast(buf, root):
        if buf.size:
            through(buf, lambda t: dist.broadcast(t, src=root))

    def all_reduce_f64(vals, op):
        if vals.size:
            red = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
            through(vals, lambda t: dist.all_reduce(t, op=red))

    return _comm.Comm.from_callbacks(dist.get_rank(), dist.get_world_size(), broadcast, all_reduce_f64,
                                     dist.barrier)


_DEFAULT = {}  # (rank, world size, the default group) -> the fo Comm over it


def default_comm():
    """fo's Comm for the clip norm: over torch.distributed's default group where one with
    several ranks is live (made once per group), else this rank alone."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return _comm.Comm.local_group(1)[0]
    key = (dist.get_rank(), dist.get_world_size(), id(dist.group.WORLD))
    if key not in _DEFAULT:
        _DEFAULT.clear()  # a group destroyed and made again: the old comm goes
        _DEFAULT[key] = _torch_comm()
    return _DEFAULT[key]


def _clip(comm, grads, max_norm, norm_type, error_if_nonfinite):
    """fo_clip_grad_norm over `grads` ((TorchArg, is_shard) in a fixed order, the same on
    every rank); CUDA ones are summed and scaled on the current stream of their device.
    Returns the total norm (f64)."""
    devices = {a.struct.device: torch.cuda.current_stream(a.struct.device).cuda_stream
               for a, _ in grads if a.struct.device >= 0}
    if devices:
        # fo sums and scales CUDA gradients on the comm's stream, after the work queued
        # there: the stream backward left them on, chosen as the step's (fo._torch_cuda)
        comm.set_stream(choose_stream(devices))
    arr = (_comm._Grad * max(len(grads), 1))(*[_comm._Grad(a.struct, int(s)) for a, s in grads])
    total = ctypes.c_double()
    check(_comm._clip(comm._h, arr, len(grads), float(max_norm), float(norm_type), int(bool(error_if_nonfinite)),
                      ctypes.byref(total)))
    return total.value


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """`torch.nn.utils.clip_grad_norm_` through fo's FSDP2-safe norm: the gradients of
    `parameters` (a tensor or an iterable; those without `.grad` skipped) are scaled in place
    by `max_norm / (total + 1e-6)` when the total norm exceeds `max_norm`. DTensor gradients
    count by placement: `Shard` ones are summed across torch.distributed's default group
    (uneven and empty shards included), `Replicate` ones once; host and CUDA gradients may
    mix (CUDA ones summed and scaled by fo's kernels on their current stream, only partial
    sums coming to the host). The total is accumulated in f64 in a fixed order, the same
    bits on every rank and device. Returns it as torch does, a 0-dim float32 tensor (on the
    first gradient's device; the global norm, never a DTensor). Every rank must call it, in
    the same parameter order, with or without gradients. `foreach` is accepted and changes
    nothing; `error_if_nonfinite=True` raises (fo's FO_ERR_NUMERICS, a RuntimeError) and
    scales nothing when the total is NaN or inf."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    for g in grads:
        if is_dtensor(g) and any(pl.is_partial() for pl in g.placements):
            raise error(UNSUPPORTED, f"a gradient of shape {tuple(g.shape)} has a Partial placement "
                                     f"({g.placements}); reduce it first (its norm is not its shards')")
    args = [(TorchArg(g, f"gradient {i} (shape {tuple(g.shape)})", empty_non_null=True), _is_shard(g))
            for i, g in enumerate(grads)]
    total = _clip(default_comm(), args, max_norm, norm_type, error_if_nonfinite)
    device = local(grads[0]).device if grads else torch.device("cpu")
    return torch.tensor(total, dtype=torch.float32, device=device)


class Clip:
    """Mixed into fo.torch's optimizers (which provide `_ov` and `_names`; fo._torch_overlap's
    `_overlap_init` sets `_clip_comm = None`)."""

    # -- the comm for the clip norm ---------------------------------------------------
    def _comm(self):
        if self._clip_comm is None:
            self._clip_comm = default_comm()
        return self._clip_comm

    def _comm_handle(self):
        """The comm step_end combines the norm through (None: this rank alone)."""
        return self._comm()._h if self._ov["max_grad_norm"] is not None else None

    # -- overlap=False with max_grad_norm: fo's clip, then the step ---------------------
    def _clip_now(self):
        """fo_clip_grad_norm over every gradient in param-group order (scaled in place when
        the total exceeds max_grad_norm), as the overlapped step combines them."""
        o = self._ov
        args = [(TorchArg(p.grad, f"gradient of parameter {name}", empty_non_null=True), _is_shard(p))
                for _, p, name in self._names() if p.grad is not None]
        total = _clip(self._comm(), args, o["max_grad_norm"], o["norm_type"], o["error_if_nonfinite"])
        clipped = o["max_grad_norm"] / (total + 1e-6) < 1
        self.last_step_stats = {"total_norm": total, "clipped": clipped}
