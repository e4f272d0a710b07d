"""Distributed checkpoints of optimizer state: `fo_state_pack` (and its packed view),
save, load with resharding, consolidate, verify. Torch's vocabulary: FQNs, `exp_avg`,
`param_groups`, `saved_offsets`.

    fo.ckpt.save(opt, "ckpt/", rank=r, world_size=n, mode="compressed", save_id="step100")
    pending = fo.ckpt.save_async(opt, "ckpt/", save_id="step200")  # returns at once
    opt.step(grads)                                  # the save still holds the call's state
    pending.wait()                                   # raises FoError if the save failed
    report = fo.ckpt.load(opt2, "ckpt/")            # any sharding of the same params
    fo.ckpt.consolidate("ckpt/", "full/")            # one safetensors file + index
    fo.ckpt.convert("ckpt/", "ckpt-3r/", ranks=3)   # offline reshard (and/or to="portable")
    fo.ckpt.diff("ckpt/", "ckpt-3r/")["equal"]      # key by key, any shardings: True
    sd = fo.ckpt.torch_state_dict("ckpt/")          # torch's nested layout: torch_opt.load_state_dict(sd)
"""
from __future__ import annotations

import ctypes
import json
import os
from typing import Any, Union

import numpy as np

from . import _codes as C
from . import layout
from ._ffi import MAX_DIMS, FoError, Owned, Placement, check, declare
from .optim import Optimizer, _string, numpy_dtype
from .shard import placement as _placement

PathLike = Union[str, bytes, "os.PathLike[str]"]

MODES = C.codes("FO_PACK_MODE_")  # {"compressed": ..., "portable": ...}
PARAMS = {None: C.FO_PACK_PARAMS_NONE, "stored": C.FO_PACK_PARAMS_STORED, "master": C.FO_PACK_PARAMS_MASTER}


class PackOptions(ctypes.Structure):
    _fields_ = [("rank", ctypes.c_int32), ("world_size", ctypes.c_int32), ("mode", ctypes.c_int32),
                ("params", ctypes.c_int32), ("write_unsharded", ctypes.c_int32), ("save_id", ctypes.c_char_p)]


class PackedEntry(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("key", ctypes.c_char_p), ("dtype", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("shape", ctypes.c_int64 * MAX_DIMS), ("global_shape", ctypes.c_int64 * MAX_DIMS),
                ("global_offset", ctypes.c_int64 * MAX_DIMS), ("data", ctypes.c_void_p), ("nbytes", ctypes.c_uint64)]


class LoadOptions(ctypes.Structure):
    _fields_ = [("strict", ctypes.c_int32), ("params", ctypes.c_int32), ("param_groups", ctypes.c_int32)]


class LoadReport(ctypes.Structure):
    _fields_ = [("loaded", ctypes.c_int64), ("missing", ctypes.c_int64), ("unexpected", ctypes.c_int64),
                ("requantized", ctypes.c_int64), ("json", ctypes.c_char_p), ("json_capacity", ctypes.c_size_t),
                ("json_len", ctypes.c_size_t)]


class SaveOptions(ctypes.Structure):
    _fields_ = [("pack", PackOptions), ("staging_budget_bytes", ctypes.c_uint64)]


class SaveStats(ctypes.Structure):
    _fields_ = [("done", ctypes.c_int32), ("bytes_written", ctypes.c_uint64), ("bytes_total", ctypes.c_uint64),
                ("staging_high_water", ctypes.c_uint64), ("staging_budget", ctypes.c_uint64),
                ("device_staged", ctypes.c_uint64), ("copies", ctypes.c_uint64)]


_P = ctypes.c_void_p
_szp = ctypes.POINTER(ctypes.c_size_t)
_pack = declare("fo_state_pack", [_P, ctypes.POINTER(PackOptions), ctypes.POINTER(_P)])
_num = declare("fo_packed_num_entries", [_P, _szp])
_entry = declare("fo_packed_get_entry", [_P, ctypes.c_size_t, ctypes.POINTER(PackedEntry)])
_meta = declare("fo_packed_metadata_json", [_P, ctypes.c_char_p, ctypes.c_size_t, _szp])
_psave = declare("fo_packed_save", [_P, ctypes.c_char_p])
_pdestroy = declare("fo_packed_destroy", [_P], None)
_save = declare("fo_state_save", [_P, ctypes.c_char_p, ctypes.POINTER(PackOptions)])
_save_comm = declare("fo_state_save_comm", [_P, ctypes.c_char_p, ctypes.POINTER(PackOptions), _P])
_save_async = declare("fo_state_save_async", [_P, ctypes.c_char_p, ctypes.POINTER(SaveOptions), _P, ctypes.POINTER(_P)])
_save_wait = declare("fo_save_wait", [_P, ctypes.c_double])
_save_poll = declare("fo_save_poll", [_P, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_uint64)])
_save_stats = declare("fo_save_stats_get", [_P, ctypes.POINTER(SaveStats)])
_save_destroy = declare("fo_save_destroy", [_P], None)
_load = declare("fo_state_load", [_P, ctypes.c_char_p, ctypes.POINTER(LoadOptions), ctypes.POINTER(LoadReport)])
_consolidate = declare("fo_checkpoint_consolidate", [ctypes.c_char_p, ctypes.c_char_p])
_verify = declare("fo_checkpoint_verify", [ctypes.c_char_p])
_info = declare("fo_checkpoint_info_json", [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, _szp])


