"""The Python binding against the C header: every code, every function signature and every
struct layout of include/fo.h, parsed here, must be what python/fo declares. A function
fo exports that Python does not bind, a ctypes argtype that disagrees with the prototype,
a struct field out of order or a hand-copied code that drifted fails here."""
import ctypes
import re

import numpy as np
import pytest

import fo
from conftest import ROOT, load_script
from fo import _codes, _ffi, ckpt, comm, optim, shard

HEADER = (ROOT / "include" / "fo.h").read_text()


# --- a small parser for the C that cbindgen writes -------------------------------------

def _strip_comments(text):
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def header_defines(text=HEADER):
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define\s+(FO_\w+)\s+(-?\d+)\s*$", text, re.M)}


def _decl(text):
    """`const struct fo_x *const *name` -> (type, name): the type keeps its stars."""
    text = " ".join(text.split())
    m = re.fullmatch(r"(.*?[\s*])(\w+)", text)
    assert m, f"cannot parse declaration {text!r}"
    return " ".join(m.group(1).replace("*", " * ").split()), m.group(2)


def _field(text):
    """A struct field: ("fnptr", (ret, [arg types]), name), ("array", (type, len), name) or
    ("plain", type, name)."""
    text = " ".join(text.split())
    m = re.fullmatch(r"(.+?)\(\s*\*\s*(\w+)\s*\)\s*\((.*)\)", text)
    if m:
        args = [_decl(a)[0] for a in m.group(3).split(",")]
        return "fnptr", (" ".join(m.group(1).split()), args), m.group(2)
    m = re.fullmatch(r"(.+?)\[(\w+)\]", text)
    if m:
        ty, name = _decl(m.group(1))
        return "array", (ty, m.group(2)), name
    ty, name = _decl(text)
    return "plain", ty, name


def header_structs(text=HEADER):
    """{name: [fields]} for structs with a body; opaque handles map to None."""
    body = _strip_comments(text)
    out = {m.group(1): None for m in re.finditer(r"typedef struct (fo_\w+) \1;", body)}
    for m in re.finditer(r"typedef struct (fo_\w+) \{(.*?)\} \1;", body, re.S):
        out[m.group(1)] = [_field(f) for f in m.group(2).split(";") if f.strip()]
    return out


def header_typedefs(text=HEADER):
    return {m.group(2): m.group(1) for m in re.finditer(r"^typedef (\w+) (fo_\w+);", text, re.M)}


def header_functions(text=HEADER):
    """{name: (return type, [argument types])} of the prototypes in the extern "C" block."""
    body = _strip_comments(text)
    body = body[body.index('extern "C" {') + len('extern "C" {'):]
    body = re.sub(r"^#.*$", "", body, flags=re.M)  # #ifdef __cplusplus and friends
    out = {}
    for m in re.finditer(r"([\w\s*]+?)\b(fo_\w+)\(([^)]*)\);", body):
        args = m.group(3).strip()
        out[m.group(2)] = (" ".join(m.group(1).replace("*", " * ").split()),
                           [] if args in ("", "void") else [_decl(a)[0] for a in args.split(",")])
    return out


STRUCTS = header_structs()
TYPEDEFS = header_typedefs()
FUNCTIONS = header_functions()

SCALARS = {"int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "uint32_t": ctypes.c_uint32,
           "uint64_t": ctypes.c_uint64, "size_t": ctypes.c_size_t, "double": ctypes.c_double,
           "float": ctypes.c_float}


class Mismatch(AssertionError):
    pass


def _ctype_name(t):
    return getattr(t, "__name__", repr(t))


