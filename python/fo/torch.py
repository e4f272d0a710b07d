"""fo as a `torch.optim.Optimizer`: the one-line change for a torch training loop.

    import fo.torch
    opt = fo.torch.AdamW(model.parameters(), lr=1e-3, state_format="quant8")

Parameters and gradients are read in place through `data_ptr()` (a DTensor through its local
shard, with its mesh coordinate and placements as fo's shard spec; a non-contiguous parameter
through a contiguous stand-in, fo._torch_strided), so FSDP2 shards offloaded
with `CPUOffloadPolicy` are stepped where they lie, and CUDA parameters on their GPU, on
torch's current stream, with their state on that GPU (fo._torch_cuda); one optimizer may
hold both. `offload=` keeps chosen CUDA parameters' master weights and state on the host,
stepped there and written back (fo._torch_offload). `param_groups` stay torch dicts: what an
lr scheduler writes there is pushed to fo before every step. `state_dict()` has torch's
layout (`step`, `exp_avg`, `exp_avg_sq`, `momentum_buffer`; DTensors for DTensor params)
in float32, so `torch.distributed.checkpoint` saves, loads and reshards it, and a
torch.optim checkpoint loads into any fo state format. fp32 state is handed out live, as
torch's is (fo's own buffers: no copy); compressed state is decoded into new tensors.

Defaults: `state_format="quant8"` (FlashOptim's 8-bit state: 2.125 B/param for AdamW instead
of torch's 8) with `arithmetic="fast"` (within fo's stated bound of FlashOptim's bits per
step, on the host about as fast as torch's fused AdamW, on a GPU the faster of fo's two
kernels; host and GPU steps have the same bits); pass `arithmetic="exact"` for bit-parity
with FlashOptim everywhere, `state_format="fp32"` for torch's trajectories (rtol 1e-5).
`opt.state[p]` tensors of compressed state are decoded copies whose edits reach fo before
the next step, those of fp32 state fo's live buffers (`fo._torch_state`); `opt.state_memory()` says what fo really stores, `opt.save_checkpoint(dir)`
writes it compressed (fo's checkpoint, DCP-readable). `copy.deepcopy` and pickle rebuild fo's
handle from the decoded state. Under `torch.compile` the step is one opaque op (`fo::step`).

`overlap=True` (any optimizer here) steps each parameter on fo's pool as backward makes its
gradient final (post-accumulate-grad hooks; FSDP2 runs them on the reduced shard), and
`step()` waits for the rest: the same bits as `overlap=False`. It times the loop's first
iterations with and without hand-over and keeps handing over only if that is faster
(fo._torch_overlap_tune); `overlap="always"` hands over in every backward. Clip with the
optimizer's `max_grad_norm=` (and `norm_type=`, `error_if_nonfinite=`), accumulate gradients under
`with opt.no_handover():`, read `opt.last_step_stats`; see `fo._torch_overlap`. Without
overlap, `fo.torch.clip_grad_norm_` is the same clip as torch's function (fo._torch_clip).
"""
import ctypes

import torch

from . import _codes as _names
from . import _torch_compile as _compile
from . import optim as _optim
from . import _torch_checks as _checks
from ._ffi import FoError, check, tensor_array
from ._torch_args import (UNSUPPORTED, GradArray, TorchArg, error, group_names, is_dtensor, like_param, local,
                          shard_spec)
from ._torch_clip import Clip, clip_grad_norm_
from ._torch_dicts import Dicts
from ._torch_cuda import Streams
from ._torch_offload import Offload, check_offload
from ._torch_overlap import OPTION_KEYS, Overlap, overlap_options
from ._torch_state import Rebuild, State
from ._torch_storage import Storage
from ._torch_strided import Strided

__all__ = ["AdamW", "Adam", "SGD", "Lion", "clip_grad_norm_"]

