"""The optimizer step (`fo_optimizer_*`): numpy arrays are registered as parameters and
updated in place. Vocabulary as in torch: param groups, `exp_avg`, `step`, FQNs.

    opt = fo.Optimizer("adamw", lr=1e-3, state_format="quant8", master_weight_bits=24)
    i = opt.add_param("fc1.weight", w)          # w: float32 / float16 / bfloat16 array
    opt.step([g])                                # None for a parameter without grad
    opt.get_state(i, "exp_avg")                  # decoded float32
"""
from __future__ import annotations

import ctypes
import json
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from . import _codes as C
from ._ffi import MAX_DIMS, Owned, ShardSpecStruct, Tensor, TensorArg, check, declare, lib, tensor_array

if TYPE_CHECKING:
    from .shard import ShardSpec

ALGORITHMS = C.codes("FO_ALGORITHM_")  # {"adamw": FO_ALGORITHM_ADAMW, ...}
STATE_FORMATS = C.codes("FO_STATE_FORMAT_")  # {"fp32": ..., "quant8_wide": ...}
ARITHMETIC = C.codes("FO_ARITHMETIC_")  # {"exact": ..., "fast": ...}
_NUMPY_OF_CODE = {C.FO_DTYPE_F32: np.float32, C.FO_DTYPE_F16: np.float16, C.FO_DTYPE_F64: np.float64,
                  C.FO_DTYPE_I8: np.int8, C.FO_DTYPE_U8: np.uint8, C.FO_DTYPE_I16: np.int16,
                  C.FO_DTYPE_I32: np.int32, C.FO_DTYPE_I64: np.int64}


def numpy_dtype(code: int) -> Any:
    """The numpy dtype for an fo dtype code. bfloat16 needs the `ml_dtypes` package, imported
    only here, so `import fo` works without it (torch users, f32/f16-only users)."""
    if code == C.FO_DTYPE_BF16:
        try:
            import ml_dtypes
        except ImportError as e:
            raise ImportError("reading bfloat16 data into numpy needs the ml_dtypes package "
                              "(pip install ml_dtypes)") from e
        return ml_dtypes.bfloat16
    if code not in _NUMPY_OF_CODE:
        raise ValueError(f"fo dtype code {code} has no numpy equivalent")
    return _NUMPY_OF_CODE[code]


class OptimConfig(ctypes.Structure):
    """`fo_optim_config`, field for field."""
    _fields_ = [("algorithm", ctypes.c_int32), ("lr", ctypes.c_double), ("beta1", ctypes.c_double),
                ("beta2", ctypes.c_double), ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double),
                ("momentum", ctypes.c_double), ("dampening", ctypes.c_double), ("nesterov", ctypes.c_int32),
                ("decouple_lr", ctypes.c_int32), ("initial_lr", ctypes.c_double), ("state_format", ctypes.c_int32),
                ("master_weight_bits", ctypes.c_int32), ("check_numerics", ctypes.c_int32),
                ("arithmetic", ctypes.c_int32)]


_P = ctypes.c_void_p
_cfgp = ctypes.POINTER(OptimConfig)
_tp = ctypes.POINTER(Tensor)
_i32p = ctypes.POINTER(ctypes.c_int32)
_default = declare("fo_optim_config_default", [ctypes.c_int32, _cfgp], None)
_create = declare("fo_optimizer_create", [_cfgp, ctypes.POINTER(_P)])
_destroy = declare("fo_optimizer_destroy", [_P], None)
# fo_optimizer_add_param is the group-0 form of the next one; bound so every exported
# function is reachable from Python (python/tests/test_abi.py).
_add_param_group0 = declare("fo_optimizer_add_param",
                            [_P, ctypes.c_char_p, _tp, ctypes.POINTER(ShardSpecStruct), _i32p])
_add_param = declare("fo_optimizer_add_param_to_group",
                     [_P, ctypes.c_char_p, _tp, ctypes.POINTER(ShardSpecStruct), ctypes.c_int32, _i32p])
