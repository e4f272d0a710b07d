"""torch tensors as fo_tensor structs, zero-copy, and DTensor placements as fo shard specs.

Only `fo.torch` imports this module (it needs torch)."""
import ctypes

import torch

from ._codes import FO_DEVICE_HOST, FO_ERR_DTYPE, FO_ERR_INVALID_ARGUMENT, FO_ERR_UNSUPPORTED
from ._ffi import DTYPE_CODES, FoError, Tensor, i64p, lib
from .shard import Partial, Replicate, Shard, ShardSpec, StridedShard

try:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # torch built without distributed
    DTensor = _StridedShard = None

_CODES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
          torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
          torch.bool: "bool", torch.float8_e4m3fn: "f8_e4m3", torch.float8_e5m2: "f8_e5m2"}
# fo reads nothing through an empty tensor's pointer but takes NULL as "no gradient", so an
# empty local shard (a rank past the end of an uneven dim) points here instead.
_EMPTY = ctypes.create_string_buffer(16)
_EMPTY_ADDRESS = ctypes.addressof(_EMPTY)

INVALID_ARGUMENT, DTYPE, UNSUPPORTED = FO_ERR_INVALID_ARGUMENT, FO_ERR_DTYPE, FO_ERR_UNSUPPORTED


def error(status, message):
    """The FoError fo itself would raise for `status` (named by fo_status_name, the one table)."""
    return FoError(status, lib.fo_status_name(status).decode(), message)


def is_dtensor(t):
    return DTensor is not None and isinstance(t, DTensor)


def local(t):
    """The tensor whose memory fo touches: a DTensor's local shard, else `t` itself."""
    return t._local_tensor if is_dtensor(t) else t


def version(p):
    """What moves when p is edited in place: its own version counter and its local tensor's.
    A DTensor's in-place op (`p.mul_`, a model's load_state_dict) bumps the DTensor's counter
    only, its local tensor being written below autograd, while a write into `p.to_local()`
    bumps the local tensor's only; for a plain tensor the two are one."""
    return p._version, local(p)._version


def device_code(t, what):
    """fo's `device` for torch tensor `t` (a local tensor): FO_DEVICE_HOST on the CPU, the
    ordinal on CUDA; any other device (meta, mps, xpu...) is fo's UNSUPPORTED naming `what`."""
    dev = t.device
    if dev.type == "cpu":
        return FO_DEVICE_HOST
    if dev.type == "cuda":
        return dev.index  # a CUDA tensor's device always has its ordinal
    raise error(UNSUPPORTED, f"{what} is on {dev}; fo steps host (CPU) and CUDA tensors only "
                             "(move it to cpu or cuda)")


def group_names(group, gi):
    """The names fo.torch gives param group `gi`'s parameters (in errors, and to `offload=`'s
    predicate): `param_names` of a named group, else `param_groups[gi].params[j]`."""
    names = group.get("param_names")
    return [names[j] if names else f"param_groups[{gi}].params[{j}]" for j in range(len(group["params"]))]


class TorchArg:
    """An fo_tensor over a torch tensor's memory: its data_ptr(), dtype, shape and strides
    exactly as torch holds them. Keeps the memory and the shape/stride arrays alive: it holds
    an alias of the tensor (`detach()`: the same storage, its own tensor object), so fo's
    pointer stays valid when the tensor itself is given new storage (`p.data = ...`,
    `module.to(...)`) while fo may still read or write it (an overlapped step's pool; the
    registration until fo registers the parameter again, at the next step)."""

    def __init__(self, t, what, empty_non_null=False):
        t = local(t)
        device = device_code(t, what)
        code = _CODES.get(t.dtype)
        if code is None:
            raise error(DTYPE, f"{what} has dtype {t.dtype}, which fo has no code for")
        self.tensor = t.detach()
        nd = t.dim()
        self._shape = (ctypes.c_int64 * max(nd, 1))(*t.shape)
        self._strides = (ctypes.c_int64 * max(nd, 1))(*t.stride())
        ptr = t.data_ptr() if t.numel() else (ctypes.addressof(_EMPTY) if empty_non_null else None)
        self.struct = Tensor(ptr, DTYPE_CODES[code], nd, ctypes.cast(self._shape, i64p),
                             ctypes.cast(self._strides, i64p), device)


