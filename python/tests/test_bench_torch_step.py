"""scripts/bench_torch_step.py: its parameters in either layout hold the same values, and a
short run prints a row per optimizer (the numbers themselves are the benchmark's, not a test's)."""
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_torch_step  # noqa: E402

SCRIPT = Path(bench_torch_step.__file__)


def test_the_transposed_layout_holds_the_same_values_non_contiguous():
    a, b = bench_torch_step.make_params(), bench_torch_step.make_params(layout="transposed")
    assert [tuple(p.shape) for p in a] == [tuple(p.shape) for p in b]
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb) and torch.equal(pa.grad, pb.grad)
        assert pb.grad.stride() == pb.stride()
    assert [p.is_contiguous() for p in b] == [len(s) == 1 for s in bench_torch_step.SHAPES]


def test_a_short_run_prints_each_optimizer_in_the_transposed_layout(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--threads", "1", "--rounds", "1", "--steps", "1", "--layout", "transposed",
         "--only", "torch AdamW fused,fo.torch AdamW fp32"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    assert "12.6M fp32 params (transposed)" in out
    for name in ("torch AdamW fused", "fo.torch AdamW fp32"):
        assert any(line.strip().startswith(name) and "speed vs torch AdamW fused" in line for line in out.splitlines())