class ConvertOptions(ctypes.Structure):
    _fields_ = [("to", ctypes.c_int32), ("ranks", ctypes.c_int32), ("mesh_ndim", ctypes.c_int32),
                ("mesh", ctypes.POINTER(ctypes.c_int64)), ("num_placements", ctypes.c_int32),
                ("placements", ctypes.POINTER(Placement)), ("force", ctypes.c_int32)]


CONVERT_FORMATS = {None: C.FO_CONVERT_FORMAT_KEEP, "portable": C.FO_CONVERT_FORMAT_PORTABLE,
                   "compressed": C.FO_CONVERT_FORMAT_COMPRESSED}
_cstr = ctypes.POINTER(ctypes.c_char)
_convert = declare("fo_checkpoint_convert", [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ConvertOptions)])
_diff = declare("fo_checkpoint_diff_json", [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_double, ctypes.c_double,
                                             ctypes.POINTER(_cstr)])
_string_free = declare("fo_string_free", [_cstr], None)


def _options(rank, world_size, mode, params, write_unsharded, save_id):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    if params not in PARAMS:
        raise ValueError(f"params must be None, 'stored' or 'master', got {params!r}")
    # Passed through as given: the library accepts only FO_WRITE_UNSHARDED_RANK0 (None), 0 and 1,
    # so write_unsharded=5 is an error.
    w = C.FO_WRITE_UNSHARDED_RANK0 if write_unsharded is None else int(write_unsharded)
    return PackOptions(rank, world_size, MODES[mode], PARAMS[params], w, None if save_id is None else save_id.encode())


class Packed(Owned):
    """A rank's packed state: `entries()` lists its chunks (key, dtype, shapes, global
    offsets, data) for a host that writes them itself; `save(dir)` writes fo's file."""

    def _free(self, handle) -> None:
        _pdestroy(handle)

    def entries(self) -> list[dict[str, Any]]:
        n = ctypes.c_size_t(0)
        check(_num(self._handle, ctypes.byref(n)))
        out = []
        for i in range(n.value):
            e = PackedEntry()
            check(_entry(self._handle, i, ctypes.byref(e)))
            nd = e.ndim
            shape = tuple(e.shape[:nd])
            raw = ctypes.string_at(e.data, e.nbytes) if e.nbytes else b""
            data = np.frombuffer(raw, dtype=numpy_dtype(e.dtype)).reshape(shape).copy()
            out.append({"name": e.name.decode(), "key": e.key.decode(), "dtype": e.dtype, "shape": shape,
                        "global_shape": tuple(e.global_shape[:nd]), "global_offset": tuple(e.global_offset[:nd]),
                        "data": data})
        return out

    def metadata(self) -> dict[str, Any]:
        need = ctypes.c_size_t(0)
        _meta(self._handle, None, 0, ctypes.byref(need))
        buf = ctypes.create_string_buffer(need.value)
        check(_meta(self._handle, buf, need.value, ctypes.byref(need)))
        return json.loads(buf.value.decode())

    def save(self, directory: PathLike) -> None:
        check(_psave(self._handle, os.fsencode(directory)))


