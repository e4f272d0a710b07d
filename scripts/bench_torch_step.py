"""Step time of fo.torch optimizers against torch.optim's AdamW, in one process, on host fp32
params (12 weights of 1024x1024 and 2 vectors of 1024: 12.6M params in 14 tensors).

Rounds are interleaved (every optimizer runs `--steps` steps per round, in a rotating order),
so load on a shared machine hits all of them alike; each round gives one median step time
per optimizer, and the table shows the median over rounds with the spread (min-max of the
round medians) and the ratio to torch's fused AdamW measured in the same rounds.

    FO_LIBRARY=target/release/libfo.so python scripts/bench_torch_step.py --threads 1,2

`--layout transposed` makes each weight a transposed view (strides (1, 1024)), as a
channels_last convolution's weight is non-contiguous: torch steps it in place, fo.torch
through a contiguous stand-in copied back after the step (fo._torch_strided); the two
layouts' tables give that copy's cost.

On a machine shared with other work, run with OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads
otherwise spin-wait for each other, and with more runnable threads than cores torch's
multi-threaded step collapses (measured: 57-344 ms per step instead of 7-35 ms at 2 threads on
a 2-core machine running ~8 other jobs), which says nothing about either optimizer.
"""
import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch  # noqa: E402

import fo  # noqa: E402
import fo.torch  # noqa: E402

SHAPES = [(1024, 1024)] * 12 + [(1024,)] * 2


def make_params(seed=0, layout="contiguous"):
    g = torch.Generator().manual_seed(seed)
    ps = []
    for s in SHAPES:
        w = torch.randn(s, generator=g) * 0.02
        if layout == "transposed" and len(s) == 2:  # the same values, column-major: strides (1, rows)
            w = w.t().contiguous().t()
        ps.append(torch.nn.Parameter(w))
    for p in ps:
        p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=g) * 1e-3)  # the param's strides
    return ps


OPTIMIZERS = {
    "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
    "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
    "fo.torch AdamW default": lambda ps: fo.torch.AdamW(ps, lr=1e-4),
    "fo.torch AdamW exact": lambda ps: fo.torch.AdamW(ps, lr=1e-4, arithmetic="exact"),
    "fo.torch AdamW fp32": lambda ps: fo.torch.AdamW(ps, lr=1e-4, state_format="fp32"),
}


def time_steps(opt, steps):
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def run(threads, rounds, steps, names, layout):
    torch.set_num_threads(threads)
    fo.set_num_threads(threads)
    opts = {n: OPTIMIZERS[n](make_params(layout=layout)) for n in names}
    for o in opts.values():  # state allocated, threads started
        for _ in range(3):
            o.step()
    per = {n: [] for n in names}
    best = {n: float("inf") for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            med, low = time_steps(opts[n], steps)
            per[n].append(med)
            best[n] = min(best[n], low)
    base = per[names[0]]
    print(f"\n{threads} thread(s): {len(SHAPES)} tensors, {sum(math.prod(s) for s in SHAPES) / 1e6:.1f}M "
          f"fp32 params ({layout}); {rounds} interleaved rounds x {steps} steps; ms/step median [min-max of round medians], "
          "fastest single step (the least disturbed by other load)")
    for n in names:
        ratios = [b / t for b, t in zip(base, per[n])]
        ms = [t * 1e3 for t in per[n]]
        print(f"  {n:26s} {statistics.median(ms):7.2f} [{min(ms):6.2f}-{max(ms):6.2f}]   "
              f"speed vs {names[0]}: {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]   "
              f"fastest {best[n] * 1e3:6.2f} ms ({best[names[0]] / best[n]:.2f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", default=",".join(OPTIMIZERS), help="comma-separated names, the first is the base")
    ap.add_argument("--layout", choices=("contiguous", "transposed"), default="contiguous",
                    help="transposed: every weight a non-contiguous (transposed) view")
    a = ap.parse_args()
    names = [n.strip() for n in a.only.split(",")]
    print(f"torch {torch.__version__}, fo {fo.version()} ({fo.library_path}), "
          f"default arithmetic {fo.torch.DEFAULT_ARITHMETIC}")
    for t in (int(x) for x in a.threads.split(",")):
        run(t, a.rounds, a.steps, names, a.layout)


if __name__ == "__main__":
    main()
