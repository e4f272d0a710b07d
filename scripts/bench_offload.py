"""Offload step: fo stepping HOST parameters whose gradients are on a GPU (gradients down,
updated params up into device mirrors) against torch's CPU-offload loop and against the
copies alone, per step, with the model's params and grads on the GPU (64M params in 16
tensors by default: issue 36's table).

Runners, each stepping its own copy of the same initial params with the same grads:
- torch loop (the baseline): grads copied `non_blocking` into pinned host buffers, an event
  waited for, torch's CPU AdamW (fused; foreach where fused is unavailable on CPU: the
  table says which) on fp32 master params, the updated params copied back `non_blocking`
  into the CUDA params (bf16: cast into a pinned bf16 buffer first), synchronize;
- copies alone: the bytes fo's step moves (each gradient down, each mirror up), pinned,
  `non_blocking`, on two streams at once, synchronized: the floor the pipeline approaches;
- fo: fp32 state with fp32 params; bf16 params + quant8 state + 24-bit masters, exact and
  fast arithmetic. Host params and state live in host memory (numpy arrays registered
  with fo), the CUDA params are their mirrors (`fo_optimizer_set_mirror`), the gradients
  are CUDA tensors given to `fo_optimizer_step` with `device` = the ordinal, fo's stream
  is torch's current stream; each step call is followed by a synchronize.

Each thread count (`--threads`, default 1 and all cores; fo_set_num_threads and
torch.set_num_threads alike) runs interleaved rounds: each runner does `--steps` steps
per round, in a rotating order, so drift hits all alike. A step's time is wall clock
(it ends with a synchronize, so it covers the host math and both copy directions). The
table shows ms per step, median [min-max of the rounds], the speedup over the torch loop
of the same param dtype (torch ms / fo ms) and the time over the copies alone (fo ms /
copies ms), each taken per round then the median, and the copies' GB/s (down + up).

Issue 36's targets: fp32 state >= 1.0x the torch loop (the speedup), bf16 + quant8 +
24-bit fast >= 1.6x, and every offload step <= 1.25x the time of the copies alone.

    cargo build --release --features cuda
    FO_LIBRARY=target/release/libfo.so ~/.cache/fo/torch-venv/bin/python scripts/bench_offload.py
    python scripts/bench_offload.py --params 16M --formats quant8-fast --threads all --rounds 3

Exits 2 with one line saying why where there is nothing to measure: no torch, no CUDA GPU,
or a libfo built without the `cuda` feature.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cuda import count, fo_cuda_missing, need_torch_gpu, split  # noqa: E402

HP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
# fo's formats: the param dtype they step (and mirror), and their optimizer config.
FORMATS = {
    "fp32": ("fp32", dict(state_format="fp32", master_weight_bits=0, arithmetic="exact")),
    "quant8": ("bf16", dict(state_format="quant8", master_weight_bits=24, arithmetic="exact")),
    "quant8-fast": ("bf16", dict(state_format="quant8", master_weight_bits=24, arithmetic="fast")),
}
LABELS = {"fp32": "fo fp32 state, fp32 params", "quant8": "fo bf16+quant8+24b exact",
          "quant8-fast": "fo bf16+quant8+24b fast"}


def die(msg: str, code: int = 2):
    """One line on stderr and exit `code`: nothing to measure is not a traceback."""
    print(f"bench_offload: {msg}", file=sys.stderr)
    sys.exit(code)


def cores() -> int:
    """The cores this process may run on (a container's limit, not the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def parse_args(argv):
    paragraphs = __doc__.split("\n\n")  # --help: the summary, then the targets, use and exits
    ap = argparse.ArgumentParser(description=paragraphs[0], epilog="\n\n".join(paragraphs[-3:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=count, default=count("64M"), help="model parameters (default 64M = 67108864)")
    ap.add_argument("--tensors", type=count, default=16, help="tensors they are split into (default 16)")
    ap.add_argument("--formats", default="fp32,quant8,quant8-fast",
                    help="fo formats, comma-separated: fp32, quant8, quant8-fast (default all three)")
    ap.add_argument("--threads", default="1,all", help="thread counts, comma-separated; all = every core "
                    "(default 1,all)")
    ap.add_argument("--rounds", type=count, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--steps", type=count, default=3, help="steps per runner per round (default 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per runner per thread count (default 2)")
    ap.add_argument("--device", type=int, default=0, help="CUDA ordinal (default 0)")
    a = ap.parse_args(argv)
    a.formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    if not a.formats:
        ap.error("--formats: none given")
    for f in a.formats:
        if f not in FORMATS:
            ap.error(f"--formats: unknown format {f!r} (fp32, quant8, quant8-fast)")
    threads = []
    for t in (t.strip() for t in a.threads.split(",") if t.strip()):
        try:
            threads.append(cores() if t == "all" else count(t))
        except argparse.ArgumentTypeError:
            ap.error(f"--threads: {t!r} is neither a positive count nor 'all'")
    if not threads:
        ap.error("--threads: none given")
    a.threads = list(dict.fromkeys(threads))  # "1,all" on one core is one setting
    if a.tensors > a.params:
        ap.error(f"--tensors {a.tensors} is more than --params {a.params}")
    if a.warmup < 0:
        ap.error("--warmup must be >= 0")
    if a.device < 0:
        ap.error("--device must be >= 0")
    return a


class Structs:
    """fo_tensor structs over CUDA tensors (1-dim), with the shapes they point at kept alive."""

    def __init__(self, ordinal):
        from fo import _ffi
        self.ffi, self.ordinal, self.shapes = _ffi, ordinal, []

    def __call__(self, t):
        shape = (ctypes.c_int64 * 1)(t.numel())
        self.shapes.append(shape)
        code = self.ffi.DTYPE_CODES["bf16" if t.element_size() == 2 else "f32"]
        return self.ffi.Tensor(t.data_ptr(), code, 1, ctypes.cast(shape, self.ffi.i64p), None, self.ordinal)


class FoOffload:
    """fo's offload step: host params and state, CUDA grads, CUDA mirrors."""

    def __init__(self, torch, init, grads, fmt, ordinal):
        import numpy as np
        import fo
        self.torch, self.np, self.o = torch, np, fo.optim
        self.bf16 = FORMATS[fmt][0] == "bf16"
        self.opt = fo.optim.Optimizer("adamw", **FORMATS[fmt][1], **HP)
        self.mirrors = [p.clone() for p in init]
        # Host params: numpy copies of the initial values (bf16 as uint16 bit patterns).
        self.host = [(p.cpu().view(torch.int16).numpy().view(np.uint16) if self.bf16 else p.cpu().numpy()).copy()
                     for p in init]
        self.first = self.host[0].copy()
        for i, h in enumerate(self.host):
            self.opt.add_param(f"p{i}", h, dtype="bf16" if self.bf16 else None)
        self.opt.set_stream(torch.cuda.current_stream().cuda_stream)  # before the mirrors: they are written on it
        struct = Structs(ordinal)
        for i, m in enumerate(self.mirrors):
            self.opt.set_mirror(i, struct(m))
        self.grad_array = (struct.ffi.Tensor * len(grads))(*[struct(g) for g in grads])
        self.struct, self.n, self.call_s = struct, len(grads), []

    def step(self):
        t0 = time.perf_counter()
        status = self.o._step(self.opt._handle, self.grad_array, self.n)
        self.call_s.append(time.perf_counter() - t0)
        self.struct.ffi.check(status)
        self.torch.cuda.synchronize()

    def mirror_problem(self):
        """None when the step changed the first param and its mirror holds the new bits
        (a benchmark of a step that writes nothing would measure nothing)."""
        m = self.mirrors[0].cpu()
        m = m.view(self.torch.int16).numpy().view(self.np.uint16) if self.bf16 else m.numpy()
        if self.np.array_equal(self.host[0], self.first):
            return "the first param did not change"
        if not self.np.array_equal(m, self.host[0]):
            return "the first mirror differs from its host param"
        return None


class TorchLoop:
    """The CPU-offload loop a torch user writes: grads down, CPU AdamW, params up."""

    def __init__(self, torch, init, grads):
        self.torch, self.grads = torch, grads
        self.params = [p.clone() for p in init]
        self.bf16 = init[0].dtype == torch.bfloat16
        self.gpin = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True) for g in grads]
        # fp32 masters are pinned so their upload is truly asynchronous; bf16 ones are cast
        # into pinned bf16 buffers, which go up.
        self.master = [torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32, pin_memory=not self.bf16))
                       for p in init]
        with torch.no_grad():
            for m, p in zip(self.master, init):
                m.copy_(p)
        self.ppin = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in init] if self.bf16 else []
        for m, g in zip(self.master, self.gpin):
            m.grad = torch.empty_like(m.data) if self.bf16 else g  # fp32: the pinned buffer is the grad
        try:
            self.opt, self.kind = torch.optim.AdamW(self.master, **HP, fused=True), "fused"
        except (RuntimeError, ValueError):  # a torch without fused CPU AdamW
            self.opt, self.kind = torch.optim.AdamW(self.master, **HP, foreach=True), "foreach"
        self.down = torch.cuda.Event()

    def step(self):
        torch = self.torch
        with torch.no_grad():
            for g, pin in zip(self.grads, self.gpin):
                pin.copy_(g, non_blocking=True)
            self.down.record()
            self.down.synchronize()
            if self.bf16:
                for m, pin in zip(self.master, self.gpin):
                    m.grad.copy_(pin)
            self.opt.step()
            if self.bf16:
                for p, m, pin in zip(self.params, self.master, self.ppin):
                    pin.copy_(m)
                    p.copy_(pin, non_blocking=True)
            else:
                for p, m in zip(self.params, self.master):
                    p.copy_(m, non_blocking=True)
            torch.cuda.synchronize()


