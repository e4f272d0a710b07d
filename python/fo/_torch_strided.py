"""fo.torch's non-contiguous parameters: a `channels_last` convolution's weight, a transposed
view made a parameter. fo updates parameters in place over contiguous memory (its C ABI
refuses other strides), so such a parameter is registered through a *stand-in*: a
contiguous tensor of the same values on the same device, which fo steps and owns as its
parameter. After every step the stand-in's values are copied into the parameter (on the
current stream for a CUDA one, after fo's kernels), so the loop sees them as it would with
any optimizer. The stand-in is the truth between steps: an in-place edit of the parameter
(`load_state_dict` of the model, an init) is found by torch's version counter and copied
into the stand-in before fo next reads it; a write through `.data` bypasses the counter and
is overwritten by the next step, as for an offloaded parameter (fo._torch_offload).

So the step has the bits of the same values held contiguously: fo's state (quant8 groups
of 32 included) runs in the parameter's logical (row-major) order whatever its strides,
and `state_dict()`, fo's checkpoints and `opt.state[p]` are those of a contiguous parameter.
The cost is a copy of the parameter per step (and, in fo, the gather of its strided gradient)
and its memory once (the stand-in).

A DTensor parameter whose local shard is not contiguous gets a stand-in for that shard (its
shard spec is the parameter's). Only `fo.torch` imports this module (it needs torch)."""
import torch

from ._torch_args import local, version


def storage_order(t):
    """t's dims from the largest stride to the smallest when that permutation of t is
    contiguous (t is dense, only its dims' order differs: channels_last, a transpose), else
    None. Copying into t through `t.permute(order)` walks its memory in order (a transposed
    1024 x 1024 f32 copy took 0.57 ms against 4.0 ms through t itself, one thread)."""
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d]))
    return order if t.permute(order).is_contiguous() else None


class Strided:
    """Mixed into fo.torch's optimizers (which provide `_fresh`'s `_stand_in`: param ->
    [stand-in, the parameter's `version` when the two were last equal, `storage_order`])."""

    def _stand_in_for(self, p):
        """A contiguous stand-in holding non-contiguous parameter p's values (the caller keeps
        it, `_keep_stand_in`, once fo took it); None if p is contiguous (fo steps it in place)."""
        t = local(p)
        if t.is_contiguous():
            return None
        s = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        with torch.no_grad():
            s.copy_(t)
        return s

    def _keep_stand_in(self, p, stand_in):
        """Records the stand-in fo registered for p, equal to p now."""
        self._stand_in[p] = [stand_in, version(p), storage_order(local(p))]

    def _stand_ins_in(self):
        """Parameters edited in place since their stand-in last equalled them: the stand-in
        takes the edit (fo reads it next)."""
        if not self._stand_in:
            return
        with torch.no_grad():
            for p, rec in self._stand_in.items():
                if version(p) != rec[1]:
                    rec[0].copy_(local(p))
                    rec[1] = version(p)

    def _stand_ins_out(self, params):
        """Copies what fo wrote into the stand-ins of `params` into the parameters."""
        if not self._stand_in:
            return
        with torch.no_grad():
            for p in params:
                rec = self._stand_in.get(p)
                if rec is not None:
                    t, order = local(p), rec[2]
                    if order is None:
                        t.copy_(rec[0])
                    else:  # written in its own memory order: torch's copy then runs over both in order
                        t.permute(order).copy_(rec[0].permute(order))
                    rec[1] = version(p)
