"""One torchrun rank of test_torch_fsdp2.py: FSDP2 with CPUOffloadPolicy on gloo, a model
whose dims do not divide by the world size (some ranks hold empty shards); with `cuda`, the
shards on one GPU per rank over NCCL alone (no offload policy; fo steps them on the GPUs, and
its clip norm's host values travel through CUDA tensors).

    torchrun --nproc-per-node N torch_fsdp2_worker.py save|load CKPT_DIR OUT_JSON [cpu|cuda]

Every launch checks fo.torch.AdamW(fp32 state) against torch.optim.AdamW step by step and
runs fo's quant8 + 24-bit master weights on bf16 params beside torch's fp32 run. `save`
trains TRAIN steps, dcp.saves model + optimizer, trains MORE steps; `load` dcp.loads that
checkpoint (written by another world size) and trains the same MORE steps. Rank 0 writes the
measurements to OUT_JSON; the test asserts on them.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

import fo.torch

TRAIN, MORE, GLOBAL_BATCH = 10, 10, 8


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(10, 13)  # 13 rows over 4 ranks: 4, 4, 4, 1
        self.fc2 = torch.nn.Linear(13, 6)  # 6 rows over 4 ranks: 2, 2, 2, 0
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def build(mesh, dtype=torch.float32):
    """The model on `mesh`: on a CUDA mesh its shards stay on the GPUs, on a host mesh they
    are offloaded (the same initial values either way)."""
    torch.manual_seed(0)
    model = Net().to(dtype)
    if mesh.device_type == "cuda":
        kw = {}
        model = model.cuda()
    else:  # pinned host memory needs a CUDA driver; without one the shards live in plain memory
        kw = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())}
    for m in (model.fc1, model.fc2, model.head):
        fully_shard(m, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def batch(step, rank, world, dtype=torch.float32, device="cpu"):
    """This rank's rows of the global batch of `step` (the same global batch at any world size
    and on any device: drawn on the host)."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 10, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return x[rows].to(dtype).to(device), y[rows].to(dtype).to(device)


def train_step(model, opt, step, dtype=torch.float32):
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch(step, rank, world, dtype, next(model.parameters()).device)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
    loss.backward()
    opt.step()
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss.item() / world


def full(model):
    return [p.full_tensor().detach().float() for p in model.parameters()]


def init(device):
    """The default group and a 1-D mesh over it: gloo on the host; NCCL alone with one GPU
    per rank (so that fo's collectives meet a group that takes CUDA tensors only)."""
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return init_device_mesh(device, (dist.get_world_size(),))


def main():
    mode, ckpt, out = sys.argv[1:4]
    device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    mesh = init(device)
    world = dist.get_world_size()
    res = {"world": world, "device": device}

    # fp32 state: follows torch.optim.AdamW step by step (same FSDP2 gradients).
    ref, mine = build(mesh), build(mesh)
    t_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    f_opt = fo.torch.AdamW(mine.parameters(), lr=1e-2, weight_decay=0.1, state_format="fp32")
    worst = 0.0
    for s in range(20):
        train_step(ref, t_opt, s)
        train_step(mine, f_opt, s)
        for a, b in zip(full(ref), full(mine)):
            # torch.testing.assert_close's criterion |a - b| <= atol + rtol * |a|, as a ratio
            worst = max(worst, ((a - b).abs() / (1e-7 + 1e-5 * a.abs())).max().item())
    res["fp32_close_ratio"] = worst  # <= 1: within rtol 1e-5 (atol 1e-7)
    local_shapes = [tuple(p.to_local().shape) for p in mine.parameters()]
    res["local_shapes"] = [None] * world
    gathered = [None] * world
    dist.all_gather_object(gathered, local_shapes)
    res["local_shapes"] = gathered

    # quant8 state + 24-bit master weights on bf16 params, beside torch's fp32 AdamW.
    ref, mine = build(mesh), build(mesh, torch.bfloat16)
    t_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    f_opt = fo.torch.AdamW(mine.parameters(), lr=1e-2, weight_decay=0.1, state_format="quant8",
                           master_weight_bits=24)
    res["quant8_losses"], res["torch_losses"] = [], []
    for s in range(20):
        res["torch_losses"].append(train_step(ref, t_opt, s))
        res["quant8_losses"].append(train_step(mine, f_opt, s, torch.bfloat16))

    # dcp: save on one world size, load on another, continue.
    model = build(mesh)
    opt = fo.torch.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, state_format="fp32")
    if mode == "save":
        res["losses"] = [train_step(model, opt, s) for s in range(TRAIN)]
        msd, osd = get_state_dict(model, opt)
        res["optim_state_is_dtensor"] = type(osd["state"]["fc2.weight"]["exp_avg"]).__name__
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    else:
        msd, osd = get_state_dict(model, opt)  # a fresh optimizer: DCP initializes its state
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        res["loaded_step"] = opt.state_dict()["state"][0]["step"].item()
    res["continued"] = [train_step(model, opt, s) for s in range(TRAIN, TRAIN + MORE)]
    finish(out, res)


def finish(out, res):
    """Rank 0 writes the measurements to `out`; every rank leaves the group and exits."""
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()
    exit_skipping_finalization(0)


def exit_skipping_finalization(code):
    """Exits without Python's interpreter finalization. torch 2.15's gloo worker thread can
    free the last collective's work (tensors with Python objects) after
    destroy_process_group returns; if the interpreter is finalizing by then, its GIL
    acquire aborts the process ("terminate called without an active exception"; core
    dumps show ~AsyncWork in ProcessGroupGloo::runLoop, cf. pytorch/pytorch#179291).
    Everything this script writes is flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