def pack(opt: Optimizer, rank: int = 0, world_size: int = 1, mode: str = "compressed", params: str | None = None,
         write_unsharded: bool | None = None, save_id: str | None = None) -> Packed:
    """`fo_state_pack`: the optimizer's local state as named chunks (no collectives)."""
    h = _P()
    o = _options(rank, world_size, mode, params, write_unsharded, save_id)
    check(_pack(opt._handle, ctypes.byref(o), ctypes.byref(h)))
    return Packed(h)


def save(opt: Optimizer, directory: PathLike, rank: int = 0, world_size: int = 1, mode: str = "compressed",
         params: str | None = None, write_unsharded: bool | None = None, save_id: str | None = None,
         comm=None) -> None:
    """Writes this rank's file `shard-{rank+1:05}-model-00001-of-00001.safetensors` of
    save `save_id` into `directory`'s staging area; the checkpoint becomes visible when
    the last rank finishes (commit record `fo-commit.json`). `save_id` is required when
    `world_size` > 1 unless `comm` (an `fo.comm.Comm`) is given: then rank 0's id (or a
    generated one) is agreed, rank 0 commits, and the call returns once committed."""
    o = _options(rank, world_size, mode, params, write_unsharded, save_id)
    if comm is None:
        check(_save(opt._handle, os.fsencode(directory), ctypes.byref(o)))
    else:
        check(_save_comm(opt._handle, os.fsencode(directory), ctypes.byref(o), comm._h))


class AsyncSave(Owned):
    """A save in flight (`fo_state_save_async`): `wait(timeout=None)` returns once the
    whole save (its commit included) is done and raises `FoError` if it failed (FO_ERR_TIMEOUT
    when `timeout` seconds pass first; the save goes on; None, `math.inf` or more than a
    week: no limit); `done()` and `bytes_written` never
    block; `stats()` adds the staging pool's high-water mark. It keeps the optimizer (and
    the communicator) alive until it is closed; closing frees the handle after waiting for
    the writer (a save with a communicator that was never waited for is not committed)."""

    def __init__(self, handle, opt, comm):
        super().__init__(handle)
        self._keep = (opt, comm)

    def _free(self, handle) -> None:
        _save_destroy(handle)

    def _release(self) -> None:
        self._keep = None

    def wait(self, timeout: float | None = None) -> None:
        if self._handle is None:
            raise ValueError("this AsyncSave is closed")
        check(_save_wait(self._handle, -1.0 if timeout is None else float(timeout)))

    def done(self) -> bool:
        """Whether the background work is over (then `wait` returns at once, apart from
        the commit collective of a save with a communicator)."""
        return bool(self.stats()["done"])

    @property
    def bytes_written(self) -> int:
        """Bytes of state the writer has taken so far."""
        return self.stats()["bytes_written"]

    def stats(self) -> dict[str, int]:
        if self._handle is None:
            raise ValueError("this AsyncSave is closed")
        st = SaveStats()
        check(_save_stats(self._handle, ctypes.byref(st)))
        return {name: int(getattr(st, name)) for name, _ in SaveStats._fields_}



