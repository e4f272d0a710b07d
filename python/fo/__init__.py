"""fo through ctypes: numpy in, numpy out. The library is found through FO_LIBRARY,
then next to this package, then the repository's target/ directories."""
from ._ffi import ABI_VERSION, FoError, TensorArg, library_path, lib
from .comm import Comm, broadcast_state_dict, clip_grad_norm
from .shard import (Partial, Replicate, Shard, ShardInfo, ShardSpec, StridedShard, grouped_placements,
                    padded_shard_size, placement, shard_indices, wrap_uneven)
from . import ckpt
from .optim import OptimConfig, Optimizer, config, get_num_threads, offload_plan, set_num_threads


def get_include() -> str:
    """The directory holding `fo.h`, for C++ extensions linking `library_path`: the
    installed package's `include/`, or the repository's `include/` in a checkout."""
    from pathlib import Path
    here = Path(__file__).resolve().parent
    for d in (here / "include", here.parent.parent / "include"):
        if (d / "fo.h").is_file():
            return str(d)
    raise FileNotFoundError(f"fo.h is neither in {here / 'include'} nor in the repository's include/")


def version() -> str:
    return lib.fo_version().decode()


def abi_version() -> int:
    return lib.fo_abi_version()


__all__ = ["Comm", "broadcast_state_dict", "clip_grad_norm", "ABI_VERSION", "FoError", "TensorArg", "library_path", "get_include", "version", "abi_version", "Partial",
           "Replicate", "Shard", "ShardInfo", "ShardSpec", "StridedShard", "grouped_placements",
           "padded_shard_size", "placement", "shard_indices", "wrap_uneven", "OptimConfig", "Optimizer", "config",
           "get_num_threads", "offload_plan", "set_num_threads", "ckpt"]
