"""The overlap benchmarks run on the host at a small size and print a row per mode
(overlap=False, "always", True), what overlap=True decided, and the summary lines
(scripts/gpu_kit.sh shows bench_fsdp2_overlap.py's last line, cut at 110 characters). No
timing is asserted: this machine is shared."""
import re

import pytest

pytest.importorskip("torch")
from conftest import ROOT, run_script  # noqa: E402

MODES = ("False", "'always'", "True")


def test_bench_torch_overlap_prints_three_modes_and_the_decision():
    r = run_script(ROOT / "scripts" / "bench_torch_overlap.py", "--layers", "3", "--width", "64", "--rounds", "2",
                   "--steps", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for mode, line in zip(MODES, lines):
        assert re.match(r"overlap=" + re.escape(mode) + r"\s*: iteration [\d.]+ ms \[", line), line
    assert re.match(r"overlap=True (decided after \d+ iterations: (kept|dropped) \(overlapped [\d.]+ ms vs|"
                    r"still in its)", lines[3]), lines[3]
    assert re.match(r"overlapped / sequential: [\d.]+x; overlap=True / sequential: [\d.]+x \(\w", lines[4]), lines[4]
    assert lines[5].startswith("last overlapped step: {'handed_over': 3")
    assert re.match(r"undo high-water: [\d.]+ MiB \(overlap='always', last step\)$", lines[6]), lines[6]


def test_bench_fsdp2_overlap_runs_on_gloo_and_keeps_its_last_line():
    r = run_script(ROOT / "scripts" / "bench_fsdp2_overlap.py", "--device", "cpu", "--layers", "2", "--width", "64",
                   "--batch", "8", "--rounds", "1", "--steps", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    for mode in MODES:
        assert any(re.match(r"\s+overlap=" + re.escape(mode) + r"\s*: +[\d.]+ ms per iteration", ln) for ln in lines)
    assert any(ln.strip().startswith("overlap=True ") and "iterations" in ln for ln in lines), lines
    # Where each mode's iteration goes, and how many gradients the hooks handed over: the
    # figures that tell a GPU run's loss apart (late copies, or the undo records' cost).
    parts = {m: [ln for ln in lines if re.match(r"\s+overlap=" + re.escape(m) + r"\s*: forward \+ backward", ln)]
             for m in MODES}
    for mode, found in parts.items():
        assert len(found) == 1, (mode, lines)
        assert re.search(r": forward \+ backward [\d.]+ ms, step\(\) [\d.]+ ms \(medians\); of 4 parameters, "
                         r"\d+ handed over in backward, \d+ stepped early \(medians\)$", found[0]), found[0]
    assert parts["False"][0].endswith("0 handed over in backward, 0 stepped early (medians)"), parts
    assert parts["'always'"][0].endswith("4 handed over in backward, 4 stepped early (medians)"), parts
    last = lines[-1]
    assert re.match(r"\s+overlapped / sequential: [\d.]+x; undo high-water [\d.]+ MiB \([\d.]+ B/param\); "
                    r"overlap=True [\d.]+x \((kept|dropped|warm-up|probing|stopped)\)$", last), last
    assert len(last) <= 110, last