def check_type(c, py, where, seen):
    """Raises Mismatch unless the ctypes type `py` is the C type `c` (as `_decl` spells it).
    Struct types met on the way are checked field by field (once; `seen` maps C struct
    name -> the ctypes class found for it)."""
    c = " ".join(w for w in c.split() if w != "const")
    c = TYPEDEFS.get(c, c)
    if c == "void":
        ok = py is None
    elif c in SCALARS:
        ok = py is SCALARS[c]
    elif c.endswith("*"):
        inner = c[:-1].strip()
        inner = TYPEDEFS.get(inner, inner)
        if inner == "char":
            ok = py in (ctypes.c_char_p, ctypes.POINTER(ctypes.c_char))
        elif inner == "void":
            ok = py is ctypes.c_void_p
        elif inner.startswith("struct ") and STRUCTS.get(inner[len("struct "):], "missing") is None:
            ok = py is ctypes.c_void_p  # an opaque handle
        elif inner.startswith("struct ") and py is ctypes.c_void_p:
            ok = True  # a struct pointer passed untyped (e.g. fo_broadcast_dest.spec)
        else:
            if not (isinstance(py, type) and issubclass(py, ctypes._Pointer)):
                raise Mismatch(f"{where}: C {c!r} is a pointer, Python has {_ctype_name(py)}")
            check_type(inner, py._type_, where, seen)
            return
    elif c.startswith("struct "):
        check_struct(c[len("struct "):], py, where, seen)
        return
    else:
        raise Mismatch(f"{where}: no ctypes mapping for C type {c!r}")
    if not ok:
        raise Mismatch(f"{where}: C {c!r}, Python {_ctype_name(py)}")


def check_struct(name, py, where, seen):
    if name in seen:
        if seen[name] is not py:
            # Two ctypes classes for one C struct must at least have the same layout.
            check_struct(name, py, where, {})
        return
    fields = STRUCTS.get(name)
    if fields is None:
        raise Mismatch(f"{where}: struct {name} is not in fo.h or is opaque")
    if not (isinstance(py, type) and issubclass(py, ctypes.Structure)):
        raise Mismatch(f"{where}: C struct {name}, Python {_ctype_name(py)}")
    seen[name] = py
    got = py._fields_
    names = [f[2] for f in fields]
    if [f[0] for f in got] != names:
        raise Mismatch(f"{where}: struct {name} fields {names}, Python {py.__name__} has {[f[0] for f in got]}")
    for (kind, ty, fname), (_, pty) in zip(fields, got):
        at = f"{name}.{fname}"
        if kind == "plain":
            check_type(ty, pty, at, seen)
        elif kind == "array":
            elem, n = ty
            n = header_defines().get(n, None) if not n.isdigit() else int(n)
            if not (issubclass(pty, ctypes.Array) and pty._length_ == n):
                raise Mismatch(f"{at}: C {elem}[{n}], Python {_ctype_name(pty)}")
            check_type(elem, pty._type_, at, seen)
        else:
            ret, args = ty
            if not hasattr(pty, "_argtypes_"):
                raise Mismatch(f"{at}: C function pointer, Python {_ctype_name(pty)}")
            check_type(ret, pty._restype_, f"{at} return", seen)
            if len(pty._argtypes_) != len(args):
                raise Mismatch(f"{at}: C takes {len(args)} arguments, Python {len(pty._argtypes_)}")
            for i, (a, pa) in enumerate(zip(args, pty._argtypes_)):
                check_type(a, pa, f"{at} argument {i}", seen)


def check_function(name, declared, seen):
    ret, args = FUNCTIONS[name]
    argtypes, restype = declared
    check_type(ret, restype, f"{name} return", seen)
    if len(argtypes) != len(args):
        raise Mismatch(f"{name}: C takes {len(args)} arguments {args}, Python declares {len(argtypes)}")
    for i, (a, pa) in enumerate(zip(args, argtypes)):
        check_type(a, pa, f"{name} argument {i}", seen)


# --- the parser reads the header (else the checks below would check nothing) -----------

def test_parser_reads_every_function_struct_and_code():
    assert len(FUNCTIONS) >= 40 and "fo_optimizer_step" in FUNCTIONS
    assert FUNCTIONS["fo_optimizer_step"] == ("fo_status", ["struct fo_optimizer *", "const struct fo_tensor *",
                                                           "size_t"])
    assert FUNCTIONS["fo_version"] == ("const char *", [])
    assert STRUCTS["fo_optimizer"] is None and STRUCTS["fo_comm"] is None
    assert [f[2] for f in STRUCTS["fo_tensor"]] == ["data", "dtype", "ndim", "shape", "strides", "device"]
    assert STRUCTS["fo_comm_callbacks"][1] == ("fnptr", ("int32_t", ["void *", "void *", "size_t", "int32_t"]),
                                               "broadcast")
    assert STRUCTS["fo_shard_info"][1] == ("array", ("int64_t", "FO_MAX_DIMS"), "local_shape")
    n_protos = len(re.findall(r"^\S.*\bfo_\w+\(", _strip_comments(HEADER).split('extern "C" {')[1], re.M))
    assert len(FUNCTIONS) == n_protos
    assert header_defines()["FO_DTYPE_BF16"] == 2 and header_defines()["FO_DEVICE_HOST"] == -1


