"""`fo_comm`, `fo_broadcast_state_dict` and `fo_clip_grad_norm` through ctypes.

A `Comm` is one rank's communicator: an in-process group (threads), the host's own
collectives as Python callables (torch.distributed, MPI, a test's pipes), or NCCL.
Callables receive numpy views of fo's buffers and fill them in place; an exception in
a callable becomes FO_ERR_COMM naming the operation.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ._codes import FO_MAX_LOCAL_WORLD, FO_REDUCE_MAX, FO_REDUCE_SUM, codes
from ._ffi import Owned, Tensor, TensorArg, check, declare
from .shard import ShardSpec

SUM, MAX = FO_REDUCE_SUM, FO_REDUCE_MAX
STRATEGIES = codes("FO_BROADCAST_STRATEGY_")  # {"scatter": ..., "full_broadcast": ...}

_BCAST = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32)
_REDUCE = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_double), ctypes.c_size_t,
                           ctypes.c_int32)
_BARRIER = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p)
_SCATTER = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                            ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32)


class _Callbacks(ctypes.Structure):
    _fields_ = [("user", ctypes.c_void_p), ("broadcast", _BCAST), ("all_reduce_f64", _REDUCE),
                ("barrier", _BARRIER), ("scatter", _SCATTER)]


class _Source(ctypes.Structure):
    _fields_ = [("key", ctypes.c_char_p), ("tensor", Tensor)]


class _Dest(ctypes.Structure):
    _fields_ = [("key", ctypes.c_char_p), ("tensor", Tensor), ("spec", ctypes.c_void_p)]


class _Options(ctypes.Structure):
    _fields_ = [("allow_int_float_cast", ctypes.c_int32), ("strategy", ctypes.c_int32)]


class _Stats(ctypes.Structure):
    _fields_ = [("bytes_received", ctypes.c_uint64), ("table_bytes", ctypes.c_uint64),
                ("bytes_sent", ctypes.c_uint64), ("control_bytes", ctypes.c_uint64), ("tensors", ctypes.c_uint64)]


class _Grad(ctypes.Structure):
    _fields_ = [("tensor", Tensor), ("is_shard", ctypes.c_int32)]


_pp = ctypes.POINTER(ctypes.c_void_p)
_create_cb = declare("fo_comm_create_callbacks", [ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(_Callbacks), _pp])
MAX_LOCAL_WORLD = FO_MAX_LOCAL_WORLD
_create_local = declare("fo_comm_create_local_group", [ctypes.c_int32, ctypes.c_double, _pp])
_create_nccl = declare("fo_comm_create_nccl", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, _pp])
_destroy = declare("fo_comm_destroy", [ctypes.c_void_p], None)
_set_stream = declare("fo_comm_set_stream", [ctypes.c_void_p, ctypes.c_void_p])
_info = declare("fo_comm_info", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32)])
_broadcast_sd = declare("fo_broadcast_state_dict", [ctypes.c_void_p, ctypes.POINTER(_Source), ctypes.c_int64,
                                                    ctypes.POINTER(_Dest), ctypes.c_int64, ctypes.POINTER(_Options),
                                                    ctypes.POINTER(_Stats)])
_clip = declare("fo_clip_grad_norm", [ctypes.c_void_p, ctypes.POINTER(_Grad), ctypes.c_int64, ctypes.c_double,
                                      ctypes.c_double, ctypes.c_int32, ctypes.POINTER(ctypes.c_double)])


def _bytes_at(ptr, n):
    """A writable uint8 view of fo's buffer (an empty array for n == 0)."""
    if n == 0:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))


