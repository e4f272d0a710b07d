"""Loading libfo and the ctypes mirror of the C ABI's plain structs.

Every binding module declares the argtypes of the functions it calls through `declare`
(which records them in `DECLARED`; python/tests/test_abi.py checks each against fo.h) and
routes their status through `check`, which raises `FoError` carrying
`fo_last_error_message()`. Codes come from `_codes`, generated from fo.h.
"""
import ctypes
import os
from pathlib import Path

import numpy as np

from ._codes import FO_ABI_VERSION, FO_DEVICE_HOST, FO_DTYPE_F32, FO_MAX_DIMS, FO_OK, codes

ABI_VERSION = FO_ABI_VERSION
MAX_DIMS = FO_MAX_DIMS


class FoError(RuntimeError):
    """A failed fo call: `status` is the fo_status code, `name` its symbolic name."""

    def __init__(self, status, name, message):
        super().__init__(f"{name}: {message}")
        self.status = status
        self.name = name
        self.message = message


class Owned:
    """The one base of every Python object that owns an fo handle (`Optimizer`, `Comm`,
    `Packed`, `AsyncSave`): `close()` (also on leaving a `with` block and on garbage
    collection) frees it once through `_free`, then `_release` drops whatever the handle
    kept alive."""

    def __init__(self, handle):
        self._handle = handle

    def _free(self, handle) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        pass

    def close(self) -> None:
        if getattr(self, "_handle", None) is not None:  # None also when __init__ failed
            self._free(self._handle)
            self._handle = None
            self._release()

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _candidates():
    env = os.environ.get("FO_LIBRARY")
    if env:
        yield Path(env)
        return
    here = Path(__file__).resolve().parent
    yield here / "libfo.so"  # installed next to the package
    root = here.parent.parent
    for sub in ("target/release", "target/debug", "build"):
        yield root / sub / "libfo.so"


def _load():
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.is_file():
            lib = ctypes.CDLL(str(path))
            break
    else:
        raise ImportError(
            "libfo.so not found (set FO_LIBRARY, or build it with `cargo build --release`); tried: "
            + ", ".join(tried)
        )
    lib.fo_abi_version.restype = ctypes.c_uint32
    lib.fo_abi_version.argtypes = []
    got = lib.fo_abi_version()
    if got != ABI_VERSION:
        raise ImportError(f"{path} has ABI version {got}, this binding needs {ABI_VERSION}")
    return lib, path


lib, library_path = _load()
# Every binding: C name -> (argtypes, restype), as `declare` set them.
DECLARED = {}


def declare(name, argtypes, restype=ctypes.c_int32):
    """Set a function's signature once; returns the function. A second declaration of
    the same function must agree (ctypes keeps one signature per library function)."""
    sig = (list(argtypes), restype)
    if DECLARED.setdefault(name, sig) != sig:
        raise TypeError(f"{name} declared twice with different signatures: {DECLARED[name]} and {sig}")
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


declare("fo_abi_version", [], ctypes.c_uint32)
declare("fo_last_error_message", [], ctypes.c_char_p)
declare("fo_status_name", [ctypes.c_int32], ctypes.c_char_p)
declare("fo_version", [], ctypes.c_char_p)


def check(status):
    """Raise FoError for a non-zero fo_status."""
    if status != FO_OK:
        name = lib.fo_status_name(status).decode()
        raise FoError(status, name, lib.fo_last_error_message().decode(errors="replace"))


i64p = ctypes.POINTER(ctypes.c_int64)


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", i64p),
        ("strides", i64p),
        ("device", ctypes.c_int32),
    ]


class Placement(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("dim", ctypes.c_int32), ("split_factor", ctypes.c_int32)]


class ShardSpecStruct(ctypes.Structure):
    _fields_ = [
        ("ndim", ctypes.c_int32),
        ("global_shape", i64p),
        ("mesh_ndim", ctypes.c_int32),
        ("mesh_shape", i64p),
        ("coord", i64p),
        ("placements", ctypes.POINTER(Placement)),
    ]


class ShardInfo(ctypes.Structure):
    _fields_ = [
        ("ndim", ctypes.c_int32),
        ("local_shape", ctypes.c_int64 * MAX_DIMS),
        ("global_offset", ctypes.c_int64 * MAX_DIMS),
        ("global_shape", ctypes.c_int64 * MAX_DIMS),
        ("global_stride", ctypes.c_int64 * MAX_DIMS),
        ("is_box", ctypes.c_int32),
    ]


DTYPE_CODES = codes("FO_DTYPE_")  # {"f32": FO_DTYPE_F32, "bf16": FO_DTYPE_BF16, ...}
_NUMPY_NAMES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "int8": "i8",
                "uint8": "u8", "int16": "i16", "int32": "i32", "int64": "i64", "bool": "bool",
                "float8_e4m3fn": "f8_e4m3", "float8_e5m2": "f8_e5m2"}
_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "i8": 1, "u8": 1, "i16": 2, "i32": 4, "i64": 8,
             "bool": 1, "f8_e4m3": 1, "f8_e5m2": 1}


def dtype_name(array, dtype=None):
    """fo's name for an array's element type; `dtype` overrides it (e.g. "bf16" for a
    uint16 array holding bfloat16 bit patterns)."""
    if dtype is not None:
        if dtype not in DTYPE_CODES:
            raise ValueError(f"unknown fo dtype {dtype!r}; expected one of {sorted(DTYPE_CODES)}")
        if _ITEMSIZE[dtype] != array.itemsize:
            raise ValueError(f"dtype {dtype} needs {_ITEMSIZE[dtype]}-byte elements, array has {array.itemsize}")
        return dtype
    name = _NUMPY_NAMES.get(array.dtype.name)
    if name is None:
        raise ValueError(f"numpy dtype {array.dtype} has no fo equivalent; pass dtype=...")
    return name


class TensorArg:
    """An fo_tensor over a numpy array's memory, keeping the shape and stride arrays alive
    as long as this object. `.struct` is the fo_tensor; `ctypes.byref(arg.struct)` passes it."""

    def __init__(self, array, dtype=None):
        if not isinstance(array, np.ndarray):
            raise TypeError(f"expected a numpy array, got {type(array).__name__}")
        self.array = array
        self.dtype = dtype_name(array, dtype)
        nd = array.ndim
        self._shape = (ctypes.c_int64 * max(nd, 1))(*array.shape)
        item = array.itemsize
        if any(s % item for s in array.strides):
            raise ValueError("array strides are not a multiple of its element size")
        self._strides = (ctypes.c_int64 * max(nd, 1))(*[s // item for s in array.strides])
        self.struct = Tensor(
            array.ctypes.data if array.size else None,
            DTYPE_CODES[self.dtype],
            nd,
            ctypes.cast(self._shape, i64p),
            ctypes.cast(self._strides, i64p),
            FO_DEVICE_HOST,
        )


def tensor_array(args):
    """A ctypes array of fo_tensor structs from TensorArg objects (None = absent tensor,
    data NULL); keep `args` alive while the array is used."""
    arr = (Tensor * max(len(args), 1))()
    for i, a in enumerate(args):
        if a is None:
            arr[i] = Tensor(None, FO_DTYPE_F32, 0, None, None, FO_DEVICE_HOST)
        else:
            arr[i] = a.struct
    return arr
