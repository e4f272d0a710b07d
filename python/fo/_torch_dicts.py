"""fo.torch's dicts and copies: `state_dict()` / `load_state_dict()` in torch.optim's layout
(indices counted across groups; fo's storage keys kept on load), and the pickled form that
`copy.deepcopy` and pickle go through (the state decoded, a new fo handle built from it,
the overlap options and each parameter's placement, `offload=`, carried over).

Only `fo.torch` imports this module (it needs torch)."""
from ._torch_overlap import overlap_options
from ._torch_storage import FO_KEYS


class Dicts:
    """Mixed into fo.torch's optimizers (which provide `_flush`, `_sync`, `_has_state`,
    `_export`, `_load_param`, `_fresh`, `_overlap_init`, `_is_offloaded` and torch's
    Optimizer)."""

    def state_dict(self):
        """torch's layout: {"state": {index: {...}}, "param_groups": [...]} with indices
        counted across groups in order, as `torch.optim.Optimizer.state_dict` numbers them."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        self._flush()
        state, groups, start = {}, [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            for j, p in enumerate(g["params"]):
                if self._has_state(p):
                    state[start + j] = self._export(p)
            start += len(g["params"])
            groups.append(packed)
        out = {"state": state, "param_groups": groups}
        for hook in self._optimizer_state_dict_post_hooks.values():
            out = hook(self, out) or out
        return out

    def load_state_dict(self, state_dict):
        """Loads torch's layout (from fo.torch or torch.optim, any state format) into this
        optimizer's own format; group hyper-parameters come from the checkpoint, fo's
        storage keys (`state_format`, `master_weight_bits`, `arithmetic`) stay as they are."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, "
                             f"this optimizer has {len(self.param_groups)}")
        by_id = {}
        for gi, s in enumerate(saved_groups):
            self._refuse_flags(s, f" (param group {gi} of the loaded state dict)")
        for gi, (g, s) in enumerate(zip(self.param_groups, saved_groups)):
            if len(s["params"]) != len(g["params"]):
                raise ValueError(f"loaded param group {gi} has {len(s['params'])} parameters, "
                                 f"this optimizer's has {len(g['params'])}")
            by_id.update(zip(s["params"], g["params"]))
        unknown = [k for k in state_dict["state"] if k not in by_id]
        if unknown:
            raise ValueError(f"state for parameters {unknown} that no param group lists")
        for g, s in zip(self.param_groups, saved_groups):
            for k, v in s.items():
                if k not in ("params", "param_names") and k not in FO_KEYS:
                    g[k] = v
        self._flush()
        loaded = {by_id[k] for k in state_dict["state"]}
        missing = {p for p in self._index if p not in loaded and self._has_state(p)}
        if missing:  # state the loaded dict has none for starts over, as torch's does
            self._rebuild(missing)
        self._sync(also=loaded)
        for k, entries in state_dict["state"].items():
            self._load_param(by_id[k], entries)
        self.state.after_step()  # tensors handed out before the load now show it
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # -- copies -----------------------------------------------------------------------
    def __getstate__(self):
        """torch's pickled form (defaults, param_groups, state keyed by parameter), with the
        state decoded; `__setstate__` builds a new fo handle from it, so a deep copy or an
        unpickled optimizer steps on its own parameters and state."""
        self._flush()
        state = {p: self._export(p) for p in self._index if self._has_state(p)}
        placed = [[self._is_offloaded(p) for p in g["params"]] for g in self.param_groups]
        return {"defaults": self.defaults, "state": state, "param_groups": self.param_groups, "fo_overlap": self._ov,
                "fo_offload": (self._offload_arg, placed)}

    def __setstate__(self, saved):
        saved = dict(saved)
        state = saved.pop("state", {})
        options = saved.pop("fo_overlap", None) or overlap_options()
        self._offload_arg, placed = saved.pop("fo_offload", None) or (None, [])
        self._fresh()
        self._ov, self._hooked, self._placing = options, False, False
        super().__setstate__(saved)  # torch's: hooks, the patched step
        self._offloaded = {p: off for g, offs in zip(self.param_groups, placed) for p, off in zip(g["params"], offs)}
        self._overlap_init(options)  # overlap=True: hooks on this copy's parameters
        if state:
            self._sync(also=set(state))
            for p, entries in state.items():
                self._load_param(p, entries)
