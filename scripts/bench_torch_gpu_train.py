"""A GPU training step (forward, backward, optimizer step) with fo.torch's optimizers against
the same loop with torch.optim.AdamW(fused=True), in one process, on one GPU: the target of
"fo.torch on the GPU" is fo's default AdamW (quant8 state, exact arithmetic on the GPU) no
slower than torch's fused AdamW on a >= 100M-parameter model, with a quarter of its state.

Each runner trains its own copy of one model (`--layers` x Linear(width, width) with GELU,
bf16 or fp32 parameters; the default, 24 x 2048, has 100.7M parameters) on the same fixed
batches. Rounds are interleaved: in each round every runner, in a rotating order, runs
`--steps` steps two ways, each timed with CUDA events:
- one step at a time (forward + backward + step, then a wait for the GPU): a step's
  latency, every GPU tail exposed;
- back to back (`--steps` steps queued, one wait at the end, the time per step): a loop
  that does not wait for each step, where the host queues the next forward while the GPU
  finishes the step (at this model's small batch the host's launches set the pace).
The table shows, for each, the median of the round values, their spread (min-max) and the
ratio to torch's fused AdamW in the same rounds, then the optimizer state each keeps
(torch: its state tensors' bytes; fo: `state_memory()`, device and host).

    FO_LIBRARY=target/release/libfo.so python scripts/bench_torch_gpu_train.py   # a cuda build
    python scripts/bench_torch_gpu_train.py --layers 8 --width 1024 --rounds 3   # --help: all flags

Runners: `torch fused` (torch.optim.AdamW(fused=True)), `fo quant8` (fo.torch.AdamW: its
defaults, arithmetic="fast", fo_fast.cuh on the GPU), `fo quant8 exact` (the same with
arithmetic="exact": FlashOptim's bits),
`fo quant8 overlap` (the defaults with overlap="always": each layer stepped on fo's step
lane during backward), `fo fp32` (state_format="fp32"), `fo offload` (offload=1.0: master weights and
state on the host, the CUDA parameters as fo's mirrors). Without torch, a CUDA GPU or a libfo
that steps CUDA tensors it says why in one line and exits 2."""
import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))

from bench_cuda import die, fo_cuda_missing, need_torch_gpu  # noqa: E402

