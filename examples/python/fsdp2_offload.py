"""FSDP2 with CPU-offloaded shards, stepped by fo: the one-line change for a torch loop.

Train on 4 ranks and save, then resume the same run on 2 ranks (DCP reshards the model and
the optimizer state):

    torchrun --nproc-per-node 4 examples/python/fsdp2_offload.py --ckpt /tmp/fo_fsdp2 --steps 40
    torchrun --nproc-per-node 2 examples/python/fsdp2_offload.py --ckpt /tmp/fo_fsdp2 --steps 40 --resume

`--device cuda` (one GPU per rank, a `cuda` build of libfo) keeps the shards on the GPUs over
NCCL, with no CPUOffloadPolicy, and fo steps them there; `--device cpu` (the default where
torch sees fewer GPUs than ranks) offloads them to the host over gloo. A checkpoint saved by
either resumes on the other.

The model is a small decoder (embedding, causal self-attention, MLP) learning a fixed
next-token rule; widths do not divide by the world size, so FSDP2's shards are uneven.
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

import fo.torch

VOCAB, SEQ, DIM, HEADS, BATCH = 37, 16, 30, 3, 16


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.qkv, self.proj = torch.nn.Linear(DIM, 3 * DIM), torch.nn.Linear(DIM, DIM)
        self.up, self.down = torch.nn.Linear(DIM, 2 * DIM + 2), torch.nn.Linear(2 * DIM + 2, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyDecoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def global_batch(step):
    """Sequences following a fixed rule (next = 5·prev + 3 mod VOCAB) from random starts;
    the same global batch at every world size."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    seq = [start]
    for _ in range(SEQ):
        seq.append((seq[-1] * 5 + 3) % VOCAB)
    seq = torch.cat(seq, 1)
    return seq[:, :-1], seq[:, 1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="cuda: shards on one GPU per rank (NCCL); cpu: offloaded to the host (gloo); "
                         "auto: cuda where torch sees a GPU per rank")
    args = ap.parse_args()

    world = int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.device_count() >= world)
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("cuda:nccl,cpu:gloo")  # DCP's planning runs on host tensors
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
    torch.manual_seed(0)
    model = TinyDecoder()
    if cuda:  # shards on this rank's GPU, stepped there by fo's kernels
        model = model.cuda()
        offload = None
    else:  # shards on the host; pinning that memory needs a CUDA driver
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    kw = {} if offload is None else {"offload_policy": offload}
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)

    # The one line that changes: fo.torch.AdamW instead of torch.optim.AdamW.
    opt = fo.torch.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, state_format="quant8")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))

    first = 0
    if args.resume:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "sched": sched.state_dict()}
        dcp.load(state, checkpoint_id=args.ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])
        first = int(sched.last_epoch)
        if rank == 0:
            print(f"resumed at step {first} on {world} ranks from {args.ckpt}")

    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    t0 = time.perf_counter()
    for step in range(first, first + args.steps):
        x, y = global_batch(step)
        if cuda:
            x, y = x.cuda(), y.cuda()
        opt.zero_grad()
        loss = F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten())
        loss.backward()
        opt.step()
        sched.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1:3d}  loss {loss.item() / world:.4f}  (uniform guess: {math.log(VOCAB):.4f})")

    if not args.resume:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "sched": sched.state_dict()}, checkpoint_id=args.ckpt)
    if rank == 0:
        local = sum(p.to_local().numel() for p in model.parameters())
        total = sum(p.numel() for p in model.parameters())
        where = f"on cuda:{torch.cuda.current_device()}" if cuda else "on the host"
        print(f"{world} ranks, {total} parameters ({local} on rank 0, {where}), "
              f"{args.steps} steps in {time.perf_counter() - t0:.1f}s"
              + ("" if args.resume else f"; saved to {args.ckpt}"))
    dist.destroy_process_group()


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
    exit_skipping_finalization(0)
