#!/usr/bin/env python3
"""The machine code of fo's GPU kernels, read without a GPU: NVRTC compiles them to a CUBIN
for one architecture (as fo's launch code does), and cuobjdump (with nvdisasm) reads its
SASS and resource use. Prints one line per kernel entry: instructions (static: every path
of the entry, its vector and element-by-element code together), the correctly rounded
divisions' range checks (FCHK, one per division site), special-function ops (MUFU:
reciprocals, square roots), calls (the divisions' and square roots' slow paths), registers
and stack bytes. A static count, not a timing: it shows what a kernel change adds or takes
away where no GPU is at hand (docs/gpu.md quotes it).

usage: kernel_sass.py LIBNVRTC_SO [--arch sm_90] [--tools DIR]

cuobjdump and nvdisasm are taken from the PATH, else from --tools (default
~/.cache/fo/cuda-tools-13.5.37/nvidia/cu13/bin, where scripts/test.sh installs PyPI's
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm 13.5.37). Without them it says so and exits 2.
"""
import argparse
import ctypes
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from nvrtc_check import NORM_ENTRIES, STEP_ENTRIES, compile_cubin  # noqa: E402

TOOLS = pathlib.Path.home() / ".cache" / "fo" / "cuda-tools-13.5.37" / "nvidia" / "cu13" / "bin"
COUNTED = ("FCHK", "MUFU", "CALL")
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def by_entry(text, header):
    """(entry, line) for each line after a line matching `header` (its group 1 names it)."""
    name = None
    for line in text.splitlines():
        m = re.search(header, line)
        if m:
            name = m.group(1)
        elif name is not None:
            yield name, line


def parse_sass(text):
    """{entry: {"instructions": n, opcode: n for COUNTED}} from `cuobjdump -sass` output."""
    out = {}
    for name, line in by_entry(text, r"Function : (\S+)"):
        out.setdefault(name, dict({"instructions": 0}, **{op: 0 for op in COUNTED}))
        m = INSTRUCTION.match(line)
        if not m:
            continue
        words = m.group(1).split()
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        op = op.split(".")[0]
        out[name]["instructions"] += 1
        if op in COUNTED:
            out[name][op] += 1
    return out


def parse_resources(text):
    """{entry: {"registers": n, "stack": bytes}} from `cuobjdump -res-usage` output."""
    out = {}
    for name, line in by_entry(text, r"Function (\S+):"):
        m = re.search(r"REG:(\d+) STACK:(\d+)", line)
        if m and name not in out:
            out[name] = {"registers": int(m.group(1)), "stack": int(m.group(2))}
    return out


def tools(where):
    """The directory holding cuobjdump and nvdisasm (None: neither PATH nor `where` has both)."""
    found = [shutil.which(t) for t in ("cuobjdump", "nvdisasm")]
    if all(found):
        return pathlib.Path(found[0]).parent
    if all((where / t).is_file() for t in ("cuobjdump", "nvdisasm")):
        return where
    return None


def table(nvrtc_so, arch, bin_dir):
    """{entry: counts and resources} of every kernel entry, for `arch`."""
    nvrtc = ctypes.CDLL(str(nvrtc_so))
    cubin = compile_cubin(nvrtc, arch)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / f"fo_kernels_{arch}.cubin"
        path.write_bytes(cubin)
        run = lambda flag: subprocess.run([str(bin_dir / "cuobjdump"), flag, str(path)], env=env,
                                          capture_output=True, text=True, check=True).stdout
        sass, res = parse_sass(run("-sass")), parse_resources(run("-res-usage"))
    missing = [e for e in STEP_ENTRIES + NORM_ENTRIES if e not in sass or e not in res]
    if missing:
        sys.exit(f"kernel_sass: the CUBIN's SASS has no entry {missing}")
    return {e: dict(sass[e], **res[e]) for e in STEP_ENTRIES + NORM_ENTRIES}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kernel_sass", description=__doc__.split("\n\n")[0])
    ap.add_argument("nvrtc", help="libnvrtc.so to compile with")
    ap.add_argument("--arch", default="sm_90", help="a real architecture, sm_XY (default sm_90)")
    ap.add_argument("--tools", type=pathlib.Path, default=TOOLS, help=f"cuobjdump and nvdisasm (default {TOOLS})")
    a = ap.parse_args(argv)
    if not re.fullmatch(r"sm_\d+a?", a.arch):
        ap.error(f"--arch: {a.arch!r} is not a real architecture (sm_XY)")
    bin_dir = tools(a.tools)
    if bin_dir is None:
        print(f"kernel_sass: no cuobjdump and nvdisasm on the PATH or in {a.tools} "
              "(pip install --target DIR nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)", file=sys.stderr)
        return 2
    rows = table(a.nvrtc, a.arch, bin_dir)
    print(f"fo's kernels for {a.arch} (static SASS per entry; FCHK: division sites, MUFU: special "
          "functions, CALL: slow paths)")
    print(f"{'entry':24s} {'instructions':>12s} {'FCHK':>5s} {'MUFU':>5s} {'CALL':>5s} {'registers':>9s} {'stack':>5s}")
    for e, r in rows.items():
        print(f"{e:24s} {r['instructions']:12d} {r['FCHK']:5d} {r['MUFU']:5d} {r['CALL']:5d} "
              f"{r['registers']:9d} {r['stack']:5d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
