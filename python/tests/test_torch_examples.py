"""examples/python/fsdp2_offload.py as the README runs it: train on 4 ranks and dcp.save,
resume on 2 ranks with dcp.load; the loss keeps falling across the resume."""
import re

import pytest

torch = pytest.importorskip("torch")
from conftest import ROOT, torchrun  # noqa: E402

if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

EXAMPLE = ROOT / "examples" / "python" / "fsdp2_offload.py"


def losses(out):
    return {int(s): float(v) for s, v in re.findall(r"step +(\d+) +loss ([0-9.]+)", out)}


def test_fsdp2_offload_trains_on_4_ranks_and_resumes_on_2(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = torchrun(4, EXAMPLE, "--ckpt", ckpt, "--steps", "40")
    assert "4 ranks" in first and f"saved to {ckpt}" in first
    second = torchrun(2, EXAMPLE, "--ckpt", ckpt, "--steps", "40", "--resume")
    assert f"resumed at step 40 on 2 ranks from {ckpt}" in second
    a, b = losses(first), losses(second)
    assert sorted(a) == [10, 20, 30, 40] and sorted(b) == [50, 60, 70, 80]
    curve = [a[s] for s in sorted(a)] + [b[s] for s in sorted(b)]
    assert all(x > y for x, y in zip(curve, curve[1:])), curve  # falls through the resume
    assert a[10] < 3.6 and b[80] < 0.1 * a[10]  # below a uniform guess (ln 37), then learned


def test_torch_distributed_example_matches_distribute_tensor_on_4_ranks():
    out = torchrun(4, ROOT / "examples" / "python" / "torch_distributed.py")
    assert sorted(re.findall(r"rank (\d): OK", out)) == ["0", "1", "2", "3"], out