PORTABLE = ("step", "exp_avg", "exp_avg_sq", "momentum_buffer")
# what fp32 state lends live instead of decoding (fo_optimizer_share_state)
_LENDABLE = ("exp_avg", "exp_avg_sq", "momentum_buffer")
# The default arithmetic, on the host and on a GPU: fast (within fo's stated bound of exact per
# step; "exact" = FlashOptim's bits). Both step CUDA parameters with the host's bits of the
# same arithmetic (`fo selftest` on an H200, 2026-11-28), and fast is the faster GPU step too
# (bf16 + quant8 100.3 vs 88.6 G params/s there).
DEFAULT_ARITHMETIC = "fast"


def _create(cfg):
    """An fo.optim.Optimizer whose group 0 is the OptimConfig `cfg`."""
    opt = _optim.Optimizer.__new__(_optim.Optimizer)
    opt._handle, opt._params, opt._fqns = None, [], []
    h = _optim._P()
    check(_optim._create(ctypes.byref(cfg), ctypes.byref(h)))
    opt._handle = h
    return opt


# torch.optim flags fo has no step for: refused wherever a group carries them set.
UNIMPLEMENTED = ("amsgrad", "maximize", "differentiable")


class _FoOptimizer(Dicts, Rebuild, Overlap, Clip, Streams, Offload, Strided, Storage, torch.optim.Optimizer):
    algorithm = "adamw"
    _step_supports_amp_scaling = True  # GradScaler hands its scale over (fo._torch_overlap)

    def __init__(self, params, defaults):
        self._refuse_flags(defaults, "")  # (no group yet: nothing to name)
        defaults["arithmetic"] = _checks.arithmetic_name(defaults.get("arithmetic"), DEFAULT_ARITHMETIC)
        _checks.state_format(defaults["state_format"])
        options = overlap_options(**{k: defaults.pop(k) for k in OPTION_KEYS if k in defaults})
        self._fresh()
        self._ov, self._hooked = options, False  # add_param_group (called by torch's __init__) reads them
        # the constructor's groups are placed together once all are added (fo._torch_offload)
        self._offload_arg, self._offloaded, self._placing = check_offload(defaults.pop("offload", None)), {}, True
        super().__init__(params, defaults)
        self._placing = False
        self._place_groups(self.param_groups, 0)
        self.state = State(self)  # torch's __init__ set a defaultdict
        self._overlap_init(options)

    def _fresh(self):
        """The fo side, empty: built at the first step or load."""
        self._fo = None  # fo.optim.Optimizer
        self._index = {}  # param -> fo index
        self._order = []  # (param, fo index, name) in registration order: a step's loop
        self._where = {}  # param -> (data_ptr, shape, dtype) registered with fo
        self._keep = {}  # param -> what fo borrows (the local tensor, its shard spec)
        self._name = {}  # param -> the name fo knows it by (for error messages)
        self._group_of, self._layout = {}, None  # param -> its group at registration; fo._torch_state
        self._pushed = []  # the hyper-parameters last pushed to each fo group
        self._grads = None  # the step's gradient array (GradArray), kept across steps
        self._device = {}  # param -> the fo device code it is registered with
        self._stream = None  # (handle, {device: torch stream}) fo steps on; None: NULL, unset
        self._mirror_version = {}  # offloaded param -> its version when fo's host copy equalled it
        self._stand_in = {}  # non-contiguous param -> [the tensor fo steps, version, order] (fo._torch_strided)
        self.state = State(self)
        self._compile_key = _compile.register(self)

    def add_param_group(self, param_group):
        self._refuse_flags(param_group, "")
        if "arithmetic" in param_group:  # None: the default
            param_group["arithmetic"] = _checks.arithmetic_name(param_group["arithmetic"], DEFAULT_ARITHMETIC)
        if "state_format" in param_group:
            _checks.state_format(param_group["state_format"])
        super().add_param_group(param_group)
        if not self._placing:  # a group added later: placed now
            self._place_groups(self.param_groups[-1:], len(self.param_groups) - 1)
        if self._ov["overlap"] and self._hooked:  # groups after __init__ (which hooks its own)
            self._hook_params(self.param_groups[-1]["params"])

    # -- hyper-parameters -------------------------------------------------------------
    def _refuse_flags(self, group, where=None):
        """torch's flags fo does not implement, in a group however they got there (the
        constructor, `add_param_group`, an edit of `param_groups`, a loaded state dict);
        `where` names the group (None: its index in `param_groups`)."""
        for flag in UNIMPLEMENTED:
            if group.get(flag):
                if where is None:
                    where = f" (param group {next(i for i, g in enumerate(self.param_groups) if g is group)})"
                raise ValueError(f"{type(self).__name__}: fo does not implement {flag}=True{where}")

    def _algorithm(self, group):
        """fo's algorithm for a torch param group (fo.torch.Adam's follows its group)."""
        return self.algorithm

    def _hp(self, group):
        """fo's hyper-parameters for a torch param group (subclasses map torch's names)."""
        raise NotImplementedError

    def _group_hp(self, group):
        self._refuse_flags(group)
        hp = self._hp(group)
        hp["algorithm"] = self._algorithm(group)
        hp["lr"] = float(group["lr"])
        hp["weight_decay"] = float(group["weight_decay"])
        hp["initial_lr"] = float(group.get("initial_lr", group["lr"])) or 1.0
        hp["state_format"] = group["state_format"]
        hp["master_weight_bits"] = int(group["master_weight_bits"])
        hp["arithmetic"] = _checks.arithmetic_code(group["arithmetic"])
        return hp

    # -- registration -----------------------------------------------------------------
    def _names(self):
        for gi, g in enumerate(self.param_groups):
            for p, name in zip(g["params"], group_names(g, gi)):
                yield gi, p, name

    @staticmethod
    def _placed(p):
        t = local(p)
        return (t.data_ptr(), tuple(t.shape), t.dtype)

    def _moved(self):
        """Whether a registered parameter's storage moved (or its shape or dtype changed)
        since it was registered: a loop, as it runs per parameter per step."""
        for p, (ptr, shape, dtype) in self._where.items():
            t = local(p)
            if t.data_ptr() != ptr or t.dtype != dtype or t.shape != shape:
                return True
        return False

    def _register(self, p, gi, name):
        offloaded = self._is_offloaded(p)
        # an offloaded CUDA parameter: fo owns a host copy (master and state on the host) and
        # keeps the CUDA parameter as its mirror (fo._torch_offload)
        mirror = TorchArg(p, f"parameter {name}") if offloaded else None
        host = self._host_copy(p, name) if offloaded else None
        # a non-contiguous parameter: fo steps a contiguous stand-in (fo._torch_strided)
        stand_in = None if offloaded else self._stand_in_for(p)
        arg = TorchArg(host if host is not None else p if stand_in is None else stand_in, f"parameter {name}")
        spec = shard_spec(p, f"parameter {name}") if is_dtensor(p) else None
        device = arg.struct.device if mirror is None else mirror.struct.device
        if device >= 0:
            self._before_cuda_register(device)
        idx = ctypes.c_int32(-1)
        try:
            check(_optim._add_param(self._fo._handle, name.encode(), ctypes.byref(arg.struct),
                                    ctypes.byref(spec.struct) if spec is not None else None, gi, ctypes.byref(idx)))
        except FoError as e:
            if device < 0 or name in e.message:
                raise
            # fo names the argument ("param.device = 0: this libfo was built without GPU
            # support ..."); the user needs the parameter too
            raise error(e.status, f"parameter {name} is on cuda:{device}: {e.message}") from None
        self._index[p] = idx.value
        self._order.append((p, idx.value, name))
        self._fo._fqns.append(name)  # fo.optim's view: fo.ckpt.torch_state_dict(opt._fo) names them
        self._where[p] = self._placed(p)
        self._keep[p] = (arg, spec, mirror, host)
        if mirror is not None:
            if local(p).numel():  # an empty shard has nothing to mirror
                self._fo.set_mirror(idx.value, mirror)
            self._mirror_seen(p)
        if stand_in is not None:
            self._keep_stand_in(p, stand_in)
        self._name[p] = name
        self._device[p] = device
        self._group_of[p] = gi

    def _sync(self, also=()):
        """Makes fo match the torch side: rebuilt if a registered parameter's storage moved,
        one fo group per torch group with its current hyper-parameters (pushed only when
        they changed), and every parameter that has a gradient (or is in `also`) registered."""
        if self._fo is not None:
            reset = self._dropped_state()
            if reset or self._moved() or self._regrouped():
                self._rebuild(reset)
        if self._fo is None:
            hp = self._group_hp(self.param_groups[0])
            self._fo = _create(_optim.config(**hp))
            self._pushed, self._stream = [hp], None  # a new handle steps on NULL until told
        for gi, g in enumerate(self.param_groups):
            hp = self._group_hp(g)
            if gi == len(self._pushed):
                g_idx = ctypes.c_int32(-1)
                check(_optim._add_group(self._fo._handle, ctypes.byref(_optim.config(**hp)),
                                        ctypes.byref(g_idx)))
                self._pushed.append(hp)
            if hp != self._pushed[gi]:
                self._fo.set_group_config(gi, _optim.config(**hp))
                self._pushed[gi] = hp
        if len(self._index) < sum(len(g["params"]) for g in self.param_groups):
            for gi, p, name in self._names():
                if p not in self._index and (p.grad is not None or p in also):
                    self._register(p, gi, name)
        self._stand_ins_in()  # parameters edited in place since: fo reads their stand-ins next

    def _flush(self):
        """Edits made through `opt.state` reach fo (see fo._torch_state); a step left open
        (overlap=True: backward handed gradients over, step() not called) is rolled back first."""
        self._settle_open()
        reset = self.state.resets()
        if self._fo is not None and (reset or self._moved()):  # state of the parameters as they are now
            self._rebuild(reset)
        edits = self.state.edits()
        if edits:
            self._sync(also=set(edits))
            for p, entries in edits.items():
                self._load_param(p, entries)
        self._take_up_edits()  # offloaded parameters edited in place (fo._torch_offload)
        self._stand_ins_in()  # and non-contiguous ones (fo._torch_strided)

    # -- the step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        if _compile.is_compiling():  # one opaque op for Dynamo (fo._torch_compile)
            return _compile.step(self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step()
        return loss

    def _step(self):
        stepped = False
        try:
            if self._grad_scaler_step():
                if self._ov["overlap"]:
                    self._end()
                else:
                    self._plain_step()
                self._stand_ins_out([p for p in self._stand_in if p.grad is not None])
                self.state.after_step()
                stepped = True
        finally:
            self._after_step(stepped)  # overlap=True times the loop's iterations (fo._torch_overlap_tune)

    def _plain_step(self):
        """fo's clip (with max_grad_norm) then one fo_optimizer_step over every gradient;
        returns how many parameters had one."""
        if self._ov["max_grad_norm"] is not None:
            self._clip_now()
        self._flush()
        self._sync()
        self._use_current_stream()
        n = len(self._index)
        if self._grads is None or self._grads.n != n:
            self._grads = GradArray(n)
        grads, given, strided = self._grads, 0, torch.strided
        try:
            for p, i, name in self._order:
                g = p.grad
                if g is None:
                    grads.clear(i)
                elif g.layout != strided:
                    raise RuntimeError(_checks.sparse_message(self, name))
                else:
                    grads.set(i, g, name)
                    given += 1
            check(_optim._step(self._fo._handle, grads.array, n))
        finally:
            grads.release()
            self._unscaled = False
        return given

    # -- state ------------------------------------------------------------------------
    def _has_state(self, p):
        self._settle_open()  # state is read: a step left open is rolled back (fo._torch_overlap)
        i = self._index.get(p)
        return i is not None and bool(self._fo.state_keys(i))

    def _export_keys(self, p):
        """The keys `_export(p)` gives (torch's names; `master` when error bits are kept)."""
        native = self._fo.state_keys(self._index[p])
        keys = [k for k in PORTABLE if k in native or k + _names.CODES_SUFFIX in native]
        return keys + [_names.MASTER] if _names.ERROR_BITS in native else keys

    def _export(self, p, local_only=False):
        """Parameter p's state in torch's keys, decoded to float32 (`master`: the float32
        master weight, present when error bits are kept)."""
        i = self._index[p]
        out = {key: self._get(i, key, p) for key in self._export_keys(p)}
        if not local_only:
            out = {k: (v if k == "step" else like_param(v, p)) for k, v in out.items()}
        return out

    def _get(self, i, key, p):
        # decoded keys are shaped like the local parameter (`step` 0-dim): fo_optimizer_state_info
        # is not asked, to keep each read one call; float32 host state is lent, not decoded. A
        # CUDA parameter's state lives on its device, where fo lends nothing: it is decoded
        # through host memory (fo waits for its stream) and handed out on the parameter's
        # device, as torch.optim keeps it (`step` stays a host scalar, as torch's non-fused
        # optimizers keep it)
        cuda = self._device.get(p, -1) >= 0
        if key in _LENDABLE and not cuda:
            t = self.state.lend(i, p, key, local(p).shape)
            if t is not None:
                return t
        t = torch.empty(() if key == "step" else local(p).shape, dtype=torch.float32)
        self._read(i, key, t)
        return t.to(local(p).device) if cuda and key != "step" else t

    def _read(self, i, key, out):
        """Decodes state `key` of fo parameter `i` straight into `out` (a host tensor of the
        state's shape; fo checks dtype, shape and strides before writing anything)."""
        arg = TorchArg(out, f"state {key}")
        check(_optim._get_state(self._fo._handle, i, key.encode(), ctypes.byref(arg.struct)))

    def _refresh(self, p, key, t):
        """A state tensor handed out earlier and still held (`t`, local) gets p's current `key`:
        decoded straight into it when it is a float32 host tensor of the state's shape (what
        was handed out), else copied in from a fresh decode; left alone if its shape changed."""
        if tuple(t.shape) != (() if key == "step" else tuple(local(p).shape)):
            return
        if t.dtype == torch.float32 and t.device.type == "cpu":
            self._read(self._index[p], key, t)
            torch.autograd.graph.increment_version(t)  # written in place, as copy_ would count it
        else:
            t.copy_(self._get(self._index[p], key, p))

    def _load_param(self, p, entries):
        keys, args = [], []
        for k, v in entries.items():
            if k not in PORTABLE and k != "master":
                continue
            if not isinstance(v, torch.Tensor):
                v = torch.tensor(float(v))
            v = local(v).detach()
            v = (v.float() if k == "step" else v).cpu().contiguous()
            keys.append(k)
            args.append(TorchArg(v, f"state {k}"))
        if not keys:
            return
        ckeys = (ctypes.c_char_p * len(keys))(*[k.encode() for k in keys])
        check(_optim._set_state(self._fo._handle, self._index[p], ckeys, tensor_array(args), len(keys)))
        if "master" in keys:  # fo wrote the parameter's values
            self._stand_ins_out([p])


def _torch_flags(kind, foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 offload=None, **overlap):
    """torch's implementation flags. fo's step is always one fused kernel per parameter, so
    `fused` and `foreach` are accepted with any value, kept in param_groups as torch keeps
    them, and change nothing. `capturable` (CUDA-graph capture) is refused: fo's step is a
    host call that launches its own kernels, not capturable work.
    `kind` (the optimizer's name) names the constructor when a keyword is unknown."""
    _checks.unexpected(kind, [k for k in overlap if k not in OPTION_KEYS])
    if capturable:
        raise error(UNSUPPORTED, "capturable=True keeps step counts on the GPU for CUDA-graph capture; "
                                 "fo's step is not captured in a CUDA graph: drop capturable "
                                 "(fused/foreach are accepted)")
    return dict(foreach=foreach, maximize=maximize, capturable=capturable, differentiable=differentiable,
                fused=fused, offload=check_offload(offload), **overlap_options(**overlap))


def _fo_args(state_format, master_weight_bits, arithmetic):
    return dict(state_format=state_format, master_weight_bits=master_weight_bits, arithmetic=arithmetic)


class AdamW(_FoOptimizer):
    """torch.optim.AdamW's arguments, plus fo's:
    - `state_format="quant8"` (default: 2.125 B/param of state vs torch's 8; "fp32": torch's
      arithmetic and trajectories, 8 B/param; "quant8_wide"; "param_dtype");
    - `master_weight_bits=0` (24/32 keep int8/int16 error bits for bf16/f16 params: +1/+2 B/param);
    - `arithmetic` (None, the default: "fast", within fo's stated bound of exact per step, a
      quant8 step ~3.5x faster than "exact" on the host (scripts/bench_torch_step.py) and
      1.13x on an H200 (fo selftest); "exact": FlashOptim's bits; fp32 state steps the same
      under both; a GPU steps either with the host's bits).
    `fused`/`foreach` are accepted and change nothing (fo's step is fused). Every fo.torch
    optimizer also takes `overlap=False` (True: step parameters during backward, kept only
    where the loop's iterations measure faster so; "always": in every backward),
    `max_grad_norm=None`, `norm_type=2.0`, `error_if_nonfinite=False` and
    `undo_budget_bytes=0` (fo._torch_overlap), and `offload=None`
    (a fraction or a predicate (name, param): CUDA parameters whose master weights and state
    fo keeps and steps on the host, fo._torch_offload)."""

    algorithm = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 state_format="quant8", master_weight_bits=0, arithmetic=None, **flags):
        flags = _torch_flags("AdamW", **flags)  # first: Python refuses an unknown keyword before the body runs
        _checks.adam(lr, betas, eps, weight_decay, flags["foreach"], flags["capturable"])
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                      **flags, decoupled_weight_decay=True,
                                      **_fo_args(state_format, master_weight_bits, arithmetic)))

    def _hp(self, g):
        return dict(betas=tuple(float(b) for b in g["betas"]), eps=float(g["eps"]))


