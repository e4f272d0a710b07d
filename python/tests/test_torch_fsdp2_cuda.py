"""fo.torch's overlapped step (overlap="always") under FSDP2 + CPUOffloadPolicy on a GPU (NCCL at world 1): the
overlapped runs have the bits of overlap=False (issue 33, case 1: the offloaded gradients'
non-blocking copies must land before fo reads them); and with the shards on the GPU, each
stepped early on fo's step lane after its reduce-scatter (issue 35). Runs where torch sees a GPU
and NCCL."""
import json

import pytest

torch = pytest.importorskip("torch")
from conftest import ROOT, torchrun  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
    pytest.skip("needs torch.distributed with NCCL", allow_module_level=True)

WORKER = ROOT / "python" / "tests" / "torch_fsdp2_cuda_overlap_worker.py"


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2_cuda") / "r.json"
    torchrun(1, WORKER, out)
    r = json.loads(out.read_text())
    print(f"FSDP2 + CPUOffloadPolicy on {r['gpu']}, torch {r['torch']}: {r}")
    return r


@pytest.mark.parametrize("state_format", ["quant8", "fp32"])
def test_overlap_on_a_gpu_with_offloaded_gradients_has_the_bits_of_overlap_false(result, state_format):
    r = result[state_format]
    assert r["same_bits"] == [True, True] and r["same_losses"] == [True, True], r
    assert all(n > 0 for n in r["handed_over_in_backward"][1:]), r  # it did overlap
    assert not any(r["redone"]), r


@pytest.mark.parametrize("state_format", ["quant8", "fp32"])
def test_overlap_with_shards_on_the_gpu_steps_early_with_the_bits_of_overlap_false(result, state_format):
    r = result[f"on_gpu_{state_format}"]
    assert r["same_bits"] and r["same_losses"], r
    assert all(n > 0 for n in r["handed_over_in_backward"]), r  # the hooks handed over
    assert all(n > 0 for n in r["speculative"]), r  # and fo stepped on the GPU in backward
    assert not any(r["redone"]), r