_step = declare("fo_optimizer_step", [_P, _tp, ctypes.c_size_t])
_get_state = declare("fo_optimizer_get_state", [_P, ctypes.c_int32, ctypes.c_char_p, _tp])
_state_info = declare("fo_optimizer_state_info", [_P, ctypes.c_int32, ctypes.c_char_p, _i32p, _i32p,
                                                  ctypes.POINTER(ctypes.c_int64)])
_share_state = declare("fo_optimizer_share_state", [_P, ctypes.c_int32, ctypes.c_char_p, ctypes.POINTER(_P),
                                                    ctypes.POINTER(ctypes.POINTER(ctypes.c_float)),
                                                    ctypes.POINTER(ctypes.c_int64)])
_share_destroy = declare("fo_state_share_destroy", [_P], None)
_set_state = declare("fo_optimizer_set_state", [_P, ctypes.c_int32, ctypes.POINTER(ctypes.c_char_p), _tp,
                                                ctypes.c_size_t])
_add_group = declare("fo_optimizer_add_param_group", [_P, _cfgp, _i32p])
_set_lr = declare("fo_optimizer_set_group_lr", [_P, ctypes.c_int32, ctypes.c_double])
_set_group = declare("fo_optimizer_set_group_config", [_P, ctypes.c_int32, _cfgp])
_get_group = declare("fo_optimizer_get_group_config", [_P, ctypes.c_int32, _cfgp])
_num_params = declare("fo_optimizer_num_params", [_P, _i32p])
_state_bytes = declare("fo_optimizer_state_bytes", [_P, ctypes.c_int32, ctypes.POINTER(ctypes.c_uint64)])
_state_keys = declare("fo_optimizer_state_keys", [_P, ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t,
                                                  ctypes.POINTER(ctypes.c_size_t)])
_groups_json = declare("fo_optimizer_param_groups_json", [_P, ctypes.c_char_p, ctypes.c_size_t,
                                                          ctypes.POINTER(ctypes.c_size_t)])
_offload = declare("fo_offload_plan", [ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t, ctypes.c_double, _i32p])
_set_threads = declare("fo_set_num_threads", [ctypes.c_int32])
_get_threads = declare("fo_get_num_threads", [_i32p])
_set_stream = declare("fo_optimizer_set_stream", [_P, ctypes.c_void_p])
_set_mirror = declare("fo_optimizer_set_mirror", [_P, ctypes.c_int32, _tp])


class OverlapOptions(ctypes.Structure):
    """`fo_overlap_options`, field for field."""
    _fields_ = [("max_norm", ctypes.c_double), ("norm_type", ctypes.c_double),
                ("error_if_nonfinite", ctypes.c_int32), ("undo_budget_bytes", ctypes.c_uint64)]


class OverlapStats(ctypes.Structure):
    """`fo_overlap_stats`, field for field."""
    _fields_ = [("handed_over", ctypes.c_uint64), ("speculative", ctypes.c_uint64),
                ("deferred", ctypes.c_uint64), ("rolled_back", ctypes.c_uint64),
                ("rolled_back_bytes", ctypes.c_uint64), ("rollback_ns", ctypes.c_uint64),
                ("undo_high_water_bytes", ctypes.c_uint64), ("total_norm", ctypes.c_double),
                ("clipped", ctypes.c_int32)]


_overlap_default = declare("fo_overlap_options_default", [ctypes.POINTER(OverlapOptions)], None)
_step_begin = declare("fo_optimizer_step_begin", [_P, ctypes.POINTER(OverlapOptions)])
_grads_ready = declare("fo_optimizer_grads_ready", [_P, _i32p, _tp, ctypes.c_size_t])
_grads_at_end = declare("fo_optimizer_grads_at_end", [_P, _i32p, _tp, ctypes.c_size_t])
_step_end = declare("fo_optimizer_step_end", [_P, ctypes.c_void_p, ctypes.POINTER(OverlapStats)])
_step_abort = declare("fo_optimizer_step_abort", [_P, ctypes.POINTER(OverlapStats)])
_release_undo = declare("fo_optimizer_release_undo", [_P, ctypes.POINTER(ctypes.c_size_t)])
_set_full_fingerprints = declare("fo_optimizer_set_full_fingerprints", [_P, ctypes.c_int32])
_grads_changed = declare("fo_optimizer_grads_changed",
                         [_P, _i32p, ctypes.c_size_t, _i32p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)])


