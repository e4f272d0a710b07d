"""`optimizer.state` for fo.torch: torch's mapping param -> {key: tensor} over the state fo
holds (possibly quantized), with torch's semantics for edits.

fo keeps compressed state in its own buffers, so the tensors handed out for it are decoded
float32 copies. To behave like torch's live state tensors:
- an in-place edit (`opt.state[p]["exp_avg"].zero_()`) or an assignment into the dict
  (`opt.state[p]["step"] = torch.tensor(0.)`, `opt.state[p] = {...}`) reaches fo before the next step, `state_dict()`
  or checkpoint save, encoded into the group's state format (exact for fp32 state;
  requantized, i.e. rounded to the stored resolution, for quant8 and param_dtype);
- a tensor still held after a step is refreshed in place with the new state, so it follows
  the optimizer as torch's do (only held tensors cost a decode; dropped ones cost nothing).
Edits are detected by torch's version counter (`tensor._version`), which every in-place op
bumps; nothing is compared by value. A parameter's state emptied (`opt.state[p] = {}`,
`opt.state[p].clear()`, `del opt.state[p]`, `opt.state.clear()`, `opt.state =
defaultdict(dict)`) starts over at the next step, as torch's does: fo registers it again
without state (`Rebuild`).

float32 state on the host is not copied at all: its tensors are fo's live buffers
(`fo_optimizer_share_state`), as torch's own state tensors are its optimizer's, so a DCP
save copies them once. Those need neither edit detection (an edit is already fo's state)
nor a refresh after a step (fo wrote them in place); `live` tells them apart by address.
Only `fo.torch` imports this module (it needs torch)."""
import weakref
from collections.abc import MutableMapping

import torch

from ._torch_args import INVALID_ARGUMENT, error, local, version as _version


class ParamState(dict):
    """One parameter's decoded state, as handed out by `optimizer.state[p]`."""

    __slots__ = ("seen", "__weakref__")

    def __init__(self, entries):
        super().__init__(entries)
        self.mark()

    def mark(self):
        """Remembers each entry (tensor object and version) as fo holds it now."""
        self.seen = {k: (v, _version(v)) for k, v in self.items()}

    def edited(self):
        """{key: tensor} assigned or edited in place since `mark` (a removed key is not
        an edit: fo's state has no per-key reset)."""
        return {k: v for k, v in self.items() if k not in self.seen or v is not self.seen[k][0]
                or _version(v) != self.seen[k][1]}


class State(MutableMapping):
    """`optimizer.state`: param -> ParamState for every parameter with fo state (torch's
    `defaultdict(dict)` answers `{}` for the others; so does this, and what is assigned into
    that dict is loaded into fo like any edit)."""

    def __init__(self, opt):
        self._opt = opt
        self.emptied = set()  # parameters whose state was deleted or assigned empty
        self.handed = {}  # param -> ParamState handed out since the last step
        self.watched = {}  # (param, key) -> (weakref to a tensor handed out before a step, version)
        self.live = {}  # (param, key) -> address of fo's live buffer lent for it
        self.lent = set()  # those addresses, for `is_lent` in O(1) (it runs per held tensor)

    def lend(self, i, p, key, shape):
        """fo's live float32 buffer of state `key` of p (fo index i) as a tensor of `shape`,
        or None where the state is stored otherwise (then it is decoded)."""
        arr = self._opt._fo._lend(i, key)
        if arr is None:
            return None
        t = torch.from_numpy(arr).view(shape)
        old = self.live.get((p, key))
        if old != t.data_ptr():
            self.lent.discard(old)  # one buffer per (param, key): no other key holds it
            self.live[(p, key)] = t.data_ptr()
            self.lent.add(t.data_ptr())
        return t

    def is_live(self, p, key, t):
        return t.numel() > 0 and self.live.get((p, key)) == local(t).data_ptr()

    def is_lent(self, t):
        """Whether `t` is one of fo's live buffers, whichever state it is: a refresh must
        never write into it (it may have been assigned as another parameter's state)."""
        return t.numel() > 0 and local(t).data_ptr() in self.lent

    def forget_live(self):
        """fo's buffers were replaced (the optimizer was rebuilt): tensors lent before are
        plain copies from now on, refreshed and checked for edits like any other."""
        self.live.clear()
        self.lent.clear()

    def __getitem__(self, p):
        st = self.handed.get(p)
        if st is not None:
            return st
        if not self._opt._has_state(p):
            entries = {}
        else:
            entries = self._opt._export(p)
            for k in entries:  # a tensor still held from before a step keeps its identity
                ref = self.watched.get((p, k))
                t = ref[0]() if ref is not None else None
                # (not another state's live buffer assigned here: it shows that state)
                if t is not None and t.shape == entries[k].shape and (
                        not self.is_lent(t) or self.is_live(p, k, t)):
                    entries[k] = t
        st = self.handed[p] = ParamState(entries)
        return st

    def __setitem__(self, p, entries):
        """`opt.state[p] = {...}` (what ZeroRedundancyOptimizer.load_state_dict does): every
        entry reaches fo before the next step, like an edit."""
        st = self.handed[p] = ParamState(dict(entries))
        st.seen = {}
        if not st:
            self.emptied.add(p)

    def __delitem__(self, p):
        """`del opt.state[p]` (and so `pop`, `clear`): p's state starts over at the next step."""
        if p not in self:
            raise KeyError(p)
        self[p] = {}

    def replace(self, entries):
        """`opt.state = mapping` (a reset to `defaultdict(dict)`, or any param -> dict): every
        parameter's state is dropped, then what `entries` holds is loaded like an edit."""
        self.clear()
        for p, st in dict(entries).items():
            if st:
                self[p] = st

    def resets(self):
        """The parameters whose state must start over (all of it emptied since it was handed
        out); a state that lost only some keys is refused, naming them (torch's step would
        fail on it too)."""
        out = set(self.emptied)
        for p, st in self.handed.items():
            gone = [k for k in st.seen if k not in st]
            if gone and st:
                raise error(INVALID_ARGUMENT, f"the state of parameter {self._opt._name.get(p, '?')} lost "
                                              f"{gone} but keeps {sorted(st)}: empty it whole to start it over")
            if gone:
                out.add(p)
        self.emptied = set()
        for p in out:
            self.handed.pop(p, None)
        return {p for p in out if p in self._opt._index}

    def __contains__(self, p):
        if p in self.emptied:
            return False
        return self._opt._has_state(p) or bool(self.handed.get(p))

    def clear(self):
        for p in list(self):
            self[p] = {}

    def __iter__(self):
        return iter([p for p in list(self._opt._index) if p in self])

    def __len__(self):
        return sum(1 for _ in self)

    def __repr__(self):
        return f"fo.torch state of {len(self)} parameters (decoded on access)"

    def edits(self):
        """{param: {key: tensor}} for every parameter whose handed-out state was edited."""
        out = {}
        for (p, k), (ref, ver) in list(self.watched.items()):
            t = ref()
            if t is None:
                del self.watched[(p, k)]
            elif _version(t) != ver and not self.is_live(p, k, t):
                out.setdefault(p, {})[k] = t
        for p, st in self.handed.items():
            e = {k: v for k, v in st.edited().items() if not self.is_live(p, k, v)}
            if e:
                out.setdefault(p, {}).update(e)
        for st in self.handed.values():
            st.mark()
        for key, (ref, _) in list(self.watched.items()):
            t = ref()
            if t is not None:
                self.watched[key] = (ref, _version(t))
        return out

    @torch.no_grad()
    def after_step(self):
        """Tensors handed out before this step that are still held get the new state."""
        for p, st in self.handed.items():
            for k, v in st.items():
                self.watched[(p, k)] = (weakref.ref(v), None)
        self.handed.clear()
        keys = {}
        for (p, k), (ref, _) in list(self.watched.items()):
            t = ref()
            if t is None:
                del self.watched[(p, k)]
                continue
            if p not in keys:
                keys[p] = self._opt._export_keys(p) if self._opt._has_state(p) else ()
            if k in keys[p] and not self.is_lent(t):
                self._opt._refresh(p, k, local(t))  # decoded straight into t, no copy in between
            self.watched[(p, k)] = (ref, _version(t))


