"""GPU step throughput: fo's device AdamW against torch's fused and foreach AdamW on the same
CUDA tensors, fp32 and bf16 params, in one process (268M params in 64 tensors by default).

Every optimizer steps its own copy of the same initial params with the same grads, and a
device copy (torch `copy_`) of as many bytes as each step moves is timed beside them. Rounds
are interleaved (each runner does `--steps` steps per round, in a rotating order), so clock
and thermal drift hit all alike; a round gives one time per step (CUDA events around the
round's steps) per runner, and the table shows the median over rounds with the spread
(min-max of the round values), the ratio to torch's fused fp32 AdamW and to the copy
(both taken per round, then the median), and, for fo, the host time of one
`fo_optimizer_step` call (the call returns once its kernels are queued: it never waits
for the GPU).

Bytes a step moves per param: reads of param and grad, a write of param, a read and a
write of every state byte (`fo_optimizer_state_bytes` for fo; torch's exp_avg and
exp_avg_sq in the param's dtype). A copy of S bytes reads S and writes S, so the copy
baseline copies half the step's bytes.

    cargo build --release --features cuda
    FO_LIBRARY=target/release/libfo.so python scripts/bench_gpu_step.py
    python scripts/bench_gpu_step.py --params 64M --tensors 16 --dtypes bf16 --rounds 5

fo is reached through its C ABI (ctypes, fo's own structs): the Python `fo.Optimizer`
registers numpy (host) arrays and `fo.torch` host tensors only, while here a param is a
`fo_tensor` over CUDA memory (`device` = the ordinal), stepped on torch's current stream.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cuda import count, need_torch_gpu, split  # noqa: E402

HP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=count, default=count("256M"),
                    help="parameters per optimizer (default 256M = 268435456)")
    ap.add_argument("--tensors", type=count, default=64, help="tensors they are split into (default 64)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="param dtypes, comma-separated: fp32, bf16")
    ap.add_argument("--fo-formats", default="fp32,quant8",
                    help="fo state formats, comma-separated: fp32, param_dtype, quant8, quant8_wide")
    ap.add_argument("--fo-arithmetic", default="exact,fast",
                    help="fo arithmetics for its compressed formats, comma-separated: exact, fast "
                         "(fp32 state steps the same under both, so it runs once)")
    ap.add_argument("--master-bits", type=int, default=24, choices=[0, 24, 32],
                    help="fo's master-weight bits for bf16 params with quant8 state (default 24)")
    ap.add_argument("--rounds", type=count, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--steps", type=count, default=10, help="steps per runner per round (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per runner first (default 3)")
    ap.add_argument("--device", type=int, default=0, help="CUDA ordinal (default 0)")
    a = ap.parse_args(argv)
    a.dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    a.fo_formats = [f.strip() for f in a.fo_formats.split(",") if f.strip()]
    a.fo_arithmetic = [m.strip() for m in a.fo_arithmetic.split(",") if m.strip()]
    for m in a.fo_arithmetic:
        if m not in ("exact", "fast"):
            ap.error(f"--fo-arithmetic: unknown arithmetic {m!r} (exact, fast)")
    if not a.fo_arithmetic:
        ap.error("--fo-arithmetic: none given")
    for d in a.dtypes:
        if d not in ("fp32", "bf16"):
            ap.error(f"--dtypes: unknown dtype {d!r} (fp32, bf16)")
    for f in a.fo_formats:
        if f not in ("fp32", "param_dtype", "quant8", "quant8_wide"):
            ap.error(f"--fo-formats: unknown state format {f!r}")
    if not a.dtypes:
        ap.error("--dtypes: none given")
    if a.tensors > a.params:
        ap.error(f"--tensors {a.tensors} is more than --params {a.params}")
    if a.warmup < 0:
        ap.error("--warmup must be >= 0")
    return a


class FoRunner:
    """An fo optimizer over CUDA tensors, through the C ABI."""

    def __init__(self, torch, params, grads, state_format, master_bits, ordinal, arithmetic="exact"):
        from fo import _ffi
        from fo import optim as fo_optim
        self.ffi, self.o = _ffi, fo_optim
        self.params, self.grads = params, grads
        cfg = fo_optim.config("adamw", state_format=state_format, master_weight_bits=master_bits,
                              arithmetic=arithmetic, **HP)
        self.h = fo_optim._P()
        _ffi.check(fo_optim._create(ctypes.byref(cfg), ctypes.byref(self.h)))
        code = _ffi.DTYPE_CODES["f32" if params[0].dtype == torch.float32 else "bf16"]
        self._shapes = []  # kept alive: fo_tensor points at them

        def struct(t):
            shape = (ctypes.c_int64 * 1)(t.numel())
            self._shapes.append(shape)
            return _ffi.Tensor(t.data_ptr(), code, 1, ctypes.cast(shape, _ffi.i64p), None, ordinal)

        idx = ctypes.c_int32(-1)
        for i, p in enumerate(params):
            s = struct(p)
            _ffi.check(fo_optim._add_param(self.h, f"p{i}".encode(), ctypes.byref(s), None, 0,
                                           ctypes.byref(idx)))
        self.grad_array = (_ffi.Tensor * len(grads))(*[struct(g) for g in grads])
        _ffi.check(fo_optim._set_stream(self.h, torch.cuda.current_stream().cuda_stream))
        self.host_s = []

    def step(self):
        t0 = time.perf_counter()
        status = self.o._step(self.h, self.grad_array, len(self.grads))
        self.host_s.append(time.perf_counter() - t0)
        self.ffi.check(status)

    def state_bytes(self):
        out = ctypes.c_uint64(0)
        self.ffi.check(self.o._state_bytes(self.h, -1, ctypes.byref(out)))
        return out.value

    def close(self):
        self.o._destroy(self.h)


def copy_name(s: int) -> str:
    """The copy baseline's name: its exact byte count, so two sizes never share one."""
    return f"copy_ of {s:,} B"