def config(algorithm: str = "adamw", **hp: Any) -> OptimConfig:
    """FlashOptim's defaults for `algorithm`, then `hp` (lr, betas=(b1, b2), eps,
    weight_decay, momentum, dampening, nesterov, decouple_lr, initial_lr,
    state_format ("fp32", "param_dtype", "quant8", "quant8_wide"), master_weight_bits,
    check_numerics, arithmetic ("exact": FlashOptim's bits, the default; "fast": within a
    stated bound of exact per step, faster). `initial_lr` defaults to `lr`."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {sorted(ALGORITHMS)}")
    c = OptimConfig()
    _default(ALGORITHMS[algorithm], ctypes.byref(c))
    if "betas" in hp:
        c.beta1, c.beta2 = hp.pop("betas")
    if "state_format" in hp:
        fmt = hp.pop("state_format")
        c.state_format = STATE_FORMATS[fmt] if isinstance(fmt, str) else int(fmt)
    if "arithmetic" in hp:
        a = hp.pop("arithmetic")
        if isinstance(a, str):
            if a not in ARITHMETIC:
                raise ValueError(f"unknown arithmetic {a!r}; expected one of {sorted(ARITHMETIC)}")
            a = ARITHMETIC[a]
        c.arithmetic = int(a)
    hp.setdefault("initial_lr", hp.get("lr", c.lr))
    for k, v in hp.items():
        if k not in {f[0] for f in OptimConfig._fields_}:
            raise TypeError(f"unknown hyper-parameter {k!r}")
        setattr(c, k, int(v) if isinstance(v, bool) else v)
    return c


def _string(fn, *args):
    n = ctypes.c_size_t(0)
    buf = ctypes.create_string_buffer(256)
    status = fn(*args, buf, len(buf), ctypes.byref(n))
    if status != 0 and n.value > len(buf):
        buf = ctypes.create_string_buffer(n.value)
        status = fn(*args, buf, len(buf), ctypes.byref(n))
    check(status)
    return buf.value.decode()


class Optimizer(Owned):
    """An fo optimizer over numpy arrays (kept referenced: they are updated in place)."""

    def __init__(self, algorithm: str = "adamw", **hp: Any) -> None:
        super().__init__(None)
        h = _P()
        check(_create(ctypes.byref(config(algorithm, **hp)), ctypes.byref(h)))
        self._handle = h
        self._params: list[tuple[np.ndarray, ShardSpec | None]] = []
        self._fqns: list[str] = []

    def _free(self, handle) -> None:
        _destroy(handle)

    def add_param_group(self, algorithm: str = "adamw", **hp: Any) -> int:
        g = ctypes.c_int32(-1)
        check(_add_group(self._handle, ctypes.byref(config(algorithm, **hp)), ctypes.byref(g)))
        return g.value

    def add_param(self, fqn: str, array: np.ndarray, group: int = 0, shard: ShardSpec | None = None,
                  dtype: str | None = None) -> int:
        """Registers `array` (contiguous float32/float16/bfloat16) as parameter `fqn`;
        `shard` is a `fo.ShardSpec` or None. Returns its index."""
        arg = TensorArg(array, dtype)
        idx = ctypes.c_int32(-1)
        spec = ctypes.byref(shard.struct) if shard is not None else None
        check(_add_param(self._handle, fqn.encode(), ctypes.byref(arg.struct), spec, group, ctypes.byref(idx)))
        self._params.append((array, shard))
        self._fqns.append(fqn)
        return idx.value

    @property
    def fqns(self) -> list[str]:
        """Parameter FQNs by index, in registration order."""
        return list(self._fqns)

    @property
    def num_params(self) -> int:
        n = ctypes.c_int32(0)
        check(_num_params(self._handle, ctypes.byref(n)))
        return n.value

    def step(self, grads: Sequence[np.ndarray | None]) -> None:
        """One step: `grads[i]` is parameter i's gradient (any strides), or None."""
        args = [None if g is None else TensorArg(g) for g in grads]
        arr = tensor_array(args)
        check(_step(self._handle, arr, len(args)))

    def step_begin(self, max_norm: float | None = None, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False, undo_budget_bytes: int = 0) -> None:
        """Opens an overlapped step: hand gradients over with `grads_ready` as they become
        final, then `step_end`. Same bits as `step` (with `max_norm`: as
        `fo.clip_grad_norm` over the handed-over gradients in parameter order, then
        `step`). `undo_budget_bytes`: 0 = no bound. See `fo_optimizer_step_begin`."""
        o = OverlapOptions()
        _overlap_default(ctypes.byref(o))
        o.max_norm = 0.0 if max_norm is None else max_norm
        o.norm_type = norm_type
        o.error_if_nonfinite = int(error_if_nonfinite)
        o.undo_budget_bytes = undo_budget_bytes
        check(_step_begin(self._handle, ctypes.byref(o)))
        self._overlap_refs: list[Any] = []

    def grads_ready(self, indices: Sequence[int], grads: Sequence[np.ndarray]) -> None:
        """Hands over the final gradients of parameters `indices` (any strides); fo steps
        them on its pool and this returns at once. The arrays are kept referenced until
        `step_end` (fo reads them until then, and with clipping may scale them in place)."""
        self._hand_over(_grads_ready, indices, grads)

    def grads_at_end(self, indices: Sequence[int], grads: Sequence[np.ndarray]) -> None:
        """`grads_ready` for gradients handed over just before `step_end`: they are
        stepped there, with no undo record (an early step would gain nothing)."""
        self._hand_over(_grads_at_end, indices, grads)

    def _hand_over(self, fn, indices, grads) -> None:
        if len(indices) != len(grads):
            raise ValueError(f"{len(indices)} indices for {len(grads)} gradients")
        args = [TensorArg(g) for g in grads]
        idx = (ctypes.c_int32 * max(len(args), 1))(*indices)
        self.__dict__.setdefault("_overlap_refs", []).append(args)
        check(fn(self._handle, idx, tensor_array(args), len(args)))

    def step_end(self, comm: Any = None) -> dict[str, Any]:
        """Closes the overlapped step (waits for fo's pool) and returns its stats as a dict
        (`speculative`, `rolled_back`, `undo_high_water_bytes`, `total_norm`, ...). `comm`:
        a `fo.Comm` for the clip norm across ranks (every rank calls step_end), or None."""
        st = OverlapStats()
        status = _step_end(self._handle, None if comm is None else comm._h, ctypes.byref(st))
        if status != C.FO_ERR_BUSY:  # busy: the step is still open and reads the gradients
            self.__dict__.pop("_overlap_refs", None)
        check(status)
        return _overlap_stats(st)

    def step_abort(self) -> dict[str, Any]:
        """Closes the open overlapped step changing nothing (fo puts back every parameter
        it stepped early; no collective) and returns its stats as `step_end` does."""
        st = OverlapStats()
        status = _step_abort(self._handle, ctypes.byref(st))
        if status != C.FO_ERR_BUSY:
            self.__dict__.pop("_overlap_refs", None)
        check(status)
        return _overlap_stats(st)

    def set_full_fingerprints(self, full: bool = True) -> None:
        """From the next overlapped step on, early host steps also fingerprint every byte
        of their gradient (see `grads_changed`); refused (FO_ERR_BUSY) while a step is open."""
        check(_set_full_fingerprints(self._handle, int(bool(full))))

    def grads_changed(self, full: Sequence[int] = ()) -> list[int]:
        """The parameters stepped early on the host whose gradient differs from the one their
        step read (edited after hand-over), ascending: compared by every byte for `full`
        (without a full fingerprint: changed), by a sampled fingerprint for the rest. Waits
        for the step's work on fo's pool. Redo with `step_abort` then `step`."""
        idx = (ctypes.c_int32 * max(len(full), 1))(*full)
        cap = self.num_params
        out, n = (ctypes.c_int32 * max(cap, 1))(), ctypes.c_size_t(0)
        check(_grads_changed(self._handle, idx, len(full), out, cap, ctypes.byref(n)))
        return list(out[:n.value])

    def release_undo(self) -> int:
        """Frees the undo records fo keeps between overlapped steps for the next one (as
        large as the parameters last stepped early plus their state) and returns their size
        in bytes: for a loop that stops overlapping. The next overlapped step makes them
        again. Refused (FO_ERR_BUSY) while a step is open."""
        n = ctypes.c_size_t(0)
        check(_release_undo(self._handle, ctypes.byref(n)))
        return n.value

    def state_info(self, index: int, key: str) -> tuple[int, tuple[int, ...]]:
        dt, nd = ctypes.c_int32(0), ctypes.c_int32(0)
        shape = (ctypes.c_int64 * MAX_DIMS)()
        check(_state_info(self._handle, index, key.encode(), ctypes.byref(dt), ctypes.byref(nd), shape))
        return dt.value, tuple(shape[:nd.value])

    def get_state(self, index: int, key: str, dtype: Any = None) -> np.ndarray:
        """State `key` of parameter `index` as a new array: decoded float32 for `exp_avg`,
        `exp_avg_sq`, `momentum_buffer`, `step`, `master`; raw dtype for `::quantized`,
        `::scales` (float16) and `error_bits`. `dtype` converts float keys."""
        code, shape = self.state_info(index, key)
        out = np.empty(shape, dtype=dtype or numpy_dtype(code))
        arg = TensorArg(out)
        check(_get_state(self._handle, index, key.encode(), ctypes.byref(arg.struct)))
        return out

    def share_state(self, index: int, key: str) -> np.ndarray:
        """The live float32 storage of state `key` (`exp_avg`, `exp_avg_sq`,
        `momentum_buffer`) of host parameter `index`, without a copy: a flat array that
        every later step, load and rollback writes in place, and whose writes are the
        state's (as torch's state tensors are). It stays valid after the optimizer is
        closed. Compressed state raises FoError (FO_ERR_UNSUPPORTED): use `get_state`."""
        return np.asarray(_Lent(self._handle, index, key))

    def _lend(self, index: int, key: str) -> np.ndarray | None:
        """`share_state`, or None where the state is not float32 on the host (fo.torch
        then decodes it): no exception on that path, which a `state_dict()` of quant8
        state takes once per key."""
        lent = _Lent(self._handle, index, key, unsupported_ok=True)
        return None if lent._handle is None else np.asarray(lent)

    def set_state(self, index: int, entries: Mapping[str, np.ndarray]) -> None:
        """Loads `{key: array}` into parameter `index`; all entries are checked first."""
        keys = list(entries)
        args = [TensorArg(np.ascontiguousarray(entries[k])) for k in keys]
        ckeys = (ctypes.c_char_p * max(len(keys), 1))(*[k.encode() for k in keys])
        check(_set_state(self._handle, index, ckeys, tensor_array(args), len(keys)))

    def state_keys(self, index: int) -> list[str]:
        s = _string(_state_keys, self._handle, index)
        return s.split("\n") if s else []

    def state_bytes(self, index: int | None = None) -> int:
        out = ctypes.c_uint64(0)
        check(_state_bytes(self._handle, -1 if index is None else index, ctypes.byref(out)))
        return out.value

    def set_lr(self, group: int, lr: float) -> None:
        check(_set_lr(self._handle, group, lr))

    def group_config(self, group: int) -> OptimConfig:
        c = OptimConfig()
        check(_get_group(self._handle, group, ctypes.byref(c)))
        return c

    def set_group_config(self, group: int, cfg: OptimConfig) -> None:
        check(_set_group(self._handle, group, ctypes.byref(cfg)))

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return json.loads(_string(_groups_json, self._handle))

    def set_stream(self, stream: int | None) -> None:
        """The CUDA stream (a `cudaStream_t` as an int, e.g. torch's
        `Stream.cuda_stream`; None: the legacy default stream) that steps launch device
        parameters' kernels on, and that mirror copies are ordered on. fo never
        synchronizes: see `fo_optimizer_set_stream` in fo.h. FoError
        FO_ERR_UNSUPPORTED without a CUDA build of libfo."""
        check(_set_stream(self._handle, stream))

    def set_mirror(self, index: int, mirror: Any) -> None:
        """Gives host parameter `index` a device mirror that fo keeps equal to it (written
        now and after every step, set_state or load that changes it): `mirror` is an
        fo_tensor over contiguous device memory of the parameter's dtype and shape
        (`fo._ffi.Tensor`, or an object holding one in `.struct`), kept referenced here;
        None removes it. See `fo_optimizer_set_mirror` in fo.h."""
        struct = None if mirror is None else getattr(mirror, "struct", mirror)
        if struct is not None and not isinstance(struct, Tensor):
            raise TypeError(f"mirror must be an fo_tensor (fo._ffi.Tensor) or None, got {type(mirror).__name__}")
        check(_set_mirror(self._handle, index, None if struct is None else ctypes.byref(struct)))
        # fo borrows the mirror's memory until it is replaced: keep its owner alive.
        mirrors = self.__dict__.setdefault("_mirrors", {})
        if mirror is None:
            mirrors.pop(index, None)
        else:
            mirrors[index] = mirror


