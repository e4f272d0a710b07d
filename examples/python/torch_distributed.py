"""fo's broadcast_state_dict driven by torch.distributed (gloo), checked against torch.

    PYTHONPATH=python FO_LIBRARY=target/release/libfo.so \\
        torchrun --nproc-per-node 4 examples/python/torch_distributed.py

Rank 0 holds a full state dict; every rank holds its destinations: uneven shards
(Shard(0) of 10 rows over 4 ranks), FSDP2-over-TP shards on a 2x2 mesh
([_StridedShard(0, 2), Shard(0)]), a bf16 tensor received as f32, and a whole buffer.
fo talks to the other ranks only through the callbacks below, which call
torch.distributed. Every rank then compares its result with torch's own
`distribute_tensor(full, mesh, placements).to_local()` and exits non-zero on a mismatch.
"""
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
except ImportError:  # torch < 2.5
    from torch.distributed._tensor import Replicate, Shard, distribute_tensor, init_device_mesh
from torch.distributed.tensor.placement_types import _StridedShard

import fo


def torch_callbacks():
    """fo_comm's callback table over the default process group."""

    def broadcast(buf, root):
        if buf.size:
            dist.broadcast(torch.from_numpy(buf), src=root)

    def all_reduce_f64(vals, op):
        if vals.size:  # every rank passes the same count
            dist.all_reduce(torch.from_numpy(vals), op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)

    def barrier():
        dist.barrier()

    def scatter(parts, recv, root):
        # Shards differ in size, which dist.scatter does not allow: point-to-point instead.
        # Both sides know every size, so empty shards are skipped on both.
        if dist.get_rank() == root:
            reqs = [dist.isend(torch.from_numpy(p), dst=r) for r, p in enumerate(parts) if r != root and p.size]
            recv[:] = parts[root]
            for q in reqs:
                q.wait()
        elif recv.size:
            dist.recv(torch.from_numpy(recv), src=root)

    return broadcast, all_reduce_f64, barrier, scatter


def fo_placement(p):
    if isinstance(p, _StridedShard):
        return fo.StridedShard(p.dim, p.split_factor)
    if isinstance(p, Shard):
        return fo.Shard(p.dim)
    return fo.Replicate()


def fsdp_over_tp_local(full, mesh2):
    """This rank's shard of FSDP2 on top of tensor parallel, the way torch builds it: TP
    shards rows over mesh dim 1, then FSDP2 chunks the TP-local tensor over mesh dim 0.
    Where this torch's distribute_tensor accepts _StridedShard, it must agree."""
    dp, _ = mesh2.get_coordinate()
    tp_local = distribute_tensor(full, mesh2, [Replicate(), Shard(0)]).to_local()
    chunks = torch.chunk(tp_local, mesh2.shape[0], dim=0)
    local = chunks[dp] if dp < len(chunks) else tp_local.new_empty((0,) + tuple(tp_local.shape[1:]))
    try:
        strided = distribute_tensor(full, mesh2, [_StridedShard(0, split_factor=mesh2.shape[1]), Shard(0)]).to_local()
    except (NotImplementedError, AssertionError, RuntimeError):
        strided = None  # older torch: _StridedShard cannot distribute a tensor
    if strided is not None and not torch.equal(strided, local):
        raise SystemExit("torch's _StridedShard and FSDP2's chunking disagree")
    return local.float()


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        print("run with torchrun --nproc-per-node 4", file=sys.stderr)
        return 2
    mesh1 = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(0)
    full = {
        "layers.0.weight": torch.randn(10, 6, generator=g),             # uneven: 3, 3, 3, 1 rows
        "layers.1.weight": torch.randn(13, 4, generator=g),             # FSDP2 over TP, 2x2 mesh
        "layers.2.bias": torch.randn(7, generator=g).to(torch.bfloat16),  # bf16 on rank 0, f32 here
        "buffers.running_mean": torch.randn(6, generator=g),            # a plain buffer: whole
    }
    layout = {
        "layers.0.weight": (mesh1, [Shard(0)]),
        "layers.1.weight": (mesh2, [_StridedShard(0, split_factor=2), Shard(0)]),
        "layers.2.bias": (mesh1, [Shard(0)]),
    }
    # torch's answer: each rank's local shard of the same full tensors.
    want = {k: distribute_tensor(full[k], m, pl).to_local().float()
            for k, (m, pl) in layout.items() if k != "layers.1.weight"}
    want["buffers.running_mean"] = full["buffers.running_mean"]
    want["layers.1.weight"] = fsdp_over_tp_local(full["layers.1.weight"], mesh2)

    comm = fo.Comm.from_callbacks(rank, world, *torch_callbacks())
    dests, specs = {}, {}
    for k, (m, pl) in layout.items():
        spec = fo.ShardSpec(full[k].shape, m.shape, m.get_coordinate(), [fo_placement(p) for p in pl])
        local = [len(spec.indices(d)) for d in range(full[k].dim())]
        dests[k] = (np.full(local, np.nan, np.float32), spec)
        specs[k] = spec
    dests["buffers.running_mean"] = np.zeros(6, np.float32)
    src = None
    if rank == 0:
        src = {k: fo.TensorArg(v.view(torch.int16).numpy(), dtype="bf16") if v.dtype == torch.bfloat16 else v.numpy()
               for k, v in full.items()}
    stats = fo.broadcast_state_dict(comm, src, dests)

    bad = []
    for k, w in want.items():
        got = dests[k][0] if isinstance(dests[k], tuple) else dests[k]
        if tuple(got.shape) != tuple(w.shape) or not np.array_equal(got, w.numpy()):
            bad.append(k)
    shard_bytes = sum(int(np.prod(want[k].shape)) * full[k].element_size() for k in layout)
    expect = shard_bytes + full["buffers.running_mean"].nbytes
    if stats["bytes_received"] != expect:
        bad.append(f"bytes_received {stats['bytes_received']} != {expect}")
    print(f"rank {rank}: {'OK' if not bad else 'MISMATCH ' + ', '.join(bad)}; received "
          f"{stats['bytes_received']} B payload + {stats['table_bytes']} B table")
    comm.close()
    dist.destroy_process_group()
    return 1 if bad else 0


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
    exit_skipping_finalization(main())
