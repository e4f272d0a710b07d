"""Where a GPU training step's time goes, fo.torch's optimizers beside torch's fused AdamW: the
split that `bench_torch_gpu_train.py` (which times whole steps) cannot show.

The model and the runners are the training bench's (`--layers` x Linear(width) with GELU, bf16;
the default 24 x 2048 is 100.7M parameters). For each runner, in interleaved rounds, every step
is timed in three parts, each a median over the rounds' steps:
- forward + backward on the GPU (CUDA events around them);
- `step()` on the GPU (events around the call, after a wait for backward, so the GPU is idle
  when the call starts: this is the call's host time plus its kernels' time);
- `step()` on the host (wall clock around the call), and for fo the part of it spent in
  `fo_optimizer_step` (the ctypes call fo.torch makes, wrapped to time it: the rest is
  fo.torch's Python).
`--kernels` adds `torch.profiler`'s table of each runner's CUDA kernels over 3 steps.

    FO_LIBRARY=target/release/libfo.so python scripts/profile_gpu_step.py      # a cuda build
    python scripts/profile_gpu_step.py --only "torch fused,fo quant8" --kernels   # --help: all flags

For one kernel's hardware counters, run it under Nsight Compute, e.g.
`ncu --clock-control none -k regex:fo_step_kernel_p7 --launch-skip 2 -c 1 python
scripts/profile_gpu_step.py --only "fo quant8" --rounds 1 --steps 3` (p7: the default, fast;
p4 under `--only "fo quant8 exact"`) (`scripts/gpu_kit.sh run
profile` does both). Without torch, a CUDA GPU or a libfo that steps CUDA tensors it says why in
one line and exits 2."""
import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))

from bench_torch_gpu_train import check_args, open_runs  # noqa: E402

NAME = "profile_gpu_step"
DEFAULT = ("torch fused", "fo quant8", "fo quant8 exact", "fo fp32")


def parse(argv=None):
    ap = argparse.ArgumentParser(prog=NAME, description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n")[-1],  # how to run it under ncu
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24, help="Linear(width, width) layers (default 24)")
    ap.add_argument("--width", type=int, default=2048, help="their width (default 2048: 100.7M params at 24)")
    ap.add_argument("--batch", type=int, default=32, help="rows per batch (default 32)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per runner per round (default 5)")
    ap.add_argument("--only", default=",".join(DEFAULT),
                    help=f"comma-separated runners of bench_torch_gpu_train.py (default: {','.join(DEFAULT)})")
    ap.add_argument("--kernels", action="store_true", help="also print torch.profiler's CUDA kernels per runner")
    ap.add_argument("--device", type=int, default=0, help="CUDA ordinal (default 0)")
    a = check_args(ap, ap.parse_args(argv))
    a.dtype, a.warmup = "bf16", 2  # the training bench's model and warm-up
    return a


class CallTimer:
    """Wraps `fo.optim._step` (the C call fo.torch's step() makes) to time each call."""

    def __init__(self):
        import fo.optim

        self.mod, self.real, self.times = fo.optim, fo.optim._step, []
        self.mod._step = self

    def __call__(self, *args):
        t = time.perf_counter()
        try:
            return self.real(*args)
        finally:
            self.times.append(time.perf_counter() - t)

    def close(self):
        self.mod._step = self.real


def main(argv=None):
    a = parse(argv)
    torch, dev, g, runs = open_runs(a, NAME)
    import fo

    x = torch.randn(a.batch, a.width, generator=g, device=dev).bfloat16()
    y = torch.randn(a.batch, a.width, generator=g, device=dev).bfloat16()
    n = sum(p.numel() for p in runs[a.only[0]][0].parameters())
    print(f"{NAME}: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, fo {fo.version()}; "
          f"{a.layers} x Linear({a.width}) bf16: {n / 1e6:.1f}M params, batch {a.batch}")

    def fwd_bwd(model):
        torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()

    for model, opt in runs.values():
        for _ in range(a.warmup):
            fwd_bwd(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    calls = CallTimer()
    parts = {name: {"fb": [], "gpu": [], "host": [], "call": []} for name in a.only}
    try:
        for r in range(a.rounds):
            for name in a.only[r % len(a.only):] + a.only[:r % len(a.only)]:
                model, opt = runs[name]
                for _ in range(a.steps):
                    e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                    e[0].record()
                    fwd_bwd(model)
                    e[1].record()
                    e[1].synchronize()  # the GPU is idle when step() starts
                    calls.times.clear()
                    e[2].record()
                    t = time.perf_counter()
                    opt.step()
                    host = time.perf_counter() - t
                    e[3].record()
                    e[3].synchronize()
                    opt.zero_grad(set_to_none=True)
                    p = parts[name]
                    p["fb"].append(e[0].elapsed_time(e[1]))
                    p["gpu"].append(e[2].elapsed_time(e[3]))
                    p["host"].append(host * 1e3)
                    if calls.times:
                        p["call"].append(sum(calls.times) * 1e3)
    finally:
        calls.close()
    print(f"\n{'runner':<14} {'fwd+bwd, GPU ms':>16} {'step(), GPU ms':>15} {'step(), host ms':>16}"
          f" {'of it fo_optimizer_step':>24}")
    for name in a.only:
        p = parts[name]
        med = {k: statistics.median(v) if v else None for k, v in p.items()}
        call = f"{med['call']:.3f}" if med["call"] is not None else "-"
        print(f"{name:<14} {med['fb']:>16.3f} {med['gpu']:>15.3f} {med['host']:>16.3f} {call:>24}")
    print(f"\n(medians over {a.rounds} rounds x {a.steps} steps; step() GPU = its host time plus its kernels, "
          f"the GPU idle when it starts)")
    if a.kernels:
        from torch.profiler import ProfilerActivity, profile

        for name in a.only:
            model, opt = runs[name]
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fwd_bwd(model)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
            print(f"\n{name}: CUDA kernels over 3 steps")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=48))


if __name__ == "__main__":
    main()