class Copies:
    """The bytes fo's offload step moves, alone: each grad down and each mirror up, pinned,
    on two streams at once (as fo's two copy lanes), synchronized."""

    def __init__(self, torch, init, grads):
        self.torch, self.grads = torch, grads
        self.params = [p.clone() for p in init]
        self.gpin = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True) for g in grads]
        self.ppin = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in init]
        for pin, p in zip(self.ppin, init):
            pin.copy_(p)
        self.lanes = torch.cuda.Stream(), torch.cuda.Stream()
        self.bytes = sum(t.numel() * t.element_size() for t in [*grads, *init])

    def step(self):
        torch, cur = self.torch, self.torch.cuda.current_stream()
        down, up = self.lanes
        down.wait_stream(cur)  # the grads' producer, as fo's down stream waits for it
        up.wait_stream(cur)
        with torch.cuda.stream(down):
            for pin, g in zip(self.gpin, self.grads):
                pin.copy_(g, non_blocking=True)
        with torch.cuda.stream(up):
            for p, pin in zip(self.params, self.ppin):
                p.copy_(pin, non_blocking=True)
        torch.cuda.synchronize()


def setup(torch, a, dev):
    """The runners, name -> object with .step(), in table order, and each fo runner's dtype."""
    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16}
    sizes = split(a.params, a.tensors)
    gen = torch.Generator(device=dev).manual_seed(0)
    runners, dtype_of = {}, {}
    for d in dict.fromkeys(FORMATS[f][0] for f in a.formats):
        init = [(torch.randn(s, generator=gen, device=dev) * 0.02).to(tdt[d]) for s in sizes]
        grads = [(torch.randn(s, generator=gen, device=dev) * 1e-3).to(tdt[d]) for s in sizes]
        loop = TorchLoop(torch, init, grads)
        runners[f"torch loop {d} ({loop.kind} AdamW)"] = loop
        runners[f"copies {d}"] = Copies(torch, init, grads)
        for f in a.formats:
            if FORMATS[f][0] == d:
                runners[LABELS[f]] = FoOffload(torch, init, grads, f, a.device)
                dtype_of[LABELS[f]] = d
        del init
    return runners, dtype_of


