"""fo.torch's `offload=` where no GPU is needed (python/tests/test_torch_cuda_offload.py runs
the offloaded step on one): the argument's checks, which parameters a fraction or a predicate
places on the host (the fraction over the constructor's groups together, a group added later
by itself, host parameters never), the arithmetic a group defaults to, the placement kept by
copies, and the refusal, naming the parameter, by a libfo that cannot take a device mirror."""
import copy
import pickle
import types

import pytest

torch = pytest.importorskip("torch")
import fo  # noqa: E402
import fo._torch_cuda as tcuda  # noqa: E402
import fo._torch_offload as toff  # noqa: E402
import fo.torch  # noqa: E402


def stand_in(device, numel):
    """What `place` reads of a parameter: its device and element count."""
    return types.SimpleNamespace(device=torch.device(device), numel=lambda: numel)


def placed(offload, *params):
    return toff.place(offload, [(f"p{i}", p) for i, p in enumerate(params)])


def test_the_argument_is_a_fraction_in_0_1_a_predicate_or_none():
    assert toff.check_offload(None) is None
    assert toff.check_offload(1) == 1.0 and toff.check_offload(0.25) == 0.25
    pred = lambda name, p: True  # noqa: E731
    assert toff.check_offload(pred) is pred
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="offload fraction .* is not in \\[0, 1\\]"):
            toff.check_offload(bad)
    for bad in (True, "0.5", [0.5]):
        with pytest.raises(TypeError, match="offload must be a fraction in \\[0, 1\\], a predicate"):
            toff.check_offload(bad)
    with pytest.raises(ValueError, match="offload fraction 2"):
        fo.torch.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, offload=2)


def test_a_fraction_offloads_cuda_parameters_in_order_until_it_is_reached():
    a, host, b, c = stand_in("cuda:0", 10), stand_in("cpu", 5), stand_in("cuda:0", 10), stand_in("cuda:1", 20)
    # 40 CUDA elements: 0.5 -> 20; a (0 before it) and b (10 before it) go, c (20 before) stays
    assert placed(0.5, a, host, b, c) == [True, False, True, False]
    assert placed(1.0, a, host, b, c) == [True, False, True, True]
    assert placed(0.0, a, host, b, c) == [False] * 4
    assert placed(None, a, host, b, c) == [False] * 4
    # at least the fraction: one element's worth takes the first whole parameter
    assert placed(0.01, a, host, b, c) == [True, False, False, False]
    assert placed(0.6, c, a, b) == [True, True, False]  # 24 of 40: c (20), then a (20 < 24)
    assert placed(0.5, host) == [False]
    # the GPU tests' shapes (test_torch_cuda.SHAPES, 1483 elements): 0.5 takes all five, since
    # the last (1000) starts with 483 < 741.5 before it; 0.25 takes the first alone (a split)
    gpu_test = [stand_in("cuda:0", n) for n in (384, 24, 72, 3, 1000)]
    assert placed(0.5, *gpu_test) == [True] * 5
    assert placed(0.25, *gpu_test) == [True, False, False, False, False]


def test_a_predicate_sees_the_names_and_places_cuda_parameters_only():
    a, host, b = stand_in("cuda:0", 4), stand_in("cpu", 4), stand_in("cuda:0", 4)
    seen = []

    def pred(name, p):
        seen.append(name)
        return name != "p2"

    assert placed(pred, a, host, b) == [True, False, False]
    assert "p0" in seen and "p2" in seen


def fake_cuda(monkeypatch, cuda):
    """Host parameters in `cuda` stand in for CUDA ones where fo.torch asks (placement,
    overlap hooks)."""
    monkeypatch.setattr(tcuda, "is_cuda", lambda p: any(p is q for q in cuda))


def test_the_constructors_groups_are_placed_together_and_a_later_group_by_itself(monkeypatch):
    w = [torch.nn.Parameter(torch.zeros(n)) for n in (30, 10, 20, 40, 8)]
    fake_cuda(monkeypatch, w)
    opt = fo.torch.AdamW([{"params": w[:2]}, {"params": w[2:3], "lr": 0.1}], lr=1e-3, offload=0.5)
    # 60 elements in the constructor's groups: w0 (0 before it) goes, w1 (30 before) stays
    assert [opt._is_offloaded(p) for p in w[:3]] == [True, False, False]
    # every group defaults to fast, stepped on the host or on its GPU
    assert [g["arithmetic"] for g in opt.param_groups] == ["fast", "fast"]
    opt.add_param_group({"params": w[3:]})  # 48 elements by itself: w3 (40) goes, w4 stays
    assert [opt._is_offloaded(p) for p in w[3:]] == [True, False]
    assert opt.param_groups[2]["arithmetic"] == "fast"
    all_off = fo.torch.AdamW([{"params": w[:1]}, {"params": w[1:2]}], lr=1e-3, offload=1.0)
    assert [g["arithmetic"] for g in all_off.param_groups] == ["fast", "fast"]
    named = fo.torch.SGD([("enc.w", w[0]), ("dec.w", w[1])], lr=0.1, offload=lambda n, p: n.startswith("dec"))
    assert [named._is_offloaded(p) for p in w[:2]] == [False, True]
    assert "offload" not in opt.defaults and all("offload" not in g for g in opt.param_groups)


def test_copies_keep_each_parameters_placement(monkeypatch):
    w = [torch.nn.Parameter(torch.zeros(n)) for n in (30, 10)]
    fake_cuda(monkeypatch, w)
    opt = fo.torch.AdamW(w, lr=1e-3, offload=0.5)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    for c in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        ps = [p for g in c.param_groups for p in g["params"]]
        assert [c._is_offloaded(p) for p in ps] == [True, False, False]
        assert c._offload_arg == 0.5


def test_host_parameters_step_as_without_offload():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(40)) for _ in range(2)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    oa, ob = fo.torch.AdamW(a, lr=1e-2, offload=1.0), fo.torch.AdamW(b, lr=1e-2)
    for step in range(3):
        for x, y in zip(a, b):
            x.grad = torch.full_like(x, 0.1 * (step + 1))
            y.grad = x.grad.clone()
        oa.step()
        ob.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert oa.state_memory() == ob.state_memory()


def test_a_libfo_that_cannot_take_a_mirror_refuses_the_offloaded_parameter_by_name(monkeypatch):
    if tcuda.device_support() is None:
        pytest.skip("this libfo takes device mirrors: the refusal under test is a host-only build's")
    w = torch.nn.Parameter(torch.ones(6))
    fake_cuda(monkeypatch, [w])
    opt = fo.torch.AdamW([("lm_head.weight", w)], lr=1e-3, offload=1.0)
    w.grad = torch.ones(6)
    with pytest.raises(fo.FoError) as e:
        opt.step()
    assert e.value.name == "FO_ERR_UNSUPPORTED"
    assert e.value.message.startswith("parameter lm_head.weight is offloaded from cpu, which needs a libfo that "
                                      "steps CUDA tensors: "), e.value.message
    assert tcuda.device_support().message in e.value.message
    assert torch.equal(w, torch.ones(6)) and not opt._index  # nothing registered, nothing stepped