def save_async(opt: Optimizer, directory: PathLike, rank: int = 0, world_size: int = 1, mode: str = "compressed",
               params: str | None = None, write_unsharded: bool | None = None, save_id: str | None = None,
               comm=None, staging_budget: int = 0) -> AsyncSave:
    """`save`, in the background: returns once a copy-on-write snapshot of the state is
    registered; the checkpoint holds the state as of this call, byte-identical to `save`'s,
    while `opt.step`, `set_state` and `load` go on. Until the save is waited for, change the
    params only through `opt.step` and register no new ones. The writer pauses while a step
    runs (steps lose little; the save completes between them). `staging_budget`: bytes the
    snapshot's copy pool may hold (0: the stored state the save writes, within half the
    available memory; a full pool makes the step wait for the
    writer; its buffers are kept for the optimizer's next save, within the budget). With `comm`, every rank calls this and `wait()` (the commit runs there); the ranks agree
    on their arguments here first, so a rank's bad argument or a different directory, mode
    or save id raises FO_ERR_INVALID_ARGUMENT on every rank, before anything is written.
    A second save of the same optimizer, or into the same directory from this process,
    waits until the first has committed (so the directory ends holding the newest save);
    while the first has a `comm` and was not waited for yet, it raises FoError
    FO_ERR_BUSY naming the first (wait for it, then save again)."""
    o = SaveOptions(_options(rank, world_size, mode, params, write_unsharded, save_id), int(staging_budget))
    h = _P()
    check(_save_async(opt._handle, os.fsencode(directory), ctypes.byref(o), None if comm is None else comm._h,
                      ctypes.byref(h)))
    return AsyncSave(h, opt, comm)


def load(opt: Optimizer, directory: PathLike, strict: bool = True, params: bool = False,
         param_groups: bool = True) -> dict[str, list[str]]:
    """Loads any checkpoint (fo's, or torch DCP HuggingFace files) into `opt`, resharded.
    Returns {"loaded": [...], "missing": [...], "unexpected": [...], "requantized": [...]}.
    On error (FoError) the optimizer is unchanged."""
    o = LoadOptions(int(strict), int(params), int(param_groups))
    cap = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(cap)
        rep = LoadReport(0, 0, 0, 0, ctypes.cast(buf, ctypes.c_char_p), cap, 0)
        check(_load(opt._handle, os.fsencode(directory), ctypes.byref(o), ctypes.byref(rep)))
        if rep.json_len <= cap:
            return json.loads(buf.value.decode())
        cap = rep.json_len  # the key names did not fit: load again (same result) with room


def consolidate(directory: PathLike, out_dir: PathLike) -> None:
    """One full safetensors file plus `model.safetensors.index.json` in `out_dir`."""
    check(_consolidate(os.fsencode(directory), os.fsencode(out_dir)))


def verify(directory: PathLike) -> None:
    """Raises FoError unless every checksum matches and every element is saved once."""
    check(_verify(os.fsencode(directory)))


def info(directory: PathLike) -> dict[str, Any]:
    """The table of contents of a checkpoint (fo's, or torch DCP HuggingFace files),
    validated as `load` validates it: {"mode", "param_groups" (both None for files fo did
    not write), "keys": {key: {"dtype", "shape", "compressed"}}}, a quant8 pair
    `K::quantized` + `K::scales` listed as the one key `K` (dtype "F32", what it decodes to)."""
    return json.loads(_string(_info, os.fsencode(directory)))


def torch_state_dict(source: Union[Any, str, os.PathLike[str]], key_by: str = "index", flatten: bool = False,
                     framework: str = "pt") -> dict[Any, Any]:
    """The optimizer state of `source` (an `fo.Optimizer`, or an fo checkpoint directory
    written by `fo.ckpt.save` on any number of ranks) in torch's layout.

    key_by: "index" (torch's `Optimizer.state_dict()`: params numbered group by group, what
    `optimizer.load_state_dict` takes) or "fqn" (`get_optimizer_state_dict`'s layout, what
    `set_optimizer_state_dict` takes). flatten=True gives the flattened form
    (`StateDictOptions(flatten_optimizer_state_dict=True)`; implies FQN keys).
    framework: "pt" (torch tensors) or "numpy". An optimizer gives its local shards; a
    checkpoint directory gives full (unsharded) tensors.
    """
    layout.check_options(key_by, flatten, framework)
    if isinstance(source, (str, os.PathLike)):
        groups, state = _checkpoint_state(source)
    else:
        groups, state = layout.optimizer_state(source)
    return layout.arrange(groups, state, key_by, flatten, framework)


