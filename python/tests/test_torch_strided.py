"""Non-contiguous parameters (channels_last convolutions, a transposed view): fo steps a
contiguous stand-in and copies it back (fo._torch_strided), so a model in either layout gets
the same bits, state, state_dict and checkpoints, overlap included, and in-place edits of
the parameter are taken up."""
import copy

import pytest

torch = pytest.importorskip("torch")
import fo  # noqa: E402
import fo._torch_cuda  # noqa: E402
import fo.torch  # noqa: E402

CONFIGS = {
    "fp32": dict(state_format="fp32"),
    "quant8-fast": dict(state_format="quant8", arithmetic="fast"),
    "quant8-exact-bf16-24bit": dict(state_format="quant8", arithmetic="exact", master_weight_bits=24),
}


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3)  # weight [8, 3, 3, 3]: 216 elements, 7 quant8 groups
        self.c2 = torch.nn.Conv2d(8, 5, 3)  # [5, 8, 3, 3]: 360
        self.head = torch.nn.Linear(5, 2)

    def forward(self, x):
        x = torch.tanh(self.c2(torch.tanh(self.c1(x))))
        return self.head(x.mean(dim=(2, 3)))


class Params:
    """A list of parameters where a model is expected."""

    def __init__(self, params):
        self.params = list(params)

    def parameters(self):
        return iter(self.params)


def build(channels_last, config, device="cpu", **kw):
    torch.manual_seed(0)
    model = ConvNet().to(device)
    if config == "quant8-exact-bf16-24bit":
        model.to(torch.bfloat16)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    opt = fo.torch.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **CONFIGS[config], **kw)
    return model, opt


def loss(model, it):
    g = torch.Generator().manual_seed(10 + it)
    p = next(model.parameters())
    return model(torch.randn(4, 3, 7, 7, generator=g).to(p.device, p.dtype)).float().pow(2).sum()


def train(model, opt, steps, start=0):
    """The loop itself: backward through `model` (hooks fire, as with overlap=True)."""
    for it in range(start, start + steps):
        opt.zero_grad()
        loss(model, it).backward()
        opt.step()


def train_twins(ref, ref_opt, others, steps, start=0):
    """`ref` (contiguous) and `others` ((model, opt) in other layouts, same values) step with
    the same gradients: ref's, copied into each parameter's own layout. (Convolutions in
    another memory format may round differently: the optimizer is what is compared.)"""
    for it in range(start, start + steps):
        ref_opt.zero_grad()
        loss(ref, it).backward()
        for model, opt in others:
            opt.zero_grad()
            for pr, pm in zip(ref.parameters(), model.parameters()):
                pm.grad = torch.empty_like(pm).copy_(pr.grad)  # pm's strides
        ref_opt.step()
        for _, opt in others:
            opt.step()


def bits(t):
    t = t.detach().cpu().contiguous()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def assert_same(a, b):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(bits(pa), bits(pb)), name


def assert_same_state(oa, ob):
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)


@pytest.mark.parametrize("config", CONFIGS)
def test_channels_last_convolutions_step_as_contiguous_ones(config):
    ref, ref_opt = build(False, config)
    model, opt = build(True, config)
    assert not model.c1.weight.is_contiguous()
    train_twins(ref, ref_opt, [(model, opt)], 4)
    assert not model.c1.weight.grad.is_contiguous()
    assert_same(ref, model)
    assert_same_state(ref_opt, opt)
    # the parameters keep their layout: the loop's channels_last model stays channels_last
    assert model.c1.weight.is_contiguous(memory_format=torch.channels_last)
    assert not model.c1.weight.is_contiguous()


