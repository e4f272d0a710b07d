"""fo.torch's overlapped step on one host model: 16 equal layers (Linear 1024x1024 fp32), AdamW
with quant8 state, torch with 1 intra-op thread for backward and fo's pool with `--fo-threads`.
Three optimizers on three copies of the model: overlap=False, overlap="always" (the mechanism:
hand-over in every backward) and overlap=True (measured: it keeps handing over only where that
makes its iterations faster). overlap=True first runs alone until its probe has decided (its
iterations back to back, as in a training loop: a probe timed across the other modes' rounds
would time them too), then all three take interleaved rounds; each prints the median per mode
of the iteration (zero_grad + forward + backward + step) and of `opt.step()` alone, the step
time left exposed after the last gradient, and what overlap=True decided.

    FO_LIBRARY=target/release/libfo.so OMP_NUM_THREADS=1 python scripts/bench_torch_overlap.py
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch  # noqa: E402

import fo  # noqa: E402
import fo.torch  # noqa: E402

MODES = {False: "overlap=False", "always": "overlap='always'", True: "overlap=True"}
SHORT = {"overlap": "kept", "no hand-over": "dropped"}


def settle(opt, iteration, limit=30):
    """Runs `iteration()` of an overlap=True optimizer until its probe has decided, at most
    `limit` times (a probe that never sees backward hand a gradient over, e.g. under the cores
    rule, stays in its warm-up); returns how many ran."""
    for n in range(1, limit + 1):
        iteration()
        if opt.last_step_stats["overlap_probe"]["phase"] not in ("warm-up", "probing"):
            return n
    return limit


def decision(opt, ran):
    """What an overlap=True optimizer's probe decided, in a line and in a word."""
    st = opt.last_step_stats
    p = st["overlap_probe"]
    if p["phase"] == "decided":
        over, plain = (statistics.median(p[k]) if p[k] else float("nan") for k in ("overlapped_ms", "plain_ms"))
        line = (f"decided after {ran} iterations: {SHORT[p['decision']]} (overlapped {over:.2f} ms vs {plain:.2f} ms "
                f"without hand-over, medians of {len(p['overlapped_ms'])} and {len(p['plain_ms'])}; "
                f"{p['discarded']} left out)")
        return line, SHORT[p["decision"]]
    if p["phase"] == "stopped":
        return f"stopped measuring after {ran} iterations: {st['not_overlapped']}", "stopped"
    why = f": {st['not_overlapped']}" if st["not_overlapped"] else ""
    return f"still in its {p['phase']} after {ran} iterations{why}", p["phase"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--fo-threads", type=int, default=1)
    ap.add_argument("--max-grad-norm", type=float, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    fo.set_num_threads(a.fo_threads)
    runs = {}
    for overlap in MODES:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(a.width, a.width, bias=False) for _ in range(a.layers)])
        opt = fo.torch.AdamW(model.parameters(), lr=1e-4, overlap=overlap, max_grad_norm=a.max_grad_norm)
        runs[overlap] = (model, opt)
    x = torch.randn(a.batch, a.width)

    def iteration(model, opt):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    ran = settle(runs[True][1], lambda: iteration(*runs[True]))
    said, word = decision(runs[True][1], ran)
    res = {m: {"iter": [], "step": []} for m in runs}
    order = list(runs)
    for r in range(a.rounds):
        for overlap in order[r % len(order):] + order[:r % len(order)]:  # each mode leads in turn
            it, st = zip(*(iteration(*runs[overlap]) for _ in range(a.steps)))
            res[overlap]["iter"].append(statistics.median(it))
            res[overlap]["step"].append(statistics.median(st))
    for overlap, d in res.items():
        i, s = (sorted(t * 1e3 for t in v) for v in (d["iter"], d["step"]))
        print(f"{MODES[overlap]:<16}: iteration {statistics.median(i):.1f} ms [{i[0]:.1f}-{i[-1]:.1f}], "
              f"exposed step {statistics.median(s):.1f} ms [{s[0]:.1f}-{s[-1]:.1f}]")
    med = {m: statistics.median(d["iter"]) for m, d in res.items()}
    print(f"overlap=True {said}")
    print(f"overlapped / sequential: {med['always'] / med[False]:.3f}x; "
          f"overlap=True / sequential: {med[True] / med[False]:.3f}x ({word})")
    last = runs['always'][1].last_step_stats
    print(f"last overlapped step: {last}")
    print(f"undo high-water: {last['undo_high_water_bytes'] / 2**20:.2f} MiB (overlap='always', last step)")


if __name__ == "__main__":
    main()
