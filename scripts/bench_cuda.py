"""What the GPU benchmarks in scripts/ share: element counts on the command line, tensors
split evenly, torch with a usable CUDA device and a libfo that steps CUDA memory (or one
line saying why not, exit 2: nothing to measure is not a traceback)."""
from __future__ import annotations

import argparse
import sys


def die(name: str, msg: str, code: int = 2):
    """`name: msg` on stderr, then exit `code`."""
    print(f"{name}: {msg}", file=sys.stderr)
    sys.exit(code)


def count(text: str) -> int:
    """An element count: 268435456, 268_435_456, 256M (2**20), 64K, 1G."""
    t = text.strip().replace("_", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:].upper(), 1)
    if mult > 1:
        t = t[:-1]
    try:
        n = int(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 268435456 or 256M)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return n


def split(n: int, k: int) -> list[int]:
    """`n` elements in `k` tensors, as even as can be (the first `n % k` one larger)."""
    return [n // k + (i < n % k) for i in range(k)]


def need_torch_gpu(name: str, ordinal: int):
    """torch, with CUDA device `ordinal` usable; exits 2 with the reason otherwise."""
    try:
        import torch
    except ImportError as e:
        die(name, f"needs torch with CUDA ({e}); e.g. the venv scripts/test.sh makes (~/.cache/fo/torch-venv)")
    if not torch.cuda.is_available():
        die(name, f"no CUDA GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none "
            "(torch.cuda.is_available() is False); run it on a GPU machine")
    if not 0 <= ordinal < torch.cuda.device_count():
        die(name, f"--device {ordinal}, but torch sees {torch.cuda.device_count()} GPU(s)")
    return torch


def fo_cuda_missing(stream=None):
    """Why this libfo cannot step CUDA memory (the FoError of `set_stream`, which a build
    without the `cuda` feature or without libcuda refuses), or None when it can."""
    import fo
    opt = fo.optim.Optimizer("adamw")
    try:
        opt.set_stream(stream)
    except fo.FoError as e:
        return f"libfo at {fo._ffi.library_path} cannot step CUDA memory ({e}); build it with " \
               "`cargo build --release --features cuda` and point FO_LIBRARY at it"
    finally:
        opt.close()
    return None
