"""What fo stores for a fo.torch optimizer, and fo's own (compressed) checkpoint of it.

`state_dict()` and DCP save torch's layout, decoded to float32 (8 B/param for AdamW); fo
itself keeps quantized state (2.125 B/param for quant8 AdamW, plus error bits for 24/32-bit
masters). `state_memory()` reports the latter, `repr(opt)` shows it, and `save_checkpoint`
writes it as it is, in one call.

Only `fo.torch` imports this module (it needs torch)."""
import torch

from . import layout as _layout
from ._torch_args import local

# fo's own knobs, kept in each param group beside torch's. They describe how state is
# stored, so loading a checkpoint keeps the optimizer's own values (any format loads).
FO_KEYS = ("state_format", "master_weight_bits", "arithmetic")
_FLAGS = ("foreach", "maximize", "capturable", "differentiable", "fused", "amsgrad", "decoupled_weight_decay")


def _mb(n):
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n} B"


def _rank_world(rank, world_size):
    dist = torch.distributed
    live = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if live else 0
    if world_size is None:
        world_size = dist.get_world_size() if live else 1
    return rank, world_size


class Storage:
    """Mixed into fo.torch's optimizers (which provide `_fo`, `_index`, `_names`, `_flush`,
    `_sync`, `_has_state`, `_group_hp` and `state`)."""

    def state_memory(self):
        """What fo stores for this optimizer's state (after `state_dict()` decodes it, torch's
        layout would take 8 B/param for AdamW): {"bytes", "params", "bytes_per_param",
        "host_bytes", "device_bytes", "groups": [per param group: "state_format",
        "master_weight_bits", "bytes", "params", "bytes_per_param"], "formats": {format:
        {"bytes", "params", "bytes_per_param"}}}. `params` counts elements of parameters that
        have state; error bits (24/32-bit masters) are included, parameters and grads are not."""
        groups = [{"state_format": g["state_format"], "master_weight_bits": int(g["master_weight_bits"]),
                   "bytes": 0, "params": 0} for g in self.param_groups]
        host = device = 0
        for gi, p, _ in self._names():
            i = self._index.get(p)
            if i is None or not self._has_state(p):
                continue
            n = self._fo.state_bytes(i)
            groups[gi]["bytes"] += n
            groups[gi]["params"] += local(p).numel()
            if local(p).device.type == "cpu" or self._is_offloaded(p):  # offload=: state on the host
                host += n
            else:
                device += n
        formats = {}
        for g in groups:
            f = formats.setdefault(g["state_format"], {"bytes": 0, "params": 0})
            f["bytes"] += g["bytes"]
            f["params"] += g["params"]
        for d in groups + list(formats.values()):
            d["bytes_per_param"] = d["bytes"] / d["params"] if d["params"] else 0.0
        total, params = host + device, sum(g["params"] for g in groups)
        return {"bytes": total, "params": params, "bytes_per_param": total / params if params else 0.0,
                "host_bytes": host, "device_bytes": device, "groups": groups, "formats": formats}

    def __repr__(self):
        m = self.state_memory()
        if not m["params"]:
            line = "fo state: none yet (allocated for each parameter at its first step)"
        else:
            fmts = ", ".join(f"{f} {d['bytes_per_param']:.3f} B/param" for f, d in m["formats"].items())
            line = (f"fo state: {_mb(m['bytes'])} for {m['params']} params ({fmts}); "
                    f"host {_mb(m['host_bytes'])}, device {_mb(m['device_bytes'])}")
        return super().__repr__() + "\n" + line

    # -- fo's own checkpoint ----------------------------------------------------------
    def save_checkpoint(self, directory, rank=None, world_size=None, mode="compressed", **kwargs):
        """Saves fo's state as fo stores it (`mode="compressed"`: quantized state, error bits,
        fp16 scales; DCP's HuggingFace reader and `fo.ckpt` read it) with one call:
        `fo.ckpt.save` on this optimizer. rank/world_size default to torch.distributed's
        (0 and 1 without a process group); other arguments are `fo.ckpt.save`'s."""
        from . import ckpt

        rank, world_size = _rank_world(rank, world_size)
        self._flush()
        self._sync()
        ckpt.save(self._fo, directory, rank=rank, world_size=world_size, mode=mode, **kwargs)

    def save_checkpoint_async(self, directory, rank=None, world_size=None, mode="compressed", **kwargs):
        """`save_checkpoint` in the background (`fo.ckpt.save_async`): returns once a
        copy-on-write snapshot is registered, with an object whose `wait()` returns when the
        checkpoint is committed. `step()` goes on meanwhile; the checkpoint holds the state
        as of this call. Until `wait()`, add no param group."""
        from . import ckpt

        rank, world_size = _rank_world(rank, world_size)
        self._flush()
        self._sync()
        return ckpt.save_async(self._fo, directory, rank=rank, world_size=world_size, mode=mode, **kwargs)

    def load_checkpoint(self, directory, strict=True):
        """Loads a checkpoint written by `save_checkpoint` (or any fo / DCP HuggingFace
        checkpoint of these parameters, resharded) into this optimizer, state and group
        hyper-parameters. Returns `fo.ckpt.load`'s report."""
        from . import ckpt

        self._flush()
        self._sync(also={p for g in self.param_groups for p in g["params"]})
        report = ckpt.load(self._fo, directory, strict=strict, params=False, param_groups=True)
        for g, saved in zip(self.param_groups, self._fo.param_groups):
            for k, v in _layout.torch_param_group(saved).items():
                if k in g and k not in ("params", "initial_lr") and k not in FO_KEYS and k not in _FLAGS:
                    g[k] = type(g[k])(v) if isinstance(g[k], (bool, tuple)) else v
        self._pushed = [{} for _ in self.param_groups]  # push torch's values back, bit for bit
        self._sync()
        self.state.after_step()
        return report