class Comm(Owned):
    """One rank's communicator. Close it (or let it be collected) when done."""

    def __init__(self, handle, keepalive=None):
        super().__init__(ctypes.c_void_p(handle))
        self._keepalive = keepalive
        self.last_callback_error = None
        r, w = ctypes.c_int32(), ctypes.c_int32()
        check(_info(self._h, ctypes.byref(r), ctypes.byref(w)))
        self.rank, self.world_size = r.value, w.value

    @classmethod
    def local_group(cls, world_size: int, timeout: float = 600.0) -> list[Comm]:
        """`world_size` handles talking through shared memory; use each from its own thread."""
        # Room for the handles only within the library's bound: it refuses other sizes
        # before writing, so a huge world_size is an FoError, not a huge allocation here.
        out = (ctypes.c_void_p * world_size)() if 1 <= world_size <= MAX_LOCAL_WORLD else None
        check(_create_local(world_size, timeout, out))
        return [cls(h) for h in out]

    @classmethod
    def from_nccl(cls, nccl_comm: int, cuda_stream: int, rank: int, world_size: int) -> Comm:
        """Over an existing ncclComm_t and cudaStream_t (integers); needs libfo built with `cuda`."""
        out = ctypes.c_void_p()
        check(_create_nccl(nccl_comm, cuda_stream, rank, world_size, ctypes.byref(out)))
        return cls(out.value)

    @classmethod
    def from_callbacks(cls, rank: int, world_size: int, broadcast: Callable[..., None],
                       all_reduce_f64: Callable[..., None], barrier: Callable[[], None],
                       scatter: Callable[..., None] | None = None) -> Comm:
        """The host's collectives as Python callables, each filling numpy arrays in place:
        `broadcast(buf: uint8 array, root)`, `all_reduce_f64(vals: float64 array, op)` with
        op `"sum"` or `"max"` (max must propagate NaN), `barrier()`, and optionally
        `scatter(parts, recv, root)`: root gets `parts` (one uint8 array per rank, else
        None) and every rank fills `recv` with its part."""
        holder: dict[str, Any] = {}

        def guarded(name, fn):
            def run(*args):
                try:
                    fn(*args)
                    return 0
                except BaseException as e:  # noqa: BLE001 - reported through fo as FO_ERR_COMM
                    comm = holder.get("comm")
                    if comm is not None:
                        comm.last_callback_error = e
                    return 1
            return run

        b = guarded("broadcast", lambda u, p, n, root: broadcast(_bytes_at(p, n), root))
        r = guarded("all_reduce_f64", lambda u, p, n, op: all_reduce_f64(
            np.ctypeslib.as_array(p, (n,)) if n else np.empty(0), "sum" if op == SUM else "max"))
        ba = guarded("barrier", lambda u: barrier())

        def sc(u, bufs, lens, recv, n, root):
            parts = None
            if bufs:
                parts = [_bytes_at(bufs[i], lens[i]) for i in range(world_size)]
            scatter(parts, _bytes_at(recv, n), root)

        fns = (_BCAST(b), _REDUCE(r), _BARRIER(ba), _SCATTER(guarded("scatter", sc)) if scatter else _SCATTER())
        table = _Callbacks(None, *fns)
        out = ctypes.c_void_p()
        check(_create_cb(rank, world_size, ctypes.byref(table), ctypes.byref(out)))
        comm = cls(out.value, keepalive=fns)
        holder["comm"] = comm
        return comm

    def set_stream(self, cuda_stream: int) -> None:
        """The CUDA stream (an integer `cudaStream_t`, 0: the legacy default stream) on which
        `clip_grad_norm` and `broadcast_state_dict` use device tensors, after the work queued
        there: torch's `torch.cuda.current_stream(device).cuda_stream`. A NCCL communicator
        starts with its own stream. A non-zero stream needs libfo built with `cuda`."""
        check(_set_stream(self._h, cuda_stream or None))

    @property
    def _h(self):
        """The handle for fo calls (NULL once closed: fo then refuses it by name)."""
        return self._handle if self._handle is not None else ctypes.c_void_p()

    def _free(self, handle) -> None:
        _destroy(handle)


def _arg(a):
    return a if isinstance(a, TensorArg) else TensorArg(np.asarray(a))


def broadcast_state_dict(comm: Comm, full: Mapping[str, Any] | None, dests: Mapping[str, Any],
                         allow_int_float_cast: bool = False, strategy: str = "scatter") -> dict[str, int]:
    """Fill `dests` on every rank from rank 0's `full` ({key: array}; ignored elsewhere).

    `dests` maps key -> array (a whole tensor, e.g. a buffer) or (array, ShardSpec) for
    this rank's shard. Arrays are written in place, and only when every rank succeeded.
    Any array may also be an `fo.TensorArg` (e.g. `TensorArg(int16_view, dtype="bf16")`
    for bfloat16 data without ml_dtypes).
    Returns the stats as a dict (bytes_received, table_bytes, bytes_sent, ...)."""
    keep = []
    src_arr = None
    n_full = 0
    if full is not None:
        src = []
        for k, a in full.items():
            t = _arg(a)
            keep.append(t)
            src.append(_Source(k.encode(), t.struct))
        n_full = len(src)
        src_arr = (_Source * max(n_full, 1))(*src)
    dst = []
    for k, v in dests.items():
        arr, spec = (v if isinstance(v, tuple) else (v, None))
        if spec is not None and not isinstance(spec, ShardSpec):
            raise TypeError(f"dests[{k!r}]: expected (array, fo.ShardSpec), got a {type(spec).__name__}")
        t = _arg(arr)
        keep.append((t, spec))
        dst.append(_Dest(k.encode(), t.struct, ctypes.cast(ctypes.byref(spec.struct), ctypes.c_void_p) if spec else None))
    dst_arr = (_Dest * max(len(dst), 1))(*dst)
    opts = _Options(int(bool(allow_int_float_cast)), STRATEGIES[strategy])
    stats = _Stats()
    check(_broadcast_sd(comm._h, src_arr, n_full, dst_arr, len(dst), ctypes.byref(opts), ctypes.byref(stats)))
    return {f[0]: getattr(stats, f[0]) for f in _Stats._fields_}


def clip_grad_norm(comm: Comm, grads: Sequence[tuple[np.ndarray, bool]], max_norm: float, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False) -> float:
    """The FSDP2-safe global norm: `grads` is a list of (array, is_shard). Shards' |g|^p
    sum across ranks, replicated ones count once; arrays are scaled in place when the
    total exceeds `max_norm`. Every rank must call it (with or without gradients)."""
    keep = [TensorArg(a) for a, _ in grads]
    arr = (_Grad * max(len(grads), 1))(*[_Grad(t.struct, int(bool(s))) for t, (_, s) in zip(keep, grads)])
    total = ctypes.c_double()
    check(_clip(comm._h, arr, len(grads), float(max_norm), float(norm_type), int(bool(error_if_nonfinite)),
                ctypes.byref(total)))
    return total.value