def offload_plan(numels: Sequence[int], fraction: float) -> list[bool]:
    """Megatron's rule: which parameters (in order) go to the host."""
    n = len(numels)
    sizes = (ctypes.c_int64 * max(n, 1))(*numels)
    out = (ctypes.c_int32 * max(n, 1))()
    check(_offload(sizes, n, fraction, out))
    return [bool(x) for x in out[:n]]


def set_num_threads(n: int) -> None:
    """Threads for optimizer steps; 0 = FO_NUM_THREADS or all cores."""
    check(_set_threads(n))


def get_num_threads() -> int:
    n = ctypes.c_int32(0)
    check(_get_threads(ctypes.byref(n)))
    return n.value


def _overlap_stats(st: OverlapStats) -> dict[str, Any]:
    out: dict[str, Any] = {f: getattr(st, f) for f, _ in OverlapStats._fields_}
    out["clipped"] = bool(out["clipped"])
    return out


class _Lent(Owned):
    """A hold on one lent state buffer (`fo_optimizer_share_state`), shown to numpy as an
    array interface: the array made from it keeps it alive (`ndarray.base`), and the hold
    is released when the last array (or torch tensor made from one) over it goes."""

    def __init__(self, opt_handle, index: int, key: str, unsupported_ok: bool = False):
        super().__init__(None)
        handle, data = _P(), ctypes.POINTER(ctypes.c_float)()
        numel = ctypes.c_int64(0)
        status = _share_state(opt_handle, index, key.encode(), ctypes.byref(handle), ctypes.byref(data),
                              ctypes.byref(numel))
        if unsupported_ok and status == C.FO_ERR_UNSUPPORTED:
            return
        check(status)
        self._handle = handle.value
        addr = ctypes.cast(data, ctypes.c_void_p).value or 0
        self.__array_interface__ = {"shape": (numel.value,), "typestr": "<f4", "version": 3,
                                    "data": (addr, False)}

    def _free(self, handle) -> None:
        _share_destroy(handle)
