#!/usr/bin/env python3
"""Compiles fo's GPU kernels (src/kernels/gpu) with NVRTC to PTX for sm_80 and sm_90,
with --fmad=false as fo's launch code will, and fails on any error or warning (NVRTC's log
must be empty). Runs without a GPU: NVRTC is a compiler library, loaded here through ctypes.

usage: nvrtc_check.py LIBNVRTC_SO [OUT_DIR]
"""
import ctypes
import pathlib
import sys
import time

KERNELS = pathlib.Path(__file__).resolve().parent.parent / "src" / "kernels" / "gpu"
ARCHS = ["compute_80", "compute_90"]
ENTRY = "fo_step_kernel"
# One entry per compiled path besides ENTRY's (src/kernels/step_path.rs).
STEP_PATHS = 9
STEP_ENTRIES = [ENTRY] + [f"{ENTRY}_p{p}" for p in range(1, STEP_PATHS)]
# The clip's device norm and scaling (fo_norm.cuh).
NORM_ENTRIES = ["fo_norm_lanes_kernel", "fo_norm_chunks_kernel", "fo_scale_kernel"]
WRITTEN_FMAS = (KERNELS / "fo_rules.cuh").read_text().count("fo_fma(")


def fma_counts(ptx):
    """(fused multiply-adds written as fo_fma: inside inline-asm blocks, ones outside them)."""
    inside = written = stray = 0
    for line in ptx.splitlines():
        s = line.strip()
        if s == "// begin inline asm":
            inside = 1
        elif s == "// end inline asm":
            inside = 0
        elif s.startswith("fma.rn.f32"):
            written += inside
            stray += 1 - inside
    return written, stray


def compile_ptx(nvrtc, arch):
    """The kernels' PTX for `arch` (compute_XY) as text."""
    return compile_program(nvrtc, arch, "PTX").decode()


def compile_cubin(nvrtc, arch):
    """The kernels' machine code for `arch` (sm_XY): an ELF, as fo's launch code loads first."""
    return compile_program(nvrtc, arch, "CUBIN")


def compile_program(nvrtc, arch, what):
    headers = sorted(KERNELS.glob("*.cuh"))
    # The program includes every header, so each one is compiled (and warned about) alone too.
    src = "".join(f'#include "{h.name}"\n' for h in headers).encode()
    prog = ctypes.c_void_p()
    check(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, b"fo_kernels.cu", 0, None, None), "create")
    opts = [f"--gpu-architecture={arch}", "--fmad=false", "-std=c++17", f"--include-path={KERNELS}",
            "--restrict"]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace").strip()
    if rc != 0 or text:
        sys.exit(f"NVRTC {arch} (rc {rc}) {' '.join(opts)}:\n{text}")
    getattr(nvrtc, f"nvrtcGet{what}Size")(prog, ctypes.byref(size))
    out = ctypes.create_string_buffer(size.value)
    check(nvrtc, getattr(nvrtc, f"nvrtcGet{what}")(prog, out), f"get {what}")
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return out.value if what == "PTX" else out.raw


def check(nvrtc, rc, what):
    if rc != 0:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        sys.exit(f"NVRTC {what} failed: {nvrtc.nvrtcGetErrorString(rc).decode()}")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    nvrtc = ctypes.CDLL(sys.argv[1])
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    out = pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else None
    for arch in ARCHS:
        t = time.perf_counter()
        ptx = compile_ptx(nvrtc, arch)
        dt = time.perf_counter() - t
        for entry in STEP_ENTRIES + NORM_ENTRIES:
            if f".entry {entry}" not in ptx:
                sys.exit(f"NVRTC {arch}: the PTX has no entry {entry}")
        # --fmad=false holds for f64 too: the norm's sums must not be contracted.
        if "fma.rn.f64" in ptx:
            sys.exit(f"NVRTC {arch}: fma.rn.f64 in the PTX")
        # --fmad=false: the only fused multiply-adds are the ones written as fo_fma (the
        # torch contract's add(alpha=) and lerp), inline PTX (fo_shim.cuh): none outside an
        # inline-asm block, and at least the generic path's copy of each written one.
        written, stray = fma_counts(ptx)
        if stray or written < WRITTEN_FMAS:
            sys.exit(f"NVRTC {arch}: {stray} fma.rn.f32 the compiler contracted, {written} written ones "
                     f"(at least {WRITTEN_FMAS} expected)")
        if out:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"fo_kernels_{arch}.ptx").write_text(ptx)
        print(f"NVRTC {major.value}.{minor.value} {arch}: {len(ptx)} bytes of PTX, entries {ENTRY} + {STEP_PATHS - 1} paths + {len(NORM_ENTRIES)} norm, "
              f"no warnings, {written} fma (all written as fo_fma), {dt:.2f} s")


if __name__ == "__main__":
    main()
