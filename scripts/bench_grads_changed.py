"""What fo's look at the gradients' bits costs an overlapped step (`fo_optimizer_grads_changed`,
which fo.torch calls at every overlapped `step()`): a model of --params f32 parameters of
--size elements each (AdamW, quant8 state, f32 masters), all handed over at once, in
interleaved rounds of two kinds: early steps keeping the sampled fingerprint only, and early
steps also fingerprinting every byte (`fo_optimizer_set_full_fingerprints`, fo.torch's choice
once a gradient's edit counter moved after hand-over). Printed, medians [min-max] over the
rounds: the early steps' time (hand-over to their end), the sampled check and the full check
of every gradient, and the plain step for scale.

    PYTHONPATH=python python3 scripts/bench_grads_changed.py --params 16 --size 1M --rounds 9"""
import argparse
import statistics
import time

import numpy as np

import fo


def count(s):
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1:].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def spread(v):
    v = sorted(x * 1e3 for x in v)
    return f"{statistics.median(v):8.3f} ms [{v[0]:.3f}-{v[-1]:.3f}]"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=16)
    ap.add_argument("--size", type=count, default=count("1M"), help="elements per parameter (K, M suffixes)")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    opt = fo.Optimizer("adamw", lr=1e-3, state_format="quant8", master_weight_bits=0)
    ps = [np.random.default_rng(i).uniform(-1, 1, a.size).astype(np.float32) for i in range(a.params)]
    for i, p in enumerate(ps):
        opt.add_param(f"p{i}", p)
    gs = [np.random.default_rng(100 + i).uniform(-1, 1, a.size).astype(np.float32) for i in range(a.params)]
    every = list(range(a.params))
    t = {k: [] for k in ("early", "early_full", "sampled", "full", "plain")}
    for r in range(a.rounds):
        for full in ((False, True) if r % 2 == 0 else (True, False)):  # each kind leads in turn
            opt.set_full_fingerprints(full)
            t0 = time.perf_counter()
            opt.step_begin()
            opt.grads_ready(every, gs)
            opt.grads_changed()  # waits for the early steps
            t["early_full" if full else "early"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert opt.grads_changed() == []
            t["sampled"].append(time.perf_counter() - t0)
            if full:
                t0 = time.perf_counter()
                assert opt.grads_changed(full=every) == []
                t["full"].append(time.perf_counter() - t0)
            opt.step_end()
        t0 = time.perf_counter()
        opt.step(gs)
        t["plain"].append(time.perf_counter() - t0)
    mib = a.params * a.size * 4 / 2**20
    print(f"bench_grads_changed: {a.params} x {a.size} f32 params ({mib:.1f} MiB of gradients), AdamW quant8, "
          f"fo's pool {fo.get_num_threads()} threads, {a.rounds} rounds")
    print(f"early steps, sampled fingerprint: {spread(t['early'])}")
    print(f"early steps, full fingerprint:    {spread(t['early_full'])}")
    r = [x / y for x, y in zip(t["early_full"], t["early"])]
    print(f"  full / sampled: {statistics.median(r):.3f}x [{min(r):.3f}-{max(r):.3f}]")
    print(f"sampled check of every gradient:  {spread(t['sampled'])}")
    print(f"full check of every gradient:     {spread(t['full'])}")
    print(f"plain step:                       {spread(t['plain'])}")


if __name__ == "__main__":
    main()
