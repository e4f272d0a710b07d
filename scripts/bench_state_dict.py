"""How fast fo.torch hands its state out (issue 38 item 4), for docs/performance.md.

8 f32 params whose fp32 AdamW state (exp_avg + exp_avg_sq, 8 B/element) is --size-mib.
Per round, interleaved (odd rounds run the copy first), at 1 thread and at all cores
(fo.set_num_threads and torch.set_num_threads both):
- `opt.state_dict()` of fo.torch.AdamW with fp32 and with quant8 state (both decode into
  fresh f32 tensors of the same size), against a plain copy of the same bytes into fresh
  memory (`clone()` of 16 tensors of the state's size: what torch itself pays to copy them);
- `opt.state[p]` for one parameter, fp32 state (its first read after a step);
- blocking time of `dcp.async_save(get_state_dict(model, opt))` for fo.torch's AdamW
  (fp32 and quant8 state) and for torch.optim.AdamW's own state (the call and the
  get_state_dict before it: what stalls the training loop), and of fo's own
  `save_checkpoint_async` of the quant8 optimizer, with --async-rounds rounds.
fp32 state is lent live (`fo_optimizer_share_state`), so its `state_dict()` copies nothing
(its row is there to show that); quant8 state is decoded into fresh tensors.
Medians with [min-max].

    OMP_NUM_THREADS=1 ~/.cache/fo/torch-venv/bin/python scripts/bench_state_dict.py --size-mib 512
"""
import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import fo
import fo.torch

TENSORS = 8


def fmt(xs, scale=1e3, unit="ms", digits=1):
    m = statistics.median(xs) * scale
    return f"{m:.{digits}f} {unit} [{min(xs) * scale:.{digits}f}-{max(xs) * scale:.{digits}f}]"


def timed(f):
    t0 = time.perf_counter()
    out = f()
    return time.perf_counter() - t0, out


def model_and_grads(numel, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.ParameterList([torch.nn.Parameter(torch.rand(numel, generator=g) - 0.5) for _ in range(TENSORS)])
    for p in m:
        p.grad = (torch.rand(numel, generator=g) - 0.5) * 0.02
    return m


def state_dict_vs_copy(a, numel, threads):
    opts = {}
    for fmt_name in ("fp32", "quant8"):
        m = model_and_grads(numel, 1)
        opt = fo.torch.AdamW(m.parameters(), lr=1e-3, state_format=fmt_name)
        opt.step()
        opts[fmt_name] = (m, opt)
    src = [torch.rand(numel) for _ in range(2 * TENSORS)]  # the state's bytes, as torch tensors
    times = {"fp32": [], "quant8": [], "copy": []}
    one = []

    def side(name):
        if name == "copy":
            t, out = timed(lambda: [x.clone() for x in src])
        else:
            t, out = timed(opts[name][1].state_dict)
        times[name].append(t)
        del out

    for r in range(a.rounds):
        order = list(times)
        for name in order[r % 3:] + order[:r % 3]:  # rotate who goes first
            side(name)
        # `opt.state[p]` as after a step: the first read of p since (bench only: forget the
        # entry opt.state keeps for the tensors it handed out since the last step).
        m, opt = opts["fp32"]
        opt.state.handed.pop(m[0], None)
        t, out = timed(lambda: opt.state[m[0]])
        one.append(t)
        del out
    cp = times["copy"]
    print(f"{threads} thread(s): clone() of the same bytes {fmt(cp)}; opt.state[p] (fp32, {numel} elements) "
          f"{fmt(one)}", flush=True)
    for name in ("fp32", "quant8"):
        ratio = [s / c for s, c in zip(times[name], cp)]
        print(f"  state_dict() of {name:<6} state {fmt(times[name])}   / clone: "
              f"{statistics.median(ratio):.2f} [{min(ratio):.2f}-{max(ratio):.2f}]", flush=True)
    del opts


def async_save_blocking(a, numel, root):
    """The time `get_state_dict` + `dcp.async_save` keep the caller, per optimizer."""
    sides = {}
    for name, make in [("torch.optim.AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
                       ("fo.torch.AdamW fp32", lambda ps: fo.torch.AdamW(ps, lr=1e-3, state_format="fp32")),
                       ("fo.torch.AdamW quant8", lambda ps: fo.torch.AdamW(ps, lr=1e-3, state_format="quant8"))]:
        m = model_and_grads(numel, 2)
        opt = make(m.parameters())
        opt.step()
        sides[name] = (m, opt, [])
    # fo's own async checkpoint of the quant8 optimizer (compressed on disk, copy-on-write
    # against later steps): what a quant8 user saves with instead of DCP's decoded fp32
    own = "quant8 save_checkpoint_async"
    sides[own] = sides["fo.torch.AdamW quant8"][:2] + ([],)
    for r in range(a.async_rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            m, opt, times = sides[name]
            d = os.path.join(root, f"{r}-{name.replace(' ', '_')}")
            t0 = time.perf_counter()
            if name == own:
                save = opt.save_checkpoint_async(d, rank=0, world_size=1)
                times.append(time.perf_counter() - t0)
                save.wait()
            else:
                _, osd = get_state_dict(m, opt)
                fut = dcp.async_save({"optim": osd}, checkpoint_id=d, no_dist=True)
                times.append(time.perf_counter() - t0)
                del osd
                fut.result()
            shutil.rmtree(d)
    base = statistics.median(sides["torch.optim.AdamW"][2])
    for name, (_, _, times) in sides.items():
        print(f"  {name:<28} blocks {fmt(times)}  / torch's: {statistics.median(times) / base:.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=512, help="fp32 AdamW state size (MiB)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--async-rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where async_save writes (default: a temp dir)")
    a = ap.parse_args()
    numel = max(1, (a.size_mib << 20) // 8 // TENSORS)
    cores = os.cpu_count() or 1
    print(f"torch {torch.__version__}: "
          f"{TENSORS} params x {numel} f32, fp32 AdamW state {a.size_mib} MiB, {a.rounds} rounds, "
          f"{cores} cores", flush=True)
    root = a.dir or tempfile.mkdtemp(prefix="fo-state-dict-")
    try:
        for threads in sorted({1, cores}):
            torch.set_num_threads(threads)
            fo.set_num_threads(threads)
            state_dict_vs_copy(a, numel, threads)
            print(f"{threads} thread(s): dcp.async_save(get_state_dict(model, opt)), {a.async_rounds} rounds:",
                  flush=True)
            async_save_blocking(a, numel, root)
    finally:
        fo.set_num_threads(0)
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
