"""One torchrun rank of test_torch_fsdp2.py's overlap test: FSDP2 with CPUOffloadPolicy on
gloo, fo.torch.AdamW with overlap="always" (hand-over in every backward, never measured)
against overlap=False, clipping by max_grad_norm (the norm all-reduced over the default group). FSDP2 runs the sharded parameters'
post-accumulate-grad hooks once their gradient is reduce-scattered (and copied to the host).
With `cuda`: the shards on one GPU per rank over NCCL alone, stepped on the GPUs (the clip
norm's host values all-reduced through CUDA tensors).

    torchrun --nproc-per-node N torch_fsdp2_overlap_worker.py OUT_JSON [cpu|cuda]
"""
import sys

import torch
import torch.distributed as dist

import fo.torch
from torch_fsdp2_worker import build, finish, init, train_step


def main():
    out = sys.argv[1]
    mesh = init(sys.argv[2] if len(sys.argv) > 2 else "cpu")
    res = {}
    for clip, name in ((None, "noclip"), (0.05, "clip")):
        ref, mine = build(mesh), build(mesh)
        r_opt = fo.torch.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=clip)
        o_opt = fo.torch.AdamW(mine.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=clip, overlap="always")
        same, stats = True, []
        for s in range(6):
            train_step(ref, r_opt, s)
            train_step(mine, o_opt, s)
            stats.append(o_opt.last_step_stats)
            same &= all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(ref.parameters(), mine.parameters()))
            same &= (clip is None) or o_opt.last_step_stats["total_norm"] == r_opt.last_step_stats["total_norm"]
        flags = torch.tensor([int(same)], device=mesh.device_type)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        res[name] = {"same_bits_on_every_rank": bool(flags.item()), "stats": stats}
    finish(out, res)


if __name__ == "__main__":
    main()