class Rebuild:
    """Mixed into fo.torch's optimizers: `optimizer.state`, and fo registering the parameters
    again, carrying their state over decoded, when a parameter's storage moved (its module
    reloaded or re-sharded), a parameter left the optimizer or changed group
    (`param_groups[i]["params"]` edited), or some parameters' state must start over
    (`reset`: torch's emptied `opt.state[p]`, a loaded state dict without them, SGD's
    momentum turned on)."""

    @property
    def state(self):
        """torch's `optimizer.state`, over fo's state (fo._torch_state.State)."""
        return self.__dict__["_fo_state"]

    @state.setter
    def state(self, value):
        """`opt.state = defaultdict(dict)` (or any param -> dict) drops every parameter's
        state and loads what `value` holds, as torch's next step would see it."""
        held = self.__dict__.get("_fo_state")
        if isinstance(held, State) and not isinstance(value, State):
            held.replace(value)
        else:  # fo's own State, or torch's __init__ setting its defaultdict before fo's exists
            self.__dict__["_fo_state"] = value

    def _regrouped(self):
        """Whether a registered parameter left the param groups or moved to another one since
        it was registered (a cheap look at the groups' parameter lists first)."""
        layout = tuple(tuple(map(id, g["params"])) for g in self.param_groups)
        if layout == self._layout:
            return False
        self._layout = layout
        group = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        return any(group.get(id(p)) != gi for p, gi in self._group_of.items())

    def _dropped_state(self):
        """Parameters whose state the current param_groups leave no place for (SGD overrides)."""
        return set()

    def _rebuild(self, reset=()):
        """Master weights go over with a parameter whose storage stayed (its error bits) and
        with a reset one; a parameter that moved holds whatever was written into it."""
        moved = {p for p in self._index if self._where[p] != self._placed(p)}
        saved = {p: self._export(p, local_only=True) for p in self._index if self._has_state(p)}
        self._fo.close()
        self.state.forget_live()
        self._fo, self._index, self._where, self._keep, self._pushed, self._device = None, {}, {}, {}, [], {}
        self._order, self._group_of = [], {}
        self._mirror_version, self._stand_in = {}, {}
        self._sync(also=set(saved) | set(reset))
        for p, st in saved.items():
            if p not in self._index:  # no longer in any param group: its state goes with it
                continue
            if p in moved:
                st.pop("master", None)
            if p in reset:
                st = {k: v for k, v in st.items() if k == "master"}
            self._load_param(p, st)