class Adam(AdamW):
    """torch.optim.Adam: L2 weight decay added to the gradient, or AdamW's decoupled decay
    with `decoupled_weight_decay=True`; fo's arguments as AdamW's."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 decoupled_weight_decay=False, state_format="quant8", master_weight_bits=0,
                 arithmetic=None, **flags):
        flags = _torch_flags("Adam", **flags)
        _checks.adam(lr, betas, eps, weight_decay, flags["foreach"], flags["capturable"])
        _FoOptimizer.__init__(self, params, dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **flags,
            decoupled_weight_decay=decoupled_weight_decay, **_fo_args(state_format, master_weight_bits, arithmetic)))

    @property
    def algorithm(self):
        return "adamw" if self.defaults["decoupled_weight_decay"] else "adam"

    def _algorithm(self, group):
        return "adamw" if group.get("decoupled_weight_decay", self.defaults["decoupled_weight_decay"]) else "adam"


class SGD(_FoOptimizer):
    """torch.optim.SGD (L2 weight decay, torch's dampening and nesterov); fo's arguments as
    AdamW's (state is the momentum buffer, absent without momentum)."""

    algorithm = "sgd"

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 state_format="quant8", master_weight_bits=0, arithmetic=None, **flags):
        flags = _torch_flags("SGD", **flags)
        _checks.sgd(lr, momentum, dampening, weight_decay, nesterov)
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov, **flags,
                                      **_fo_args(state_format, master_weight_bits, arithmetic)))

    def _hp(self, g):
        return dict(momentum=float(g["momentum"]), dampening=float(g["dampening"]), nesterov=bool(g["nesterov"]))

    def _dropped_state(self):
        """Parameters stepped without momentum in a group that now has it: torch starts their
        buffer from the next gradient; fo registers them again, without state, to do the same."""
        return {p for gi, g in enumerate(self.param_groups[:len(self._pushed)])
                if self._pushed[gi].get("momentum") == 0 and float(g["momentum"]) != 0
                for p in g["params"] if p in self._index}


class Lion(_FoOptimizer):
    """Lion (Chen et al. 2023): sign of the interpolated momentum, decoupled weight decay;
    state `exp_avg`. fo's arguments as AdamW's."""

    algorithm = "lion"

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, state_format="quant8",
                 master_weight_bits=0, arithmetic=None, **flags):
        flags = _torch_flags("Lion", **flags)
        _checks.lion(lr, betas, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, **flags,
                                      **_fo_args(state_format, master_weight_bits, arithmetic)))

    def _hp(self, g):
        return dict(betas=tuple(float(b) for b in g["betas"]))
