"""fo.torch's `offload=`: CUDA parameters whose master weights and optimizer state live in
host memory and are stepped by fo's host kernels, the CUDA parameter being fo's device
*mirror* (what Megatron's HybridDeviceOptimizer does with `optimizer_offload_fraction`, and
FSDP2's CPUOffloadPolicy for the optimizer alone: the model and its gradients stay on the GPU).

`offload=` takes
- a fraction in [0, 1]: in parameter order (groups in order), a CUDA parameter is offloaded
  while the elements offloaded before it are fewer than `fraction` x the elements of all the
  CUDA parameters being placed, so at least that fraction is offloaded, overshooting by at
  most one parameter (1.0: all of them; 0: none). The constructor's groups are placed
  together; a group added later is placed by the same rule over its own parameters;
- a predicate `offload(name, param) -> bool` over the names fo.torch gives parameters
  (`param_names` of named groups, else `param_groups[g].params[j]`);
- None (the default): nothing offloaded.
Host parameters are on the host already; `offload=` places CUDA parameters only.

How an offloaded parameter steps (fo's C ABI: a host parameter with a device mirror,
`fo_optimizer_set_mirror`, given its gradient on the device): fo keeps a host copy of the
parameter (its master weights, with error bits for 24/32-bit masters) and its state; each
`step()` brings the CUDA gradient down through fo's pinned copy lanes after the work on
torch's current stream, steps it on fo's pool while the next pieces come down, and writes
the updated values back into the CUDA parameter on the same stream (work queued there
afterwards sees them). So the parameter's trajectory is the host optimizer's, bit for bit,
in either arithmetic: a group whose CUDA parameters are all offloaded keeps the host default
`arithmetic="fast"`.

What the user sees is one optimizer whatever the placement: `state_dict()`, `opt.state[p]`,
DCP and fo's checkpoints give an offloaded parameter's state on the parameter's device, as
for any CUDA parameter, so a checkpoint moves between placements and fractions. The host
copy is the truth between steps: an in-place edit of the CUDA parameter (`load_state_dict`
of the model, an init) is taken up at the next step, found by torch's version counter (a
write through `.data` bypasses it and is overwritten by the next step).

Only `fo.torch` imports this module (it needs torch)."""
import numbers

from . import _torch_cuda as _cuda
from ._torch_args import UNSUPPORTED, error, group_names, local, version


def check_offload(offload):
    """`offload` as given, checked: None, a number in [0, 1], or a callable."""
    if offload is None or callable(offload):
        return offload
    if isinstance(offload, bool) or not isinstance(offload, numbers.Real):
        raise TypeError(f"offload must be a fraction in [0, 1], a predicate (name, param) -> bool or None, "
                        f"got {type(offload).__name__}")
    if not 0.0 <= float(offload) <= 1.0:
        raise ValueError(f"offload fraction {offload!r} is not in [0, 1]")
    return float(offload)


def place(offload, entries):
    """Which of `entries` ((name, param) in parameter order) are offloaded: a list of bools.
    Only CUDA parameters are; see the module doc for the fraction's rule."""
    cuda = [_cuda.is_cuda(p) for _, p in entries]
    if offload is None:
        return [False] * len(entries)
    if callable(offload):
        return [c and bool(offload(name, p)) for c, (name, p) in zip(cuda, entries)]
    threshold = offload * sum(local(p).numel() for c, (_, p) in zip(cuda, entries) if c)
    out, moved = [], 0
    for c, (_, p) in zip(cuda, entries):
        take = c and offload > 0 and moved < threshold
        moved += local(p).numel() if take else 0
        out.append(take)
    return out


class Offload:
    """Mixed into fo.torch's optimizers (which provide `_fo`, `_keep`, `_index`, `_load_param`
    and `_export_keys`): the placement of each parameter (`_offloaded`: param -> bool, fixed
    when its group is added) and the offloaded parameters' host copies."""

    def _place_groups(self, groups, first_gi):
        """Places the parameters of `groups` (param groups numbered from `first_gi`) together."""
        entries = [(name, p) for k, g in enumerate(groups)
                   for name, p in zip(group_names(g, first_gi + k), g["params"])]
        for (_, p), off in zip(entries, place(self._offload_arg, entries)):
            self._offloaded.setdefault(p, off)

    def _is_offloaded(self, p):
        return self._offloaded.get(p, False)

    def _host_copy(self, p, name):
        """A host copy of CUDA parameter p's local tensor for fo to own as its parameter
        (synchronous: read after the work on the current stream). What would make fo refuse
        the mirror is refused first, naming the parameter: fo registers the host copy before
        it takes the mirror, and a parameter cannot be taken back."""
        t = local(p)
        why = _cuda.device_support()
        if why is not None:
            raise error(UNSUPPORTED, f"parameter {name} is offloaded from {t.device}, which needs a libfo that "
                                     f"steps CUDA tensors: {why.message}")
        if not t.is_contiguous():
            raise error(UNSUPPORTED, f"parameter {name}: an offloaded parameter is fo's device mirror, which "
                                     f"must be contiguous (strides {tuple(t.stride())})")
        return t.detach().to("cpu", copy=True)

    def _mirror_seen(self, p):
        """Records p's version now that fo's host copy equals it."""
        self._mirror_version[p] = version(p)

    def _take_up_edits(self):
        """Offloaded parameters edited in place since fo last wrote them: the host copy takes
        the edit (as master: error bits reset, the mirror rewritten with the same values)."""
        for p, seen in list(self._mirror_version.items()):
            if p in self._index and version(p) != seen:
                if self._has_state(p):
                    self._load_param(p, {"master": local(p).detach().float()})
                else:  # no state (no error bits) yet: fo's host copy is all there is
                    self._keep[p][3].copy_(local(p))
                self._mirror_seen(p)
