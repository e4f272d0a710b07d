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
bumps; nothing is compared by value.

float32 state on the host is not copied at all: its tensors are fo's live buffers
(`fo_optimizer_share_state`), as torch's own state tensors are its optimizer's, so a DCP
save copies them once. Those need neither edit detection (an edit is already fo's state)
nor a refresh after a step (fo wrote them in place); `live` tells them apart by address.
Only `fo.torch` imports this module (it needs torch)."""
import weakref
from collections.abc import Mapping

import torch

from ._torch_args import local, version as _version


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


class State(Mapping):
    """`optimizer.state`: param -> ParamState for every parameter with fo state (torch's
    `defaultdict(dict)` answers `{}` for the others; so does this, and what is assigned into
    that dict is loaded into fo like any edit)."""

    def __init__(self, opt):
        self._opt = opt
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

    def __contains__(self, p):
        return self._opt._has_state(p) or bool(self.handed.get(p))

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
