"""One torchrun rank of test_torch_overlap_params.py's DDP test: DistributedDataParallel on
gloo, fo.torch.AdamW with overlap="always" against overlap=False, gradient bucket views off
and on. DDP averages each gradient after the post-accumulate-grad hooks ran, so every early
step is redone (the bits of overlap=False) and, after two, the hooks stop handing over with
a warning that names DDP.

    torchrun --nproc-per-node N torch_ddp_overlap_worker.py OUT_JSON
"""
import sys
import warnings

import torch
import torch.distributed as dist

import fo.torch
from torch_fsdp2_worker import finish


def run(overlap, bucket_view):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(9, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
    opt = fo.torch.AdamW(ddp.parameters(), lr=1e-2, overlap=overlap)
    caught, stats = [], []
    for it in range(4):
        g = torch.Generator().manual_seed(100 * it + dist.get_rank())  # each rank its own batch
        opt.zero_grad()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            ddp(torch.randn(6, 9, generator=g)).pow(2).sum().backward()
            opt.step()
        caught += [str(x.message) for x in w]
        stats.append(opt.last_step_stats)
    return [p.detach().clone() for p in model.parameters()], caught, stats


def main():
    out = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    res = {}
    for bucket_view in (False, True):
        ref, _, _ = run(False, bucket_view)
        mine, caught, stats = run("always", bucket_view)
        same = torch.tensor([int(all(torch.equal(a, b) for a, b in zip(ref, mine)))])
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        res[str(bucket_view)] = {"same_bits_on_every_rank": bool(same.item()),
                                 "warned": [c for c in caught if "DistributedDataParallel" in c],
                                 "redone": [s["redone"] for s in stats],
                                 "handed_over_in_backward": [s["handed_over_in_backward"] for s in stats]}
    finish(out, res)


if __name__ == "__main__":
    main()
