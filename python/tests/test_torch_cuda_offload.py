"""fo.torch's `offload=` on a GPU: CUDA parameters whose master weights and state fo keeps and
steps on the host, the CUDA parameter written back as fo's mirror. Their trajectories are the
host optimizer's bits in either arithmetic (the CUDA parameter equal to fo's host copy after
every step), a fraction splits one optimizer between host and GPU steps, state and checkpoints
move between placements, an in-place edit of an offloaded parameter is taken up, and a side
stream and overlap=True (gradients handed over in backward too) give the same bits. Runs where torch sees a GPU and libfo was built
with the `cuda` feature (test_torch_cuda's skips); test_torch_offload_host.py checks the
placement rules anywhere."""
import copy

import pytest

torch = pytest.importorskip("torch")
import fo.torch  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
from test_torch_cuda import (CUDA, FORMATS, RULES, assert_same_bits, assert_same_state, backward_loop,  # noqa: E402
                             give_grads, params, run)


def host_copies(opt, ps):
    """fo's host copies of offloaded parameters (what fo steps; the CUDA ones mirror them)."""
    return [opt._keep[p][3] for p in ps]


@pytest.mark.parametrize("arithmetic", ["exact", "fast"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_offloaded_parameters_step_with_the_host_bits_and_mirror_them(rule, fmt, arithmetic):
    dtype, kw = FORMATS[fmt]
    host, dev = params("cpu", dtype), params(CUDA, dtype)
    h = RULES[rule](host, arithmetic=arithmetic, **kw)
    d = RULES[rule](dev, arithmetic=arithmetic, offload=1.0, **kw)
    run(h, host, 5)
    run(d, dev, 5)
    assert_same_bits(host, dev)
    assert_same_bits(host, host_copies(d, dev))
    assert_same_state(h, d)
    for p in dev:
        assert d.state[p]["exp_avg" if rule != "sgd" else "momentum_buffer"].device == p.device
    mem = d.state_memory()
    assert mem["host_bytes"] > 0 and mem["device_bytes"] == 0, mem


def test_offloaded_groups_default_to_fast_and_a_fraction_splits_the_step():
    dev = params(CUDA, torch.bfloat16)
    whole = fo.torch.AdamW(dev, lr=1e-2, offload=1.0)
    assert whole.param_groups[0]["arithmetic"] == "fast"
    host, split_ps = params("cpu", torch.bfloat16), params(CUDA, torch.bfloat16)
    ref = fo.torch.AdamW(host, lr=1e-2)
    # 0.25 of SHAPES' 1483 elements: the first parameter's 384 alone (0.5 would take all five:
    # the last, 1000 elements, starts with 483 < 741.5 offloaded before it)
    split = fo.torch.AdamW(split_ps, lr=1e-2, offload=0.25)
    assert split.param_groups[0]["arithmetic"] == "fast"  # on the GPU too, with the host's bits
    placed = [split._is_offloaded(p) for p in split_ps]
    assert any(placed) and not all(placed), placed
    run(ref, host, 4)
    run(split, split_ps, 4)
    assert_same_bits(host, split_ps)
    mem = split.state_memory()
    assert mem["host_bytes"] > 0 and mem["device_bytes"] > 0, mem


@pytest.mark.parametrize("placement", [(1.0, None), (None, 1.0), (1.0, 0.25)])  # 0.25: a split
def test_a_checkpoint_moves_between_placements(tmp_path, placement):
    before, after = placement
    a_ps = params(CUDA, torch.bfloat16)
    a = fo.torch.AdamW(a_ps, lr=1e-2, state_format="quant8", master_weight_bits=24, arithmetic="exact",
                       offload=before)
    run(a, a_ps, 3)
    a.save_checkpoint(tmp_path / "ckpt")
    b_ps = [torch.nn.Parameter(p.detach().clone()) for p in a_ps]
    b = fo.torch.AdamW(b_ps, lr=1e-2, state_format="quant8", master_weight_bits=24, arithmetic="exact",
                       offload=after)
    b.load_checkpoint(tmp_path / "ckpt")
    run(a, a_ps, 3, start=3)
    run(b, b_ps, 3, start=3)
    assert_same_bits(a_ps, b_ps)
    assert_same_state(a, b)


@pytest.mark.parametrize("placement", [(1.0, None), (None, 1.0)])
def test_torch_layout_state_moves_between_placements(placement):
    before, after = placement
    a_ps = params(CUDA)
    a = fo.torch.AdamW(a_ps, lr=1e-2, state_format="fp32", offload=before)
    run(a, a_ps, 3)
    b_ps = [torch.nn.Parameter(p.detach().clone()) for p in a_ps]
    b = fo.torch.AdamW(b_ps, lr=1e-2, state_format="fp32", offload=after)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    run(a, a_ps, 3, start=3)
    run(b, b_ps, 3, start=3)
    assert_same_bits(a_ps, b_ps)
    assert_same_state(a, b)


def test_an_in_place_edit_of_an_offloaded_parameter_is_taken_up():
    # f32 parameters, quant8 state: no error bits, so the host run's edit means the same
    host, dev = params("cpu"), params(CUDA)
    h = fo.torch.AdamW(host, lr=1e-2, arithmetic="exact")
    d = fo.torch.AdamW(dev, lr=1e-2, arithmetic="exact", offload=1.0)
    run(h, host, 2)
    run(d, dev, 2)
    with torch.no_grad():
        for ps in (host, dev):
            ps[0].mul_(0.5)  # e.g. a model's load_state_dict: an in-place write
            ps[1].copy_(torch.ones_like(ps[1]))
    run(h, host, 2, start=2)
    run(d, dev, 2, start=2)
    assert_same_bits(host, dev)
    assert_same_bits(host, host_copies(d, dev))


@pytest.mark.parametrize("overlap", [False, "always"])
def test_a_side_stream_and_overlap_give_the_same_bits(overlap):
    host, dev = params("cpu", torch.bfloat16), params(CUDA, torch.bfloat16)
    h = fo.torch.AdamW(host, lr=1e-2, arithmetic="exact")
    d = fo.torch.AdamW(dev, lr=1e-2, arithmetic="exact", offload=1.0, overlap=overlap)
    run(h, host, 3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the parameters were made on the default stream
    with torch.cuda.stream(side):
        for step in range(3):
            give_grads(dev, step)  # copied to the GPU on the side stream
            d.step()
        # work queued after the step on the same stream sees the mirrors written back, with no
        # synchronize in between
        mirrored = [p.detach().clone() for p in dev]
    side.synchronize()
    assert_same_bits(host, mirrored)


@pytest.mark.parametrize("offload", [1.0, 0.5])
def test_backward_hands_offloaded_and_device_gradients_over_with_the_bits_of_overlap_false(offload):
    """overlap="always" with a real backward: an offloaded parameter's gradient comes down on
    fo's down lane and steps on its pool, a GPU-stepped one on fo's step lane, both during
    backward; parameters (the CUDA ones, written back as mirrors) and state have
    overlap=False's bits."""
    def loop(overlap):
        return backward_loop(overlap, steps=4, offload=offload, max_grad_norm=1.0)

    ref_model, ref, _ = loop(False)
    model, opt, stats = loop("always")
    assert_same_bits(list(ref_model.parameters()), list(model.parameters()))
    assert_same_state(ref, opt)
    assert all(s["handed_over_in_backward"] == 4 for s in stats), stats


def test_copies_of_an_offloading_optimizer_step_on_their_own_parameters():
    dev = params(CUDA, torch.bfloat16)
    opt = fo.torch.AdamW(dev, lr=1e-2, arithmetic="exact", offload=0.25)  # a split
    run(opt, dev, 2)
    twin = copy.deepcopy(opt)
    twin_ps = [p for g in twin.param_groups for p in g["params"]]
    assert [twin._is_offloaded(p) for p in twin_ps] == [opt._is_offloaded(p) for p in dev]
    run(opt, dev, 2, start=2)
    run(twin, twin_ps, 2, start=2)
    assert_same_bits(dev, twin_ps)


def test_an_in_place_edit_of_an_offloaded_dtensor_is_taken_up():
    """A DTensor's in-place op bumps the DTensor's version counter, not its local tensor's
    (found 2026-11-27 on the host: fo compared the local tensor's, so an edit of an FSDP2
    parameter offloaded with `offload=`, a model load_state_dict, was overwritten by fo's host
    copy at the next step)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    try:
        mesh = init_device_mesh("cuda", (1,))
        host = params("cpu")
        dev = [DTensor.from_local(p.detach().to(CUDA), mesh, [Shard(0)], run_check=False).requires_grad_()
               for p in host]
        h = fo.torch.AdamW(host, lr=1e-2, arithmetic="exact")
        d = fo.torch.AdamW(dev, lr=1e-2, arithmetic="exact", offload=1.0)
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            for a, b in zip(host, dev):
                a.grad = torch.randn(a.shape, generator=g)
                b.grad = DTensor.from_local(a.grad.to(CUDA), mesh, [Shard(0)], run_check=False)
            h.step()
            d.step()
            if step == 1:
                with torch.no_grad():
                    host[0].mul_(0.5)
                    dev[0].mul_(0.5)  # bumps dev[0]._version only
        torch.cuda.synchronize()
        assert_same_bits(host, [p.to_local() for p in dev])
    finally:
        dist.destroy_process_group()
