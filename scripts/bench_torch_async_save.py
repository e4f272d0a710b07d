"""torch.distributed.checkpoint.async_save of fp32 AdamW state, measured the way
`fo bench ckpt --async` measures fo_state_save_async, for docs/checkpoints.md.

One process, no process group (`no_dist=True`): 8 f32 params whose AdamW state
(exp_avg + exp_avg_sq, 8 bytes per element) is --size-mib, as in fo's bench. Per round
(interleaved: odd rounds run the async side first): a synchronous `dcp.save` of the
state, then --steps optimizer steps alone; `dcp.async_save` of the state (the call's
blocking time), --steps steps while it is in flight, and the wait for its future.
Medians with [min-max] over the rounds. With --fo PATH it then runs
`PATH bench ckpt --async` at the same size, steps and rounds, and prints its report
(same threads: FO_NUM_THREADS = --threads).

    OMP_NUM_THREADS=1 ~/.cache/fo/torch-venv/bin/python scripts/bench_torch_async_save.py \\
        --size-mib 512 --steps 3 --rounds 3 --threads 2 --fo target/release/fo
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

TENSORS = 8


def fmt(xs, scale=1.0, unit="s", digits=3):
    m = statistics.median(xs) * scale
    return f"{m:.{digits}f} {unit} [{min(xs) * scale:.{digits}f}-{max(xs) * scale:.{digits}f}]"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=512, help="AdamW state size (MiB)")
    ap.add_argument("--steps", type=int, default=3, help="steps while the save is in flight")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--fo", default=None, help="the fo binary, to run its bench alongside")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    numel = max(1, (a.size_mib << 20) // 8 // TENSORS)
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.rand(numel, generator=g) - 0.5) for _ in range(TENSORS)]
    for p in params:
        p.grad = (torch.rand(numel, generator=g) - 0.5) * 0.02
    # torch's default AdamW step on CPU (foreach); fp32 state like fo's bench.
    opt = torch.optim.AdamW(params, lr=1e-3)

    def steps(n):
        t0 = time.perf_counter()
        for _ in range(n):
            opt.step()
        return time.perf_counter() - t0

    steps(1)  # creates the state

    def state_dict():
        sd = {}
        for i, p in enumerate(params):
            st = opt.state[p]
            for k in ("exp_avg", "exp_avg_sq", "step"):
                sd[f"state.layers.{i}.weight.{k}"] = st[k]
        return sd

    state_bytes = sum(t.numel() * t.element_size() for t in state_dict().values())
    root = a.dir or tempfile.mkdtemp(prefix="fo-torch-async-")
    os.makedirs(root, exist_ok=True)
    print(
        f"torch {torch.__version__} dcp.async_save (no process group): fp32 AdamW, {TENSORS} params x "
        f"{numel} f32, state {state_bytes / (1 << 30):.2f} GiB, {a.steps} steps in flight, "
        f"{a.threads} threads, {a.rounds} rounds, dir {root}",
        flush=True,
    )
    sync, alone, call, inflight, total = [], [], [], [], []
    try:
        for r in range(a.rounds):

            def sync_side():
                d = os.path.join(root, f"sync-{r}")
                t0 = time.perf_counter()
                dcp.save(state_dict(), checkpoint_id=d, no_dist=True)
                sync.append(time.perf_counter() - t0)
                alone.append(steps(a.steps))
                shutil.rmtree(d)

            def async_side():
                d = os.path.join(root, f"async-{r}")
                t0 = time.perf_counter()
                fut = dcp.async_save(state_dict(), checkpoint_id=d, no_dist=True)
                call.append(time.perf_counter() - t0)
                inflight.append(steps(a.steps))
                fut.result()
                total.append(time.perf_counter() - t0)
                shutil.rmtree(d)

            for side in (sync_side, async_side) if r % 2 == 0 else (async_side, sync_side):
                side()
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    s = statistics.median(sync)
    extra = [i - al for i, al in zip(inflight, alone)]
    print(f"save call blocks       async {fmt(call, 1e3, 'ms', 1)}   sync save {fmt(sync, 1e3, 'ms', 1)}")
    print(
        f"{a.steps:>2} steps              in flight {fmt(inflight)}   alone {fmt(alone)}   "
        f"extra {statistics.median(extra):+.3f} s = {100 * statistics.median(extra) / s:+.1f}% of the sync save"
    )
    print(f"async save end to end  {fmt(total)} (call to the future's result, steps included)")
    if a.fo:
        print(f"\n{a.fo} bench ckpt --async (FO_NUM_THREADS={a.threads}):", flush=True)
        env = dict(os.environ, FO_NUM_THREADS=str(a.threads))
        cmd = [a.fo, "bench", "ckpt", "--async", "--size-mib", str(a.size_mib),
               "--steps", str(a.steps), "--rounds", str(a.rounds)]
        cmd += ["--staging-mib", str(a.size_mib)]
        sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