NAME = "bench_torch_gpu_train"
RUNNERS = ("torch fused", "fo quant8", "fo quant8 exact", "fo quant8 overlap", "fo fp32", "fo offload")
HP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def parse(argv=None):
    ap = argparse.ArgumentParser(prog=NAME, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24, help="Linear(width, width) layers (default 24)")
    ap.add_argument("--width", type=int, default=2048, help="their width (default 2048: 100.7M params at 24)")
    ap.add_argument("--batch", type=int, default=32, help="rows per batch (default 32)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="parameter dtype (default bf16)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per runner per round (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per runner first (default 2)")
    ap.add_argument("--only", default=",".join(RUNNERS),
                    help=f"comma-separated runners, the first is the base (default: {','.join(RUNNERS)})")
    ap.add_argument("--device", type=int, default=0, help="CUDA ordinal (default 0)")
    a = check_args(ap, ap.parse_args(argv))
    if a.warmup < 0:
        ap.error("--warmup must be >= 0")
    return a


def check_args(ap, a):
    """`a` with `--only` as a list of known runners and the sizes positive, else `ap`'s
    error naming the flag (profile_gpu_step.py takes the same flags)."""
    a.only = [r.strip() for r in a.only.split(",") if r.strip()]
    unknown = [r for r in a.only if r not in RUNNERS]
    if unknown or not a.only:
        ap.error(f"--only: unknown runner(s) {unknown} (known: {', '.join(RUNNERS)})" if unknown else "--only: none")
    for flag in ("layers", "width", "batch", "rounds", "steps"):
        if getattr(a, flag) <= 0:
            ap.error(f"--{flag} must be positive")
    return a


def build(torch, a, dev):
    torch.manual_seed(0)
    layers = []
    for _ in range(a.layers):
        layers += [torch.nn.Linear(a.width, a.width), torch.nn.GELU()]
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    return torch.nn.Sequential(*layers).to(device=dev, dtype=dtype)


def optimizer(torch, name, model):
    import fo.torch

    ps = list(model.parameters())
    if name == "torch fused":
        return torch.optim.AdamW(ps, fused=True, **HP)
    extra = {"fo quant8": {}, "fo quant8 exact": {"arithmetic": "exact"}, "fo quant8 overlap": {"overlap": "always"},
             "fo fp32": {"state_format": "fp32"}, "fo offload": {"offload": 1.0}}[name]
    return fo.torch.AdamW(ps, **HP, **extra)


def state_bytes(torch, opt):
    """(device bytes, host bytes) of the optimizer state opt keeps."""
    if hasattr(opt, "state_memory"):
        m = opt.state_memory()
        return m["device_bytes"], m["host_bytes"]
    dev = host = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                n = v.numel() * v.element_size()
                dev, host = (dev + n, host) if v.is_cuda else (dev, host + n)
    return dev, host


def open_runs(a, name):
    """(torch, the CUDA device, a seeded generator on it, {runner: (model, optimizer)} for
    `a.only`), once torch sees the GPU and libfo steps CUDA memory (else one line naming
    `name` and exit 2). profile_gpu_step.py opens its runs here too."""
    torch = need_torch_gpu(name, a.device)
    why = fo_cuda_missing()
    if why is not None:
        die(name, why)
    dev = torch.device("cuda", a.device)
    torch.cuda.set_device(dev)
    g = torch.Generator(device=dev).manual_seed(1)
    runs = {}
    for r in a.only:
        model = build(torch, a, dev)
        runs[r] = (model, optimizer(torch, r, model))
    return torch, dev, g, runs


def main(argv=None):
    a = parse(argv)
    torch, dev, g, runs = open_runs(a, NAME)
    import fo

    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    batches = [(torch.randn(a.batch, a.width, generator=g, device=dev).to(dtype),
                torch.randn(a.batch, a.width, generator=g, device=dev).to(dtype)) for _ in range(4)]
    n = sum(p.numel() for p in runs[a.only[0]][0].parameters())
    print(f"{NAME}: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, fo {fo.version()}; "
          f"{a.layers} x Linear({a.width}) {a.dtype}: {n / 1e6:.1f}M params, batch {a.batch}")

    def step(name, k):
        model, opt = runs[name]
        x, y = batches[k % len(batches)]
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for name in a.only:
        for k in range(a.warmup):
            step(name, k)
    torch.cuda.synchronize()
    def event():
        return torch.cuda.Event(enable_timing=True)

    single = {name: [] for name in a.only}  # per round: the median of its steps, each waited for
    queued = {name: [] for name in a.only}  # per round: ms per step of `--steps` back to back
    for r in range(a.rounds):
        order = a.only[r % len(a.only):] + a.only[:r % len(a.only)]
        for name in order:
            times = []
            for k in range(a.steps):
                start, end = event(), event()
                start.record()
                step(name, k)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            single[name].append(statistics.median(times))
            start, end = event(), event()
            start.record()
            for k in range(a.steps):
                step(name, k)
            end.record()
            end.synchronize()
            queued[name].append(start.elapsed_time(end) / a.steps)
    print(f"\n{'runner':<14} {'one step at a time, ms':>28} {'vs ' + a.only[0]:>16}"
          f" {'back to back, ms/step':>28} {'vs ' + a.only[0]:>16}"
          f" {'state, device':>15} {'state, host':>13} {'B/param':>8}")
    base1, baseq = statistics.median(single[a.only[0]]), statistics.median(queued[a.only[0]])
    for name in a.only:
        m1, mq = single[name], queued[name]
        med1, medq = statistics.median(m1), statistics.median(mq)
        d, h = state_bytes(torch, runs[name][1])
        print(f"{name:<14} {med1:>12.2f} [{min(m1):.2f}-{max(m1):.2f}] {base1 / med1:>15.3f}x"
              f" {medq:>12.2f} [{min(mq):.2f}-{max(mq):.2f}] {baseq / medq:>15.3f}x"
              f" {d / 1e6:>12.1f} MB {h / 1e6:>10.1f} MB {(d + h) / n:>8.3f}")
    print(f"\n(median [min-max] over {a.rounds} rounds of {a.steps} steps; vs {a.only[0]}: its time "
          f"over this runner's, > 1 is faster)")


if __name__ == "__main__":
    main()
