"""DTensor shard metadata: `wrap_uneven`, `shard_indices` and friends (torch's vocabulary)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

from . import _codes as C
from ._ffi import Placement as _Placement, ShardInfo as _ShardInfo, ShardSpecStruct, check, declare, i64p

REPLICATE, SHARD = C.FO_PLACEMENT_REPLICATE, C.FO_PLACEMENT_SHARD
STRIDED_SHARD, PARTIAL = C.FO_PLACEMENT_STRIDED_SHARD, C.FO_PLACEMENT_PARTIAL

_wrap_uneven = declare("fo_wrap_uneven", [ctypes.c_int32, i64p, ctypes.c_int32, i64p, i64p,
                                          ctypes.POINTER(_Placement), ctypes.POINTER(_ShardInfo)])
_shard_indices = declare("fo_shard_indices", [ctypes.c_int32, i64p, ctypes.c_int32, i64p, i64p,
                                              ctypes.POINTER(_Placement), ctypes.c_int32, i64p,
                                              ctypes.c_int64, i64p])
_padded = declare("fo_padded_shard_size", [ctypes.c_int64, ctypes.c_int64, i64p])
_grouped = declare("fo_grouped_placements", [ctypes.c_int32, ctypes.POINTER(_Placement),
                                             ctypes.POINTER(_Placement)])


def Replicate() -> _Placement:
    return _Placement(REPLICATE, 0, 0)


def Shard(dim: int) -> _Placement:
    return _Placement(SHARD, dim, 0)


def StridedShard(dim: int, split_factor: int) -> _Placement:
    """torch's `_StridedShard(dim, split_factor)`."""
    return _Placement(STRIDED_SHARD, dim, split_factor)


def Partial() -> _Placement:
    return _Placement(PARTIAL, 0, 0)


def placement(p: _Placement | str) -> _Placement:
    """A placement from a struct, or from the CLI spelling: "R", "P", "S0", "SS0:3"."""
    if isinstance(p, _Placement):
        return p
    s = str(p).strip()
    if s == "R":
        return Replicate()
    if s == "P":
        return Partial()
    if s.startswith("SS") and ":" in s:
        d, sf = s[2:].split(":", 1)
        return StridedShard(int(d), int(sf))
    if s.startswith("S"):
        return Shard(int(s[1:]))
    raise ValueError(f"placement {p!r} is not one of R, P, S<dim>, SS<dim>:<split_factor>")


@dataclass
class ShardInfo:
    local_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_stride: tuple[int, ...]
    is_box: bool


class ShardSpec:
    """Global shape, mesh, coordinate and placements; `.struct` is the C fo_shard_spec
    (valid while this object lives)."""

    def __init__(self, global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
                 placements: Sequence[_Placement | str]) -> None:
        self.global_shape = tuple(int(x) for x in global_shape)
        self.mesh_shape = tuple(int(x) for x in mesh_shape)
        self.coord = tuple(int(x) for x in coord)
        self.placements = [placement(p) for p in placements]
        self._shape = (ctypes.c_int64 * max(len(self.global_shape), 1))(*self.global_shape)
        self._mesh = (ctypes.c_int64 * max(len(self.mesh_shape), 1))(*self.mesh_shape)
        self._coord = (ctypes.c_int64 * max(len(self.coord), 1))(*self.coord)
        self._pl = (_Placement * max(len(self.placements), 1))(*self.placements)
        self.struct = ShardSpecStruct(len(self.global_shape), ctypes.cast(self._shape, i64p),
                                      len(self.mesh_shape), ctypes.cast(self._mesh, i64p),
                                      ctypes.cast(self._coord, i64p),
                                      ctypes.cast(self._pl, ctypes.POINTER(_Placement)))

    def _args(self):
        s = self.struct
        return (s.ndim, s.global_shape, s.mesh_ndim, s.mesh_shape, s.coord, s.placements)

    def info(self) -> ShardInfo:
        out = _ShardInfo()
        check(_wrap_uneven(*self._args(), ctypes.byref(out)))
        n = out.ndim
        return ShardInfo(tuple(out.local_shape[:n]), tuple(out.global_offset[:n]),
                         tuple(out.global_shape[:n]), tuple(out.global_stride[:n]), bool(out.is_box))

    def indices(self, dim: int) -> list[int]:
        # Ask for the count first (a too-small buffer still reports it; -1 stays when the
        # arguments themselves are bad), then allocate exactly that: a count no list can
        # hold raises the library's own FoError, not a MemoryError.
        n = ctypes.c_int64(-1)
        status = _shard_indices(*self._args(), dim, None, 0, ctypes.byref(n))
        if n.value <= 0:
            check(status)
            return []
        try:
            buf = (ctypes.c_int64 * n.value)()
        except (MemoryError, OverflowError):
            check(status)
        check(_shard_indices(*self._args(), dim, ctypes.cast(buf, i64p), n.value, ctypes.byref(n)))
        return list(buf[:n.value])


def wrap_uneven(global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
                placements: Sequence[_Placement | str]) -> ShardInfo:
    """`compute_local_shape_and_global_offset` with PyTorch 2.15's semantics."""
    return ShardSpec(global_shape, mesh_shape, coord, placements).info()


def shard_indices(global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
                  placements: Sequence[_Placement | str], dim: int) -> list[int]:
    """The sorted global indices `coord` holds along `dim`."""
    return ShardSpec(global_shape, mesh_shape, coord, placements).indices(dim)


def padded_shard_size(length: int, world: int) -> int:
    out = ctypes.c_int64(0)
    check(_padded(length, world, ctypes.byref(out)))
    return out.value


def grouped_placements(placements: Sequence[_Placement | str]) -> list[_Placement]:
    """Placements for a stacked (num_gemms, out, in) weight: Shard(d) -> Shard(d+1)."""
    pl = [placement(p) for p in placements]
    src = (_Placement * len(pl))(*pl)
    dst = (_Placement * len(pl))()
    check(_grouped(len(pl), src, dst))
    return list(dst)