def test_checker_catches_a_wrong_signature_and_a_wrong_layout():
    with pytest.raises(Mismatch, match="argument 2"):
        check_function("fo_optimizer_step", ([ctypes.c_void_p, ctypes.POINTER(_ffi.Tensor), ctypes.c_int32],
                                             ctypes.c_int32), {})

    class Swapped(ctypes.Structure):
        _fields_ = [("kind", ctypes.c_int32), ("split_factor", ctypes.c_int32), ("dim", ctypes.c_int32)]

    with pytest.raises(Mismatch, match="fo_placement fields"):
        check_struct("fo_placement", Swapped, "test", {})

    class Narrow(ctypes.Structure):
        _fields_ = [(n, ctypes.c_int64 if n == "shape" else t) for n, t in _ffi.Tensor._fields_]

    with pytest.raises(Mismatch, match="fo_tensor.shape"):
        check_struct("fo_tensor", Narrow, "test", {})


# --- the binding against the header ---------------------------------------------------

def test_generated_codes_are_the_headers():
    gen = load_script(ROOT / "scripts" / "gen_py_codes.py")
    committed = (ROOT / "python" / "fo" / "_codes.py").read_text()
    assert committed == gen.render(HEADER, gen.naming_text()), "python/fo/_codes.py is stale: run scripts/gen_py_codes.py"
    got = {k: v for k, v in vars(_codes).items() if k.startswith("FO_")}
    assert got == header_defines()


def test_checkpoint_names_come_from_naming_rs():
    # Python spells no checkpoint name itself: every one is keys.rs's or naming.rs's, through _codes.
    assert (_codes.STATE_PREFIX, _codes.CODES_SUFFIX, _codes.SCALES_SUFFIX) == ("state.", "::quantized", "::scales")
    assert _codes.PART_SEPARATOR + _codes.CODES_PART == _codes.CODES_SUFFIX
    src = "".join((ROOT / "python" / "fo" / f).read_text() for f in ("layout.py", "torch.py", "ckpt.py"))
    for literal in ('"::quantized"', '"::scales"', '"::"', '"state.', 'f"state.', '"error_bits"'):
        assert literal not in src, f"checkpoint name {literal} spelled outside keys.rs / naming.rs"


