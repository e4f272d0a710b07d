"""One torchrun rank of test_torch_fsdp2_cuda.py (issue 33, case 1; issue 35): FSDP2 with
CPUOffloadPolicy(pin_memory=True) on CUDA + NCCL, and FSDP2 with its shards on the GPU, fo.torch.AdamW with overlap="always" (hand-over
in every backward, never measured) against overlap=False on the same model and batches. FSDP2 copies each reduced gradient to pinned host
memory with non_blocking=True and records `fsdp_param.grad_offload_event` (torch versions that
keep the copy non-blocking when a post-accumulate-grad hook is registered, e.g. 2.11); fo must
not read a gradient before its copy lands. Two overlapped runs and the plain run must end with
the same bits.

    torchrun --nproc-per-node 1 torch_fsdp2_cuda_overlap_worker.py OUT_JSON [WIDTH LAYERS STEPS]
"""
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

import fo.torch


def build(mesh, width, layers, offload):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                                  for _ in range(layers)]).cuda()
    policy = dict(offload_policy=CPUOffloadPolicy(pin_memory=True)) if offload else {}
    for m in model:
        fully_shard(m, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return model


def run(mesh, width, layers, steps, overlap, state_format, offload=True):
    model = build(mesh, width, layers, offload)
    opt = fo.torch.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, state_format=state_format,
                         overlap=overlap)
    losses, stats = [], []
    for s in range(steps):
        g = torch.Generator(device="cuda").manual_seed(1000 + s)
        x = torch.randn(64, width, device="cuda", generator=g)
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        stats.append(opt.last_step_stats)
    params = [p.to_local().detach().cpu().clone() for p in model.parameters()]
    # Hooks that found FSDP2's offload event, and found its copy still in flight (then fo
    # waited for it): printed by the test, as evidence that the wait is exercised.
    stats[-1]["copy_events"] = list(getattr(opt, "_copy_events", [0, 0]))
    return losses, params, stats


def main():
    out = sys.argv[1]
    width, layers, steps = (int(a) for a in (sys.argv[2:5] if len(sys.argv) > 4 else (1024, 8, 6)))
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    for fmt in ("quant8", "fp32"):
        ref_losses, ref_params, _ = run(mesh, width, layers, steps, False, fmt)
        runs = [run(mesh, width, layers, steps, "always", fmt) for _ in range(2)]
        res[fmt] = {
            "same_bits": [all(torch.equal(a, b) for a, b in zip(ref_params, r[1])) for r in runs],
            "same_losses": [r[0] == ref_losses for r in runs],
            "handed_over_in_backward": [s["handed_over_in_backward"] for s in runs[0][2]],
            "redone": [s["redone"] for s in runs[0][2]],
            "copy_events_found_in_flight": [r[2][-1]["copy_events"] for r in runs],
        }
    # Shards on the GPU (no offload): the hooks run on FSDP2's post-reduce stream, and
    # each shard steps early on fo's step lane after its reduce-scatter.
    for fmt in ("quant8", "fp32"):
        ref_losses, ref_params, _ = run(mesh, width, layers, steps, False, fmt, offload=False)
        r = run(mesh, width, layers, steps, "always", fmt, offload=False)
        res[f"on_gpu_{fmt}"] = {
            "same_bits": all(torch.equal(a, b) for a, b in zip(ref_params, r[1])),
            "same_losses": r[0] == ref_losses,
            "handed_over_in_backward": [s["handed_over_in_backward"] for s in r[2]],
            "speculative": [s["speculative"] for s in r[2]],
            "redone": [s["redone"] for s in r[2]],
        }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