def measure(runners, a):
    """Interleaved rounds: name -> seconds per step, one value per round."""
    names = list(runners)
    per = {n: [] for n in names}
    for rnd in range(a.rounds):
        for n in names[rnd % len(names):] + names[:rnd % len(names)]:
            t0 = time.perf_counter()
            for _ in range(a.steps):
                runners[n].step()
            per[n].append((time.perf_counter() - t0) / a.steps)
    return per


def report(per, runners, dtype_of, threads):
    med = statistics.median
    print(f"\n  {threads} thread(s)")
    print(f"  {'runner':40s} {'ms/step [min-max]':>26s} {'x torch loop':>13s} {'/ copies':>9s} "
          f"{'GB/s':>6s} {'call ms':>8s}")
    for n, r in runners.items():
        ms = [t * 1e3 for t in per[n]]
        cols = f"  {n:40s} {med(ms):9.1f} [{min(ms):7.1f}-{max(ms):7.1f}]"
        if n in dtype_of:
            d = dtype_of[n]
            base = next(k for k in runners if k.startswith(f"torch loop {d} "))
            speed = med(b / t for b, t in zip(per[base], per[n]))
            over = med(t / c for c, t in zip(per[f"copies {d}"], per[n]))
            call = med(r.call_s) * 1e3
            print(f"{cols} {speed:12.2f}x {over:8.2f}x {'':>6s} {call:8.1f}")
        elif n.startswith("copies"):
            print(f"{cols} {'':>13s} {'':>9s} {r.bytes / med(per[n]) / 1e9:6.1f}")
        else:
            print(f"{cols} {'1.00x':>13s}")


