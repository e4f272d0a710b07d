"""DTensor parameters in one process: a fake process group plays each rank of a 2x2 mesh in
turn, so every coordinate's local shard (uneven, empty, _StridedShard) is stepped by fo with
its shard spec, checked against torch.optim.AdamW on the same local tensor."""
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is needed", allow_module_level=True)
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import fo  # noqa: E402
import fo.torch  # noqa: E402

CASES = [
    ((11, 3), [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP2 over TP's Shard(0)
    ((5, 7), [Shard(0), Shard(1)]),  # uneven on both dims
    ((3, 4), [Replicate(), Shard(0)]),  # HSDP: 3 rows over 2 ranks
    ((1, 6), [Shard(0), Replicate()]),  # one row: coordinate 1 holds nothing
]


@pytest.fixture(params=range(4), ids=lambda r: f"rank{r}")
def mesh(request):
    dist.init_process_group("fake", rank=request.param, world_size=4, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2, 2))
    finally:
        dist.destroy_process_group()


def leaf(local, mesh, placements, shape):
    """A DTensor leaf to optimize. (Not nn.Parameter: wrapping goes through torch's sharding
    cache, which in one process playing several ranks hands back the first rank's mesh.)"""
    return dtensor(local, mesh, placements, shape).requires_grad_()


def dtensor(local, mesh, placements, shape):
    stride = tuple(torch.empty(shape).stride())
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


@pytest.mark.parametrize("shape,placements", CASES, ids=["strided", "uneven2d", "hsdp", "empty"])
def test_local_shards_step_with_their_shard_spec(mesh, shape, placements):
    local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    torch.manual_seed(sum(mesh.get_coordinate()))
    init, grads = torch.randn(local_shape), [torch.randn(local_shape) for _ in range(3)]
    w = leaf(init.clone(), mesh, placements, shape)
    ref = torch.nn.Parameter(init.clone())
    opt = fo.torch.AdamW([w], lr=1e-2, state_format="fp32")
    ref_opt = torch.optim.AdamW([ref], lr=1e-2)
    for g in grads:
        w.grad = dtensor(g.clone(), mesh, placements, shape)
        ref.grad = g.clone()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(w.to_local(), ref.detach(), rtol=1e-5, atol=1e-7)
    st = opt.state_dict()["state"][0]
    assert isinstance(st["exp_avg"], DTensor) and st["exp_avg"].placements == tuple(placements)
    assert st["exp_avg"].shape == torch.Size(shape)
    torch.testing.assert_close(st["exp_avg_sq"].to_local(), ref_opt.state[ref]["exp_avg_sq"], rtol=1e-5, atol=0)
    assert not isinstance(st["step"], DTensor) and st["step"].item() == 3


def test_a_local_shard_that_is_not_its_placements_is_refused(mesh):
    placements = [Shard(0), Shard(1)]
    right, _ = compute_local_shape_and_global_offset((5, 7), mesh, placements)
    wrong = (right[0] + 1, right[1])
    w = leaf(torch.zeros(wrong), mesh, placements, (5, 7))
    opt = fo.torch.AdamW([("layers.0.w", w)], lr=1e-2)
    w.grad = dtensor(torch.zeros(wrong), mesh, placements, (5, 7))
    with pytest.raises(fo.FoError, match=r"layers\.0\.w: shard spec gives local shape"):
        opt.step()
