"""Owns torch's optimizer layout: fo state (from an optimizer, or as `fo.ckpt` reads it from a
directory) arranged as torch's nested `Optimizer.state_dict()`, by FQN, or flattened.

fo's checkpoint keys are torch's *flattened* names (`state.<fqn>.exp_avg`), which
`torch.optim.Optimizer.load_state_dict` does not understand: handed such a dict it keys
nothing by a parameter and raises nothing. `fo.ckpt.torch_state_dict` builds what torch
loads (this module arranges it; it reads nothing itself):

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

from typing import Any

import numpy as np

from . import _codes as N

# Hyper-parameters torch's optimizers keep in every param group besides the ones fo stores.
# Without all of them, `set_optimizer_state_dict(flatten_optimizer_state_dict=True)` fails
# with a KeyError (it reads every key of the live torch group from the flattened dict).
_ADAM_FLAGS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
               "differentiable": False, "fused": None}
_SGD_FLAGS = {"maximize": False, "foreach": None, "differentiable": False, "fused": None}

# torch's state names per fo algorithm (as fo's param_groups spell it), in torch's order.
_ADAM_STATE = (N.STEP, N.EXP_AVG, N.EXP_AVG_SQ)
STATE_NAMES = {"AdamW": _ADAM_STATE, "Adam": _ADAM_STATE, "SGD": (N.MOMENTUM_BUFFER,),
               "SGDW": (N.MOMENTUM_BUFFER,), "Lion": (N.EXP_AVG,)}


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


def state_key(fqn: str, name: str) -> str:
    """The flattened key of state `name` of parameter `fqn` (`state.<fqn>.<name>`)."""
    return f"{N.STATE_PREFIX}{fqn}.{name}"


def optimizer_state(opt):
    """(param_groups, {fqn: {torch name: float32 array}}) for every parameter of `opt` (an
    `fo.Optimizer`) that has state."""
    groups = opt.param_groups
    alg_of = {fqn: g["algorithm"] for g in groups for fqn in g["params"]}
    out = {}
    for i, fqn in enumerate(opt.fqns):
        held = {k.split(N.PART_SEPARATOR)[0] for k in opt.state_keys(i)}
        names = [n for n in STATE_NAMES[alg_of[fqn]] if n in held]
        if names:
            out[fqn] = {n: opt.get_state(i, n, dtype=np.float32) for n in names}
    return groups, out


def check_options(key_by: str, flatten: bool, framework: str) -> str:
    """The key_by that `arrange` uses (flatten implies FQN keys); ValueError on a bad option."""
    if key_by not in ("index", "fqn"):
        raise ValueError(f"key_by must be 'index' or 'fqn', got {key_by!r}")
    if framework not in ("pt", "numpy"):
        raise ValueError(f"framework must be 'pt' or 'numpy', got {framework!r}")
    return "fqn" if flatten else key_by


def arrange(groups, state, key_by: str = "index", flatten: bool = False, framework: str = "pt") -> dict[Any, Any]:
    """fo's param groups and {fqn: {name: float32 array}} in torch's layout (see
    `fo.ckpt.torch_state_dict` for the options)."""
    key_by = check_options(key_by, flatten, framework)
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
    flat = {state_key(fqn, n): v for fqn, s in state.items() for n, v in s.items()}
    for g in torch_groups:
        for fqn in g["params"]:
            flat.update({f"param_groups.{fqn}.{k}": v for k, v in g.items() if k != "params"})
    return flat