@pytest.mark.parametrize("python, prefix", [
    (lambda: _ffi.DTYPE_CODES, "FO_DTYPE_"),
    (lambda: optim.ALGORITHMS, "FO_ALGORITHM_"),
    (lambda: optim.STATE_FORMATS, "FO_STATE_FORMAT_"),
    (lambda: optim.ARITHMETIC, "FO_ARITHMETIC_"),
    (lambda: ckpt.MODES, "FO_PACK_MODE_"),
    (lambda: {("none" if k is None else k): v for k, v in ckpt.PARAMS.items()}, "FO_PACK_PARAMS_"),
    (lambda: comm.STRATEGIES, "FO_BROADCAST_STRATEGY_"),
    (lambda: {"sum": comm.SUM, "max": comm.MAX}, "FO_REDUCE_"),
    (lambda: {"replicate": shard.REPLICATE, "shard": shard.SHARD, "strided_shard": shard.STRIDED_SHARD,
              "partial": shard.PARTIAL}, "FO_PLACEMENT_"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_every_python_code_table_is_the_headers(python, prefix):
    want = {k[len(prefix):].lower(): v for k, v in header_defines().items() if k.startswith(prefix)}
    assert want, prefix
    assert python() == want


def test_python_limits_and_versions_are_the_headers():
    d = header_defines()
    assert fo.ABI_VERSION == d["FO_ABI_VERSION"] == fo.abi_version()
    assert _ffi.MAX_DIMS == d["FO_MAX_DIMS"]
    assert comm.MAX_LOCAL_WORLD == d["FO_MAX_LOCAL_WORLD"]
    # Every dtype fo has a code for has a byte size and a numpy spelling here.
    assert set(_ffi._ITEMSIZE) == set(_ffi.DTYPE_CODES) == set(_ffi._NUMPY_NAMES.values())
    # fo_status_name knows every status code the header defines.
    for name, code in d.items():
        if name == "FO_OK" or name.startswith("FO_ERR_"):
            assert _ffi.lib.fo_status_name(code).decode() == name


def test_every_exported_function_has_a_python_binding():
    missing = sorted(set(FUNCTIONS) - set(_ffi.DECLARED))
    assert not missing, f"functions of fo.h with no ctypes binding in python/fo: {missing}"
    unknown = sorted(set(_ffi.DECLARED) - set(FUNCTIONS))
    assert not unknown, f"python/fo binds functions fo.h does not declare: {unknown}"


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_binding_signature_matches_the_prototype(name):
    if name not in _ffi.DECLARED:
        pytest.fail(f"{name} has no binding")
    check_function(name, _ffi.DECLARED[name], {})
    fn = getattr(_ffi.lib, name)  # what ctypes will actually use
    assert (list(fn.argtypes), fn.restype) == _ffi.DECLARED[name]


def test_every_struct_of_the_header_is_mirrored_and_checked():
    seen = {}
    for name in sorted(FUNCTIONS):
        if name in _ffi.DECLARED:
            check_function(name, _ffi.DECLARED[name], seen)
    with_body = {n for n, f in STRUCTS.items() if f is not None}
    # Structs reached only through untyped pointers (c_void_p) are checked by class here.
    untyped = {"fo_shard_spec": shard.ShardSpecStruct}
    for n, cls in untyped.items():
        check_struct(n, cls, "test", seen)
    assert sorted(with_body - set(seen)) == []


def test_declaring_a_function_twice_differently_is_refused():
    with pytest.raises(TypeError, match="declared twice"):
        _ffi.declare("fo_optimizer_num_params", [ctypes.c_void_p], ctypes.c_int32)
    assert _ffi.DECLARED["fo_optimizer_num_params"][0][0] is ctypes.c_void_p
    assert len(_ffi.DECLARED["fo_optimizer_num_params"][0]) == 2


# --- the bindings that had none before -------------------------------------------------

def test_add_param_group0_binding_registers_in_group_zero():
    opt = fo.Optimizer("adamw", state_format="fp32", master_weight_bits=0)
    w = np.ones(4, np.float32)
    arg = fo.TensorArg(w)
    idx = ctypes.c_int32(-1)
    _ffi.check(optim._add_param_group0(opt._handle, b"w", ctypes.byref(arg.struct), None, ctypes.byref(idx)))
    assert idx.value == 0 and opt.num_params == 1
    assert opt.param_groups[0]["params"] == ["w"]


def test_set_mirror_none_removes_and_a_host_mirror_is_refused():
    opt = fo.Optimizer("adamw", state_format="fp32", master_weight_bits=0)
    w = np.ones(4, np.float32)
    opt.add_param("w", w)
    opt.set_mirror(0, None)  # no mirror to remove: fine, and needs no CUDA
    with pytest.raises(fo.FoError, match="index") as e:
        opt.set_mirror(3, None)
    assert e.value.status == _codes.FO_ERR_INVALID_ARGUMENT
    with pytest.raises(fo.FoError) as e:
        opt.set_mirror(0, fo.TensorArg(np.zeros(4, np.float32)))  # host memory is no mirror
    assert e.value.status in (_codes.FO_ERR_INVALID_ARGUMENT, _codes.FO_ERR_UNSUPPORTED), e.value
    assert "mirror" in e.value.message
    with pytest.raises(TypeError, match="fo_tensor"):
        opt.set_mirror(0, np.zeros(4, np.float32))


def test_set_stream_reaches_the_library():
    opt = fo.Optimizer("adamw")
    try:
        opt.set_stream(None)  # the legacy default stream
    except fo.FoError as e:  # a libfo built without CUDA, or no driver here
        assert e.status == _codes.FO_ERR_UNSUPPORTED and e.message, e