def _placement(pl):
    if _StridedShard is not None and isinstance(pl, _StridedShard):
        return StridedShard(pl.dim, int(pl.split_factor))
    if pl.is_shard():
        return Shard(pl.dim)
    if pl.is_replicate():
        return Replicate()
    if pl.is_partial():
        return Partial()
    raise error(UNSUPPORTED, f"placement {pl!r} has no fo equivalent")


def shard_spec(p, what):
    """fo's ShardSpec for a DTensor parameter: global shape, mesh shape, this rank's mesh
    coordinate and placements (uneven and strided shards as torch lays them out)."""
    mesh = p.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise error(INVALID_ARGUMENT, f"{what}: this rank is not in the parameter's device mesh")
    return ShardSpec(tuple(p.shape), tuple(mesh.shape), tuple(coord), [_placement(x) for x in p.placements])


def like_param(t, p):
    """`t` (a local tensor shaped like p's local shard) as p is: a DTensor with p's mesh,
    placements, global shape and stride when p is one."""
    if not is_dtensor(p):
        return t
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


class GradArray:
    """The fo_tensor array a step passes its gradients in, kept across steps: a slot is
    configured (dtype, device, shape/stride arrays) when its gradient's layout differs from
    the slot's last one, and otherwise a step writes only its data pointer, so the per-step
    marshalling is one key compare and one field write per gradient (building a TorchArg
    per gradient was ~3 us each, most of the Python side of a step)."""

    def __init__(self, n):
        self.n = n
        self.array = (Tensor * max(n, 1))()
        self._layout = [None] * n  # slot -> (dtype, device, shape, strides) it is configured for
        self._dims = [None] * n  # slot -> the c arrays its shape/strides pointers point at
        self._empty = [False] * n  # slot -> its gradients hold no element
        self._keep = [None] * n  # the tensors whose memory the slots point at, for the call

    def set(self, i, g, name):
        """Slot i passes gradient g of the parameter named `name` (for errors). fo's kernels
        read a CUDA gradient contiguous: a strided one (a channels_last convolution's, whose
        parameter steps through a stand-in, fo._torch_strided) passes a contiguous copy made
        on the current stream, which fo steps on, and kept for the call."""
        t = g._local_tensor if DTensor is not None and isinstance(g, DTensor) else g
        if t.is_cuda and not t.is_contiguous():
            t = t.contiguous()
        layout = (t.dtype, t.device, t.shape, t.stride())
        if layout != self._layout[i]:
            self._configure(i, t, layout, f"gradient of parameter {name}")
        self.array[i].data = _EMPTY_ADDRESS if self._empty[i] else t.data_ptr()
        self._keep[i] = t

    def _configure(self, i, t, layout, what):
        dtype, dev, shape, strides = layout
        code = _CODES.get(dtype)
        # the host's code or a CUDA ordinal (fo checks that a gradient lies on its
        # parameter's device, naming it)
        device = FO_DEVICE_HOST if dev.type == "cpu" else (dev.index if dev.type == "cuda" else None)
        if device is None or code is None:
            TorchArg(t, what)  # raises the error naming the gradient
        nd = len(shape)
        cs, ct = (ctypes.c_int64 * max(nd, 1))(*shape), (ctypes.c_int64 * max(nd, 1))(*strides)
        self._dims[i] = (cs, ct)
        e = self.array[i]
        e.dtype = DTYPE_CODES[code]
        e.ndim = nd
        e.shape, e.strides = ctypes.cast(cs, i64p), ctypes.cast(ct, i64p)
        e.device = device
        self._empty[i] = t.numel() == 0
        self._layout[i] = layout

    def clear(self, i):
        """Slot i passes no gradient (NULL data)."""
        self.array[i].data = None
        self._keep[i] = None

    def release(self):
        """Drops the references to this step's gradients (the slots' pointers go stale)."""
        self._keep = [None] * self.n
