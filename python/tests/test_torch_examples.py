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


def test_fsdp2_example_on_gpus_resumes_on_the_host_and_back(tmp_path):
    """One rank per GPU (NCCL, shards stepped on the GPUs by fo) and gloo ranks with the shards
    offloaded to the host read each other's checkpoints: the run goes on learning across both
    moves. Runs where torch sees a GPU and libfo steps CUDA tensors."""
    import fo._torch_cuda

    if torch.cuda.device_count() < 1:
        pytest.skip("needs a CUDA GPU (torch.cuda.device_count() is 0)")
    why = fo._torch_cuda.device_support()
    if why is not None:
        pytest.skip(f"the loaded libfo cannot step CUDA tensors: {why.message}")
    world = min(2, torch.cuda.device_count())
    to_host, to_gpu = str(tmp_path / "from_gpu"), str(tmp_path / "from_host")
    gpu = torchrun(world, EXAMPLE, "--ckpt", to_host, "--steps", "20", "--device", "cuda")
    assert "on cuda:0" in gpu and f"saved to {to_host}" in gpu
    host = torchrun(2, EXAMPLE, "--ckpt", to_host, "--steps", "20", "--resume", "--device", "cpu")
    assert f"resumed at step 20 on 2 ranks from {to_host}" in host and "on the host" in host
    on_host = torchrun(2, EXAMPLE, "--ckpt", to_gpu, "--steps", "20", "--device", "cpu")
    back = torchrun(world, EXAMPLE, "--ckpt", to_gpu, "--steps", "20", "--resume", "--device", "cuda")
    assert f"resumed at step 20 on {world} ranks from {to_gpu}" in back and "on cuda:0" in back
    a, b, h, c = losses(gpu), losses(host), losses(on_host), losses(back)
    assert sorted(a) == sorted(h) == [10, 20] and sorted(b) == sorted(c) == [30, 40]
    assert a[10] > a[20] > b[30] > b[40] and h[10] > h[20] > c[30] > c[40], (a, b, h, c)