def _checkpoint_state(directory):
    """Every rank's state of an fo checkpoint directory, assembled to full tensors and
    decoded to float32 by fo's loader (exact: dequantized with the groups it was saved with,
    whatever the saved sharding), then read back as from an optimizer."""
    # The library reads the committed save's files (validated) and names its keys: a
    # compressed pair is listed as its logical key, with the codes' global shape.
    try:
        toc = info(directory)
    except FoError as e:
        if e.status == C.FO_ERR_NOT_FOUND:
            raise FileNotFoundError(f"{directory}: no fo checkpoint files ({e.message})") from e
        raise
    if toc["mode"] is None:
        raise ValueError(f"{directory}: not written by fo (no `fo` metadata); torch's own files "
                         "already load with torch.distributed.checkpoint")
    groups = toc["param_groups"] or []
    shapes = {k: tuple(v["shape"]) for k, v in toc["keys"].items()}
    # A throwaway fp32 optimizer over zero params of the global shapes: loading into it runs
    # fo's resharding and dequantization, so the numbers are exactly what a load would give.
    opt = None
    keep = []
    for gi, g in enumerate(groups):
        hp = {k: g[k] for k in ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov",
                                "decouple_lr", "initial_lr") if k in g}
        alg = g["algorithm"].lower()
        if opt is None:
            opt = Optimizer(alg, state_format="fp32", master_weight_bits=0, **hp)
        else:
            opt.add_param_group(alg, state_format="fp32", master_weight_bits=0, **hp)
        for fqn in g["params"]:
            keys = (layout.state_key(fqn, n) for n in layout.STATE_NAMES[g["algorithm"]] if n != C.STEP)
            shape = next((shapes[k] for k in keys if k in shapes), None)
            if shape is None:
                continue  # never stepped: no state, as in torch
            w = np.zeros(shape, np.float32)
            keep.append(w)
            opt.add_param(fqn, w, group=gi)
    if opt is None or not keep:
        return groups, {}
    load(opt, directory, strict=False, params=False, param_groups=False)
    _, state = layout.optimizer_state(opt)
    return groups, state


def convert(src: PathLike, dst: PathLike, to: str | None = None, ranks: int | None = None,
            mesh: "list[int] | None" = None, placements: "list[Any] | None" = None, force: bool = False) -> None:
    """Converts checkpoint `src` (fo's or torch DCP HuggingFace files, sharded or
    consolidated) into directory `dst`, offline: resharded onto `ranks` ranks or a `mesh`
    with one placement per mesh dim (`fo.shard.Shard(0)`, or the CLI's spelling "S0", "R",
    "SS0:2"; default Shard(0) everywhere), moments `to` "portable" (f32) or "compressed"
    (quant8), default as in `src`. `dst` must not exist or be empty unless `force`; on
    error (FoError) nothing is left at `dst`. `fo ckpt convert` runs the same code."""
    if to not in CONVERT_FORMATS:
        raise ValueError(f"to must be None, 'portable' or 'compressed', got {to!r}")
    dims = [int(d) for d in mesh] if mesh is not None else []
    pls = [_placement(p) for p in placements] if placements is not None else []
    mesh_arr = (ctypes.c_int64 * max(len(dims), 1))(*dims)
    pl_arr = (Placement * max(len(pls), 1))(*pls)
    o = ConvertOptions(CONVERT_FORMATS[to], 0 if ranks is None else int(ranks), len(dims), mesh_arr, len(pls),
                       pl_arr, int(bool(force)))
    check(_convert(os.fsencode(src), os.fsencode(dst), ctypes.byref(o)))


def diff(a: PathLike, b: PathLike, rtol: float = 0.0, atol: float = 0.0) -> dict[str, Any]:
    """Compares checkpoints `a` and `b` (directories of any sharding, consolidated ones or
    .safetensors files; quant8 state as its dequantized values) key by key: {"a", "b",
    "rtol", "atol", "keys": [{"key", "status", "shape", "numel", "max_abs", "max_rel",
    "out_of_tolerance", "reason"}], "keys_compared", "keys_differing", "equal"}. status is
    "equal", "within" (|a - b| <= atol + rtol * |b|), "differs", "mismatch" (shapes) or
    "missing" (one side only). `fo ckpt diff --json` prints the same report."""
    out = _cstr()
    check(_diff(os.fsencode(a), os.fsencode(b), float(rtol), float(atol), ctypes.byref(out)))
    try:
        return json.loads(ctypes.string_at(out).decode())
    finally:
        _string_free(out)
