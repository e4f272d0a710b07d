"""fo.torch with overlap=True against overlap=False on one host model: 16 equal layers
(Linear 1024x1024 fp32), AdamW with quant8 state, torch with 1 intra-op thread for backward
and fo's pool with `--fo-threads`. Rounds are interleaved; each prints the median per mode of
the iteration (zero_grad + forward + backward + step) and of `opt.step()` alone, the step
time left exposed after the last gradient (with overlap=True, what `step()` still waits for).

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
    for overlap in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(a.width, a.width, bias=False) for _ in range(a.layers)])
        opt = fo.torch.AdamW(model.parameters(), lr=1e-4, overlap=overlap, max_grad_norm=a.max_grad_norm)
        runs[overlap] = (model, opt)
    x = torch.randn(a.batch, a.width)
    res = {m: {"iter": [], "step": []} for m in runs}
    for r in range(a.rounds):
        for overlap in ((False, True) if r % 2 == 0 else (True, False)):
            model, opt = runs[overlap]
            it, st = [], []
            for _ in range(a.steps):
                t0 = time.perf_counter()
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                t1 = time.perf_counter()
                opt.step()
                t2 = time.perf_counter()
                it.append(t2 - t0)
                st.append(t2 - t1)
            res[overlap]["iter"].append(statistics.median(it))
            res[overlap]["step"].append(statistics.median(st))
    for overlap, d in res.items():
        name = "overlap=True " if overlap else "overlap=False"
        i, s = (sorted(v) for v in (d["iter"], d["step"]))
        print(f"{name}: iteration {statistics.median(i) * 1e3:.1f} ms [{i[0] * 1e3:.1f}-{i[-1] * 1e3:.1f}], "
              f"exposed step {statistics.median(s) * 1e3:.1f} ms [{s[0] * 1e3:.1f}-{s[-1] * 1e3:.1f}]")
    print(f"last overlapped step: {runs[True][1].last_step_stats}")


if __name__ == "__main__":
    main()
