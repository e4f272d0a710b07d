"""fo.torch's optimizer-side clip (`max_grad_norm=`, `norm_type=`, `error_if_nonfinite=`).

Clipping is an optimizer argument (`max_grad_norm`, `norm_type`, `error_if_nonfinite`),
since the step starts before the user could call `clip_grad_norm_`; it means the same with
`overlap=False` (fo's `fo_clip_grad_norm` over the gradients in param-group order, then the
step), so both modes follow the same trajectory bit for bit. DTensor parameters count as
shards in the norm when a placement is `Shard`/`_StridedShard`; the norm is combined over
torch.distributed's default group.

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
from ._torch_args import TorchArg, is_dtensor
from ._torch_cuda import choose_stream


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


class Clip:
    """Mixed into fo.torch's optimizers (which provide `_ov` and `_names`; fo._torch_overlap's
    `_overlap_init` sets `_clip_comm = None`)."""

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
        args, flags, devices = [], [], {}
        for _, p, name in self._names():
            if p.grad is not None:
                args.append(TorchArg(p.grad, f"gradient of parameter {name}", empty_non_null=True))
                flags.append(int(_is_shard(p)))
                if args[-1].struct.device >= 0:
                    devices[args[-1].struct.device] = torch.cuda.current_stream(args[-1].struct.device).cuda_stream
        arr = (_comm._Grad * max(len(args), 1))(*[_comm._Grad(a.struct, s) for a, s in zip(args, flags)])
        total = ctypes.c_double()
        if devices:
            # fo sums and scales CUDA gradients on the comm's stream, after the work queued
            # there: the stream backward left them on, chosen as the step's (fo._torch_cuda)
            self._comm().set_stream(choose_stream(devices))
        check(_comm._clip(self._comm()._h, arr, len(args), o["max_grad_norm"], o["norm_type"],
                          int(o["error_if_nonfinite"]), ctypes.byref(total)))
        clipped = o["max_grad_norm"] / (total.value + 1e-6) < 1
        self.last_step_stats = {"total_norm": total.value, "clipped": clipped}