def main(argv=None):
    a = parse_args(argv)
    torch = need_torch_gpu("bench_offload", a.device)
    try:
        import fo
    except ImportError as e:  # libfo not found, or another ABI version
        die(str(e))
    dev = torch.device("cuda", a.device)
    torch.cuda.set_device(dev)
    why = fo_cuda_missing(torch.cuda.current_stream().cuda_stream)
    if why:
        die(why)
    try:
        runners, dtype_of = setup(torch, a, dev)
    except torch.cuda.OutOfMemoryError as e:
        die(f"not enough GPU memory for {a.params} params (use --params or --formats): {str(e).splitlines()[0]}")
    except fo.FoError as e:  # e.g. libcuda loads but NVRTC or the mirrors' copies do not
        die(f"fo refused the offload setup ({fo._ffi.library_path}): {e}")
    print(f"{torch.cuda.get_device_name(dev)} (torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"libfo {fo._ffi.library_path}); host: {cores()} cores ({os.cpu_count()} on the machine)")
    print(f"{a.params / 2**20:.1f}M params in {a.tensors} tensors; {a.rounds} interleaved rounds x {a.steps} "
          "steps; ms per step: median [min-max of rounds]; x torch loop = torch ms / this ms (targets: fp32 "
          ">= 1.0x, quant8 fast >= 1.6x); / copies = this ms / copies ms (target <= 1.25x); call ms = the "
          "fo_optimizer_step call alone")
    for t in a.threads:
        fo.optim.set_num_threads(t)
        torch.set_num_threads(t)
        for r in runners.values():
            for _ in range(a.warmup):
                r.step()
        for n, r in runners.items():
            if isinstance(r, FoOffload):
                r.call_s.clear()
                if a.warmup and (bad := r.mirror_problem()):
                    die(f"{n}: {bad} after the warm-up steps: the step is not what this measures", 1)
        report(measure(runners, a), runners, dtype_of, t)


if __name__ == "__main__":
    main()