def test_a_transposed_parameter_steps_as_its_contiguous_copy():
    torch.manual_seed(1)
    init = torch.randn(4, 3)
    w = torch.nn.Parameter(init.t())  # a transposed view: strides (1, 3)
    ref = torch.nn.Parameter(init.t().contiguous())
    opt = fo.torch.AdamW([("encoder.weight", w)], lr=1e-2)
    ref_opt = fo.torch.AdamW([("encoder.weight", ref)], lr=1e-2)
    for s in range(3):
        g = torch.randn(3, 4, generator=torch.Generator().manual_seed(s))
        w.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        assert torch.equal(w, ref)
    assert w.stride() == (1, 3)
    # torch's fp32 AdamW on the same loop agrees to rounding
    t = torch.nn.Parameter(init.t().clone())
    topt = torch.optim.AdamW([t], lr=1e-2)
    w2 = torch.nn.Parameter(init.t())
    opt2 = fo.torch.AdamW([w2], lr=1e-2, state_format="fp32")
    for s in range(3):
        g = torch.randn(3, 4, generator=torch.Generator().manual_seed(s))
        t.grad, w2.grad = g.clone(), g.clone()
        topt.step()
        opt2.step()
    torch.testing.assert_close(w2, t, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("config", ["fp32", "quant8-exact-bf16-24bit"])
def test_in_place_edits_of_the_parameter_are_taken_up(config):
    ref, ref_opt = build(False, config)
    model, opt = build(True, config)
    train_twins(ref, ref_opt, [(model, opt)], 2)
    for m in (ref, model):
        with torch.no_grad():
            m.c1.weight.mul_(0.5)  # an edit between steps (an init, a model load_state_dict)
            m.c2.weight.copy_(torch.full_like(m.c2.weight, 0.25))
    train_twins(ref, ref_opt, [(model, opt)], 2, start=2)
    assert_same(ref, model)
    # a model state_dict loaded into the channels_last model is taken up too
    sd = {k: v.clone() + 0.125 for k, v in ref.state_dict().items()}
    ref.load_state_dict(sd)
    model.load_state_dict(sd)
    assert not model.c1.weight.is_contiguous()
    train_twins(ref, ref_opt, [(model, opt)], 1, start=4)
    assert_same(ref, model)


@pytest.mark.parametrize("clip", [None, 1e-3], ids=["no-clip", "clip-rolls-back"])
def test_overlap_hands_stand_ins_over_with_the_plain_bits(clip):
    ref, ref_opt = build(True, "quant8-exact-bf16-24bit", max_grad_norm=clip)
    model, opt = build(True, "quant8-exact-bf16-24bit", overlap="always", max_grad_norm=clip)
    train(ref, ref_opt, 3)
    train(model, opt, 3)
    stats = opt.last_step_stats
    assert stats["handed_over_in_backward"] == 6, stats
    if clip is not None:
        assert stats["clipped"] and stats["rolled_back"] + stats["deferred"] > 0, stats
    assert_same(ref, model)
    assert_same_state(ref_opt, opt)


def test_a_step_left_open_is_put_back_in_the_stand_in_and_the_parameter():
    """overlap: backward steps the stand-ins early (the parameter is written at step()); a
    skipped step() (zero_grad and a new iteration) puts them back."""
    ref, ref_opt = build(True, "fp32")
    model, opt = build(True, "fp32", overlap="always")
    train(ref, ref_opt, 2)
    train(model, opt, 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    loss(model, 7).backward()  # hands every gradient over: fo steps them (stand-ins included)
    strided = [(a, b) for a, b in zip(before, model.parameters()) if not b.is_contiguous()]
    # (the contiguous ones are fo's pool's to write meanwhile: not read here)
    assert len(strided) == 2 and all(torch.equal(a, b) for a, b in strided)
    opt.zero_grad()  # no step(): the early steps are put back
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    train(ref, ref_opt, 2, start=2)
    train(model, opt, 2, start=2)
    assert_same(ref, model)
    assert_same_state(ref_opt, opt)


def test_state_dict_master_and_deepcopy_round_trip():
    ref, ref_opt = build(False, "quant8-exact-bf16-24bit")
    model, opt = build(True, "quant8-exact-bf16-24bit")
    train_twins(ref, ref_opt, [(model, opt)], 2)
    sd = opt.state_dict()
    assert "master" in sd["state"][0]
    # a new optimizer over a channels_last copy of the model loads the state, master
    # included: fo writes the master's rounding into the stand-in, and so into the parameter
    model2 = copy.deepcopy(model)
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)  # overwritten by the master's values
    opt2 = fo.torch.AdamW(model2.parameters(), lr=1e-2, weight_decay=0.1, **CONFIGS["quant8-exact-bf16-24bit"])
    opt2.load_state_dict(sd)
    assert_same(model, model2)
    # a deep copy of the optimizer steps its own (copied, still channels_last) parameters
    dup = copy.deepcopy(opt)
    copied = Params(dup.param_groups[0]["params"])
    assert not copied.params[0].is_contiguous()
    train_twins(ref, ref_opt, [(model, opt), (model2, opt2), (copied, dup)], 2, start=2)
    assert_same(ref, model)
    assert_same(ref, model2)
    assert_same(ref, copied)
    assert_same_state(ref_opt, opt2)


def test_a_dtensor_whose_local_shard_is_not_contiguous_steps_as_a_contiguous_one():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is needed")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        init = torch.randn(3, 40)

        def leaf(t):
            return DTensor.from_local(t, mesh, [Shard(0)], run_check=False).requires_grad_()

        w = leaf(init.t().contiguous().t())  # local shard strides (1, 3)
        ref = leaf(init.clone())
        assert not w.to_local().is_contiguous()
        opt = fo.torch.AdamW([("tp.weight", w)], lr=1e-2)
        ref_opt = fo.torch.AdamW([("tp.weight", ref)], lr=1e-2)
        for s in range(3):
            g = torch.randn(3, 40, generator=torch.Generator().manual_seed(s))
            w.grad = DTensor.from_local(g.clone(), mesh, [Shard(0)], run_check=False)
            ref.grad = DTensor.from_local(g.clone(), mesh, [Shard(0)], run_check=False)
            opt.step()
            ref_opt.step()
            if s == 1:
                with torch.no_grad():  # an in-place edit of the DTensor reaches its local shard
                    w.mul_(0.5)
                    ref.mul_(0.5)
        assert torch.equal(w.to_local(), ref.to_local())
        assert w.to_local().stride() == (1, 3)
        assert opt.state_dict()["state"][0]["exp_avg"].to_local().equal(ref_opt.state_dict()["state"][0]["exp_avg"].to_local())
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU")
@pytest.mark.parametrize("config", ["fp32", "quant8-exact-bf16-24bit"])
def test_channels_last_cuda_parameters_step_as_contiguous_ones(config):
    if fo._torch_cuda.device_support() is not None:
        pytest.skip("this libfo steps host tensors only")
    ref, ref_opt = build(False, config, device="cuda")
    model, opt = build(True, config, device="cuda")
    # ref's gradients in each layout (cuDNN's channels_last convolutions round differently:
    # the H200 gave c1.weight 1358 ulps apart after 3 steps of `train`)
    train_twins(ref, ref_opt, [(model, opt)], 3)
    assert not model.c1.weight.grad.is_contiguous()
    torch.cuda.synchronize()
    assert_same(ref, model)
    assert_same_state(ref_opt, opt)
    assert model.c1.weight.is_contiguous(memory_format=torch.channels_last)


def test_storage_order_and_a_parameter_that_is_not_dense():
    from fo._torch_strided import storage_order

    assert storage_order(torch.empty(8, 16, 5, 5).contiguous(memory_format=torch.channels_last)) == [0, 2, 3, 1]
    assert storage_order(torch.empty(4, 3).t()) == [1, 0]
    assert storage_order(torch.empty(4, 6)[:, ::2]) is None  # every other column: no order makes it dense
    base = torch.randn(4, 6)
    between = base[:, 1::2].clone()
    w = torch.nn.Parameter(base[:, ::2])  # strides (6, 2) into base's storage
    ref = torch.nn.Parameter(base[:, ::2].contiguous())
    opt, ref_opt = fo.torch.AdamW([w], lr=1e-2), fo.torch.AdamW([ref], lr=1e-2)
    for s in range(3):
        g = torch.randn(4, 3, generator=torch.Generator().manual_seed(s))
        w.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    assert w.stride() == (6, 2) and torch.equal(w, ref)
    assert torch.equal(base[:, ::2], ref)  # written through to the storage it shares
    assert torch.equal(base[:, 1::2], between)  # the storage between its elements is untouched
