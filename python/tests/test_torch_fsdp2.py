"""fo.torch under FSDP2 + CPUOffloadPolicy on gloo: two torchrun launches (4 ranks, then 2)
of torch_fsdp2_worker.py, each checking parity with torch.optim.AdamW and quant8's loss;
the 4-rank launch dcp.saves, the 2-rank launch dcp.loads (resharding) and continues."""
import json

import pytest

torch = pytest.importorskip("torch")
from conftest import ROOT, torchrun  # noqa: E402

if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

WORKER = ROOT / "python" / "tests" / "torch_fsdp2_worker.py"
# quant8 state + 24-bit master weights on bf16 params against torch's fp32 AdamW: measured
# at most 0.29% (4 ranks) and 0.26% (2 ranks) relative loss difference over 20 steps.
QUANT8_LOSS_RTOL = 0.01


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp2")
    torchrun(4, WORKER, "save", d / "ckpt", d / "r4.json")
    torchrun(2, WORKER, "load", d / "ckpt", d / "r2.json")
    return {w: json.loads((d / f"r{w}.json").read_text()) for w in (4, 2)}


def test_uneven_dims_leave_ranks_with_short_and_empty_shards(runs):
    shapes = runs[4]["local_shapes"]
    assert shapes[0][0] == [4, 10] and shapes[3][0] == [1, 10]  # fc1.weight: 13 rows
    assert shapes[3][2] == [0, 13]  # fc2.weight: 6 rows, nothing left for rank 3


@pytest.mark.parametrize("world", [4, 2])
def test_fp32_state_follows_torch_adamw_within_rtol_1e5_over_20_steps(runs, world):
    assert runs[world]["fp32_close_ratio"] <= 1.0


@pytest.mark.parametrize("world", [4, 2])
def test_quant8_with_24_bit_master_tracks_torchs_loss(runs, world):
    r = runs[world]
    assert len(r["quant8_losses"]) == 20
    assert r["quant8_losses"] == pytest.approx(r["torch_losses"], rel=QUANT8_LOSS_RTOL)


def test_dcp_save_on_4_ranks_load_on_2_continues_the_loss_curve(runs):
    assert runs[4]["optim_state_is_dtensor"] == "DTensor"
    assert runs[2]["loaded_step"] == 10
    # the 2-rank run after loading follows the 4-rank run that kept going
    assert runs[2]["continued"] == pytest.approx(runs[4]["continued"], rel=1e-5)


OVERLAP_WORKER = ROOT / "python" / "tests" / "torch_fsdp2_overlap_worker.py"


@pytest.mark.parametrize("clip", ["noclip", "clip"])
def test_overlap_under_fsdp2_cpu_offload_has_the_bits_of_the_plain_step(tmp_path_factory, clip):
    """FSDP2 runs the sharded parameters' post-accumulate-grad hooks after reduce-scatter:
    each rank hands its shard's gradient over during backward, clipping through the
    default group, and every rank ends with the plain step's bits."""
    out = overlap_runs(tmp_path_factory)[clip]
    assert out["same_bits_on_every_rank"]
    assert all(s["handed_over_in_backward"] == 6 and s["speculative"] + s["deferred"] == 6 for s in out["stats"])
    if clip == "clip":  # early steps stop once the clip is certain to scale; those taken are redone
        assert all(s["clipped"] and s["rolled_back"] == s["speculative"] >= 1 for s in out["stats"])
    else:
        assert all(s["speculative"] == 6 for s in out["stats"])


_OVERLAP = {}


def overlap_runs(tmp_path_factory):
    if not _OVERLAP:
        d = tmp_path_factory.mktemp("fsdp2_overlap")
        torchrun(2, OVERLAP_WORKER, d / "r.json")
        _OVERLAP.update(json.loads((d / "r.json").read_text()))
    return _OVERLAP


# -- on GPUs: one rank per GPU over NCCL alone, shards stepped there ------------------------------
def cuda_world():
    """Ranks for the GPU runs, one per GPU: 4 where there are 4 (a rank with empty shards),
    else 2 (uneven shards). Skips with the reason where that cannot run."""
    import fo._torch_cuda

    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2 CUDA GPUs, one per rank (torch sees {n})")
    if not torch.distributed.is_nccl_available():
        pytest.skip("needs torch.distributed with NCCL")
    why = fo._torch_cuda.device_support()
    if why is not None:
        pytest.skip(f"the loaded libfo cannot step CUDA tensors: {why.message}")
    return 4 if n >= 4 else 2


@pytest.fixture(scope="module")
def cuda_runs(tmp_path_factory):
    """Trains on the GPUs and dcp.saves, then loads that checkpoint on host ranks of another
    world size (gloo, offloaded shards) and continues."""
    world = cuda_world()
    d = tmp_path_factory.mktemp("fsdp2_gpus")
    torchrun(world, WORKER, "save", d / "ckpt", d / "gpu.json", "cuda")
    torchrun(6 - world, WORKER, "load", d / "ckpt", d / "host.json", "cpu")
    return json.loads((d / "gpu.json").read_text()), json.loads((d / "host.json").read_text())


def test_on_gpus_uneven_shards_follow_torch_and_resume_on_host_ranks(cuda_runs):
    gpu, host = cuda_runs
    world = gpu["world"]
    assert gpu["device"] == "cuda" and host["device"] == "cpu" and host["world"] == 6 - world
    first = -(-13 // world)  # FSDP2 chunks dim 0 like torch.chunk: ceil(13 / world) rows a rank
    shapes = gpu["local_shapes"]
    assert shapes[0][0] == [first, 10] and shapes[-1][0] == [13 - (world - 1) * first, 10]
    if world == 4:
        assert shapes[3][2] == [0, 13]  # fc2.weight: 6 rows, none left for rank 3
    assert gpu["fp32_close_ratio"] <= 1.0  # fo's CUDA kernel against torch's CUDA AdamW
    assert gpu["quant8_losses"] == pytest.approx(gpu["torch_losses"], rel=QUANT8_LOSS_RTOL)
    assert gpu["optim_state_is_dtensor"] == "DTensor" and host["loaded_step"] == 10
    assert host["continued"] == pytest.approx(gpu["continued"], rel=1e-5)


def test_overlap_on_gpus_over_nccl_alone_has_the_bits_of_the_plain_step(tmp_path):
    """The early device steps on uneven CUDA shards, and the clip's norm all-reduced through
    CUDA tensors (a group with NCCL alone takes no host tensors)."""
    world = cuda_world()
    torchrun(world, OVERLAP_WORKER, tmp_path / "r.json", "cuda")
    out = json.loads((tmp_path / "r.json").read_text())
    for clip in ("noclip", "clip"):
        assert out[clip]["same_bits_on_every_rank"], out[clip]
        assert all(s["handed_over_in_backward"] > 0 for s in out[clip]["stats"]), out[clip]
    assert all(s["clipped"] for s in out["clip"]["stats"]), out["clip"]
