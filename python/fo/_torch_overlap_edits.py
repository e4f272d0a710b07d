"""Which gradients changed between their hand-over and `step()` (fo._torch_overlap's
`_end`): the early steps of those must be redone with the final gradients.

torch counts in-place edits of a tensor in `_version`, and a replaced `.grad` is another
tensor; but the counter misses edits made through `.data` (a separate counter) and counts
edits that leave the bits as they were: `clip_grad_norm_` multiplies every gradient by its
clip coefficient clamped to 1, so a clip that does not trigger (HF Trainer's default
`max_grad_norm=1.0` in most steps; `max_grad_norm=0` still clips by inf) bumps every counter
and changes nothing. So for host gradients fo stepped early, fo itself answers
(`fo_optimizer_grads_changed`): those whose counter moved are compared by every byte (once a
step has seen a counter move, fo fingerprints every byte of each gradient it steps early,
`fo_optimizer_set_full_fingerprints`; before that they count as changed), the others by a
sampled fingerprint (8 bytes in every 1024: an edit through `.data` that scales, averages
or clips a gradient is seen; one of a few elements between those bytes is not). Gradients
on a GPU, or stepped early from a GPU copy, are judged by their counters alone.

Only fo._torch_overlap imports this module (it needs torch)."""
import ctypes

from . import optim as _optim
from ._ffi import check
from ._torch_args import local


def grad_mark(g):
    """What tells whether a gradient changed since it was handed over: the tensor object (a
    replaced `.grad` is another one) and its in-place edit counters (a DTensor's and its
    local shard's: FSDP2 accumulates into the local tensor)."""
    if g is None:
        return None
    loc = local(g)
    try:
        return g, g._version, loc._version
    except RuntimeError:  # an inference-mode tensor has no version counter: identity only
        return g, None, None


def same_grad(mark, g):
    return mark is not None and g is mark[0] and grad_mark(g)[1:] == mark[1:]


def _read_on_host(p):
    """Whether fo's early step of `p` read its gradient in host memory (where fo can read it
    again): a host parameter with a host gradient."""
    return p.device.type == "cpu" and local(p.grad).device.type == "cpu"


def changed_since_hand_over(opt):
    """The handed-over parameters of `opt` whose gradient changed since (replaced or
    removed; edited in place to other bits; all of them after a GradScaler unscale), and
    whether any edit counter moved (the next steps then keep full fingerprints)."""
    if opt._unscaled:  # every bit moved: no fingerprint could tell otherwise
        return list(opt._handed), False
    changed, full, moved = [], [], False
    for p in opt._handed:
        mark = opt._marks.get(p)
        if mark is None or p.grad is not mark[0]:
            changed.append(p)
        elif grad_mark(p.grad)[1:] != mark[1:]:
            moved = True
            (full if _read_on_host(p) else changed).append(p)
    idx = [opt._index[p] for p in full]
    cap = len(opt._handed)
    out, n = (ctypes.c_int32 * max(cap, 1))(), ctypes.c_size_t(0)
    check(_optim._grads_changed(opt._fo._handle, (ctypes.c_int32 * max(len(idx), 1))(*idx), len(idx), out,
                                cap, ctypes.byref(n)))
    if n.value:
        by_index = {opt._index[p]: p for p in opt._handed}
        named = {by_index[i] for i in out[:n.value] if i in by_index}
        already = set(changed)
        changed += [p for p in opt._handed if p in named and p not in already]
    return changed, moved


def keep_full_fingerprints(opt):
    """From the next step on, fo fingerprints every byte of each gradient it steps early
    (once per optimizer: an edit counter moved, and only the bits can tell whether the
    gradient changed)."""
    if not opt._full_fingerprints:
        check(_optim._set_full_fingerprints(opt._fo._handle, 1))
        opt._full_fingerprints = True
