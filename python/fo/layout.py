"""fo optimizer state in torch's nested `Optimizer.state_dict()` layout.

fo's checkpoint keys are torch's *flattened* names (`state.<fqn>.exp_avg`), which
`torch.optim.Optimizer.load_state_dict` does not understand: handed such a dict it keys
nothing by a parameter and raises nothing. `torch_state_dict` builds what torch loads:

    {"state": {0: {"step", "exp_avg", "exp_avg_sq"}, 1: {"momentum_buffer"}, ...},
     "param_groups": [{"lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize",
                       "capturable", "differentiable", "fused", "decoupled_weight_decay",
                       "initial_lr", "params": [0, ...]}, ...]}

keyed by index (torch's `Optimizer.state_dict()`), by FQN (what
`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` returns), or flattened
(`flatten_optimizer_state_dict=True`: `state.<fqn>.<name>` and `param_groups.<fqn>.<key>`).
Compressed state (quant8, bf16/fp16 `param_dtype`) is decoded to float32; fo's extra state
(`error_bits`, `master`) has no torch counterpart and is left out.
"""
from __future__ import annotations

import os
from typing import Any, Union

import numpy as np

# Hyper-parameters torch's optimizers keep in every param group besides the ones fo stores.
# Without all of them, `set_optimizer_state_dict(flatten_optimizer_state_dict=True)` fails
# with a KeyError (it reads every key of the live torch group from the flattened dict).
_ADAM_FLAGS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
               "differentiable": False, "fused": None}
_SGD_FLAGS = {"maximize": False, "foreach": None, "differentiable": False, "fused": None}

# torch's state names per fo algorithm (as fo's param_groups spell it), in torch's order.
_STATE_NAMES = {"AdamW": ("step", "exp_avg", "exp_avg_sq"), "Adam": ("step", "exp_avg", "exp_avg_sq"),
                "SGD": ("momentum_buffer",), "SGDW": ("momentum_buffer",), "Lion": ("exp_avg",)}


def torch_param_group(group: dict[str, Any]) -> dict[str, Any]:
    """One fo param group (as `Optimizer.param_groups` / checkpoint metadata give it) with
    torch's keys and values; `params` is copied as given."""
    alg = group["algorithm"]
    out = {"lr": group["lr"]}
    if alg in ("AdamW", "Adam"):
        out.update(betas=tuple(group["betas"]), eps=group["eps"], weight_decay=group["weight_decay"])
        out.update(_ADAM_FLAGS, decoupled_weight_decay=alg == "AdamW")
    elif alg in ("SGD", "SGDW"):
        out.update(momentum=group["momentum"], dampening=group["dampening"], weight_decay=group["weight_decay"],
                   nesterov=bool(group["nesterov"]))
        out.update(_SGD_FLAGS)
        if alg == "SGDW":
            out["decoupled_weight_decay"] = True
    elif alg == "Lion":
        out.update(betas=tuple(group["betas"]), weight_decay=group["weight_decay"], maximize=False,
                   foreach=None)
    else:
        raise ValueError(f"param group with unknown algorithm {alg!r}")
    out["initial_lr"] = group["initial_lr"]  # what torch's lr schedulers store in a group
    out["params"] = list(group["params"])
    return out


def _optimizer_state(opt):
    """{fqn: {torch name: float32 array}} for every parameter of `opt` that has state."""
    groups = opt.param_groups
    alg_of = {fqn: g["algorithm"] for g in groups for fqn in g["params"]}
    out = {}
    for i, fqn in enumerate(opt.fqns):
        held = {k.split("::")[0] for k in opt.state_keys(i)}
        names = [n for n in _STATE_NAMES[alg_of[fqn]] if n in held]
        if names:
            out[fqn] = {n: opt.get_state(i, n, dtype=np.float32) for n in names}
    return groups, out


def _checkpoint_state(directory):
    """Every rank's state of an fo checkpoint directory, assembled to full tensors and
    decoded to float32 by fo's loader (exact: dequantized with the groups it was saved with,
    whatever the saved sharding), then read back as from an optimizer."""
    from . import ckpt
    from ._codes import FO_ERR_NOT_FOUND
    from ._ffi import FoError
    from .optim import Optimizer

    # The library reads the committed save's files (validated) and names its keys: a
    # compressed pair is listed as its logical key, with the codes' global shape.
    try:
        toc = ckpt.info(directory)
    except FoError as e:
        if e.status == FO_ERR_NOT_FOUND:
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
            shape = next((shapes[k] for k in _shape_keys(fqn, g["algorithm"]) if k in shapes), None)
            if shape is None:
                continue  # never stepped: no state, as in torch
            w = np.zeros(shape, np.float32)
            keep.append(w)
            opt.add_param(fqn, w, group=gi)
    if opt is None or not keep:
        return groups, {}
    ckpt.load(opt, directory, strict=False, params=False, param_groups=False)
    _, state = _optimizer_state(opt)
    return groups, state


def _shape_keys(fqn, alg):
    for name in _STATE_NAMES[alg]:
        if name != "step":
            yield f"state.{fqn}.{name}"


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
    if key_by not in ("index", "fqn"):
        raise ValueError(f"key_by must be 'index' or 'fqn', got {key_by!r}")
    if framework not in ("pt", "numpy"):
        raise ValueError(f"framework must be 'pt' or 'numpy', got {framework!r}")
    if flatten and key_by == "index":
        key_by = "fqn"
    if isinstance(source, (str, os.PathLike)):
        groups, state = _checkpoint_state(source)
    else:
        groups, state = _optimizer_state(source)
    if framework == "pt":
        import torch
        # np.ascontiguousarray makes a 0-dim array 1-dim: reshape keeps `step` 0-dim, as torch's
        state = {f: {n: torch.from_numpy(np.ascontiguousarray(v).reshape(v.shape)) for n, v in s.items()}
                 for f, s in state.items()}
    torch_groups = [torch_param_group(g) for g in groups]
    if key_by == "index":
        index: dict[str, int] = {}
        for g in torch_groups:
            g["params"] = [index.setdefault(fqn, len(index)) for fqn in g["params"]]
        state = {index[f]: s for f, s in state.items()}
    if not flatten:
        return {"state": state, "param_groups": torch_groups}
    flat = {f"state.{fqn}.{n}": v for fqn, s in state.items() for n, v in s.items()}
    for g in torch_groups:
        for fqn in g["params"]:
            flat.update({f"param_groups.{fqn}.{k}": v for k, v in g.items() if k != "params"})
    return flat