def setup(torch, _ffi, a, dev):
    """The runners (name -> one step), the bytes each step moves, and the fo runners."""
    sizes = split(a.params, a.tensors)
    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16}
    g = torch.Generator(device=dev).manual_seed(0)
    runners, moved, fo_runners = {}, {}, {}
    for d in a.dtypes:
        size = 4 if d == "fp32" else 2
        init = [(torch.randn(s, generator=g, device=dev) * 0.02).to(tdt[d]) for s in sizes]
        grads = [(torch.randn(s, generator=g, device=dev) * 1e-3).to(tdt[d]) for s in sizes]
        for kind in ("fused", "foreach"):
            ps = [torch.nn.Parameter(p.clone()) for p in init]
            for p, gr in zip(ps, grads):
                p.grad = gr  # shared: AdamW only reads grads
            opt = torch.optim.AdamW(ps, **HP, **{kind: True})
            name = f"torch AdamW {kind} {d}"
            runners[name] = opt.step
            moved[name] = (3 * size + 2 * 2 * size) * a.params  # exp_avg, exp_avg_sq in the param dtype
        for fmt, arith in [(f, m) for f in a.fo_formats for m in a.fo_arithmetic]:
            if fmt == "fp32" and arith != a.fo_arithmetic[0]:
                continue  # fp32 state: the same step under either arithmetic
            mw = a.master_bits if d == "bf16" and fmt.startswith("quant8") else 0
            name = f"fo AdamW {fmt}{f'+{mw}b' if mw else ''} {d}{' fast' if arith == 'fast' and fmt != 'fp32' else ''}"
            try:
                r = FoRunner(torch, [p.clone() for p in init], grads, fmt, mw, a.device, arith)
            except _ffi.FoError as e:
                sys.exit(f"bench_gpu_step: fo cannot step CUDA tensors here ({_ffi.library_path}): {e}\n"
                         "(build libfo with `cargo build --release --features cuda`)")
            r.step()  # state is allocated by the first step
            runners[name], fo_runners[name] = r.step, r
            moved[name] = 3 * size * a.params + 2 * r.state_bytes()
        del init
    # The copy baselines: a copy of S bytes moves 2S, so S is half of what the step moves;
    # one buffer pair of the largest S, each copy over its first S bytes.
    most = max(moved.values()) // 2
    src = torch.empty(most, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for s in sorted({b // 2 for b in moved.values()}):
        runners[copy_name(s)] = (lambda s=s: dst[:s].copy_(src[:s]))
    return runners, moved, fo_runners


def main(argv=None):
    a = parse_args(argv)
    torch = need_torch_gpu("bench_gpu_step", a.device)
    try:
        import fo  # noqa: F401  (loads libfo: FO_LIBRARY, or target/release/libfo.so)
        from fo import _ffi
    except ImportError as e:
        sys.exit(f"bench_gpu_step: {e}")
    dev = torch.device("cuda", a.device)
    torch.cuda.set_device(dev)
    try:
        runners, moved, fo_runners = setup(torch, _ffi, a, dev)
    except torch.cuda.OutOfMemoryError as e:
        sys.exit(f"bench_gpu_step: not enough GPU memory for {len(a.dtypes)} dtype(s) x "
                 f"{2 + len(a.fo_formats)} optimizers of {a.params} params (use --params, --dtypes or "
                 f"--fo-formats to measure fewer at once): {str(e).splitlines()[0]}")
    names = list(runners)
    for n in names:
        for _ in range(a.warmup):
            runners[n]()
    torch.cuda.synchronize()
    for r in fo_runners.values():
        r.host_s.clear()
    per = {n: [] for n in names}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for rnd in range(a.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for n in order:
            start.record()
            for _ in range(a.steps):
                runners[n]()
            end.record()
            end.synchronize()
            per[n].append(start.elapsed_time(end) / 1e3 / a.steps)

    base = "torch AdamW fused fp32"
    print(f"\n{torch.cuda.get_device_name(dev)} (torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"libfo {_ffi.library_path}): {a.params / 1e6:.1f}M params in {a.tensors} tensors; "
          f"{a.rounds} interleaved rounds x {a.steps} steps; median [min-max of rounds]")
    print(f"  {'optimizer':34s} {'G params/s':>22s} {'GB/s':>6s} {'B/param':>8s} "
          f"{'x fused fp32':>12s} {'x copy':>7s} {'host us/call':>13s}")
    for n in names:
        if n.startswith("copy_"):
            continue
        rate = [a.params / t / 1e9 for t in per[n]]
        copy = per[copy_name(moved[n] // 2)]
        vs_copy = statistics.median(c / t for c, t in zip(copy, per[n]))
        vs_base = (f"{statistics.median(b / t for b, t in zip(per[base], per[n])):12.2f}"
                   if base in per else f"{'-':>12s}")
        host = (f"{statistics.median(fo_runners[n].host_s) * 1e6:13.1f}" if n in fo_runners else f"{'-':>13s}")
        print(f"  {n:34s} {statistics.median(rate):8.2f} [{min(rate):5.2f}-{max(rate):5.2f}] "
              f"{moved[n] / statistics.median(per[n]) / 1e9:6.0f} {moved[n] / a.params:8.3f} "
              f"{vs_base} {vs_copy:7.2f} {host}")
    for s in sorted({b // 2 for b in moved.values()}):
        n = copy_name(s)
        print(f"  {n:34s} {2 * s / statistics.median(per[n]) / 1e9:6.0f} GB/s (reads + writes)")
    for r in fo_runners.values():
        r.close()


if __name__ == "__main__":
    main()
