"""fo.torch against torch.optim's conventions for state and param groups changed between
steps (an audit, 2026-11-28, found each of these silently ignored or crashing): an emptied
`opt.state[p]` and `opt.state = defaultdict(dict)` start the state over, a loaded state dict
without a parameter's state leaves it none, parameters replaced in or moved between groups,
SGD's momentum turned on later, Adam's `decoupled_weight_decay` per group, and torch flags
fo has no step for refused however they reach a group. fp32 state against torch's
for-loop implementation (fo follows it within rtol 1e-5, torch's own fused-vs-foreach
distance)."""
import collections

import pytest

torch = pytest.importorskip("torch")
import fo.torch  # noqa: E402


def twins(n=2, shape=(5,)):
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(shape)) for _ in range(n)]
    return a, [torch.nn.Parameter(p.detach().clone()) for p in a]


def steps(ps, opt, n, seed):
    for i in range(n):
        g = torch.Generator().manual_seed(seed + i)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def close(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-5, atol=1e-7)


def adamw_pair(a, b):
    return fo.torch.AdamW(a, lr=0.1, state_format="fp32"), torch.optim.AdamW(b, lr=0.1, foreach=False)


@pytest.mark.parametrize("how", ["clear", "assign", "del", "pop", "state_clear", "defaultdict"])
def test_an_emptied_state_starts_over_as_torchs_does(how):
    a, b = twins()
    mine, ref = adamw_pair(a, b)
    steps(a, mine, 3, 0)
    steps(b, ref, 3, 0)
    for opt, ps in ((mine, a), (ref, b)):
        {"clear": lambda: opt.state[ps[0]].clear(), "assign": lambda: opt.state.__setitem__(ps[0], {}),
         "del": lambda: opt.state.__delitem__(ps[0]), "pop": lambda: opt.state.pop(ps[0]),
         "state_clear": lambda: opt.state.clear(),
         "defaultdict": lambda: setattr(opt, "state", collections.defaultdict(dict))}[how]()
    assert mine.state[a[0]] == {}  # as torch shows it until the next step
    steps(a, mine, 2, 10)
    steps(b, ref, 2, 10)
    close(a, b)
    assert mine.state[a[0]]["step"].item() == ref.state[b[0]]["step"].item() == 2
    assert isinstance(mine.state, fo._torch_state.State)  # still fo's, after an assignment


def test_a_state_that_loses_some_keys_is_refused_naming_them():
    a, _ = twins()
    opt = fo.torch.AdamW(a, lr=0.1)
    steps(a, opt, 1, 0)
    del opt.state[a[0]]["exp_avg"]
    with pytest.raises(fo.FoError, match=r"lost \['exp_avg'\] but keeps"):
        steps(a, opt, 1, 1)


def test_a_loaded_state_dict_without_a_parameters_state_leaves_it_none():
    a, b = twins()
    mine, ref = adamw_pair(a, b)
    steps(a, mine, 3, 0)
    steps(b, ref, 3, 0)
    for opt in (mine, ref):
        sd = opt.state_dict()
        del sd["state"][1]
        opt.load_state_dict(sd)
    assert sorted(mine.state_dict()["state"]) == sorted(ref.state_dict()["state"]) == [0]
    steps(a, mine, 2, 10)
    steps(b, ref, 2, 10)
    close(a, b)


def test_parameters_replaced_in_or_moved_between_groups_step_as_torchs():
    def run(make):
        torch.manual_seed(0)
        a, b, c = (torch.nn.Parameter(torch.randn(4)) for _ in range(3))
        opt = make([{"params": [a, b]}, {"params": [], "lr": 0.0, "weight_decay": 0.0}])
        steps([a, b], opt, 1, 0)
        opt.param_groups[0]["params"][1] = c  # b replaced (a layer rebuilt)
        opt.param_groups[0]["params"].remove(a)  # a frozen by moving it to the lr=0 group
        opt.param_groups[1]["params"].append(a)
        steps([a, b, c], opt, 2, 5)
        return a, b, c, opt

    *mine, opt = run(lambda g: fo.torch.AdamW(g, lr=0.1, state_format="fp32"))
    *ref, _ = run(lambda g: torch.optim.AdamW(g, lr=0.1, foreach=False))
    close(mine, ref)
    assert opt.state[mine[0]]["step"].item() == 3  # a's state went with it


@pytest.mark.parametrize("fmt", ["fp32", "quant8"])
def test_sgd_momentum_turned_on_after_a_step_starts_its_buffer_as_torch(fmt):
    a, b = twins(1, (12,))
    mine = fo.torch.SGD(a, lr=0.1, state_format=fmt)
    ref = torch.optim.SGD(b, lr=0.1, foreach=False)
    steps(a, mine, 1, 0)
    steps(b, ref, 1, 0)
    mine.param_groups[0]["momentum"] = ref.param_groups[0]["momentum"] = 0.9
    steps(a, mine, 3, 5)
    steps(b, ref, 3, 5)
    if fmt == "fp32":
        close(a, b)
    else:  # the buffer is quantized: the step ran, the buffer started from the gradient
        assert "momentum_buffer" in mine.state[a[0]] and (a[0] - b[0]).abs().max() < 1e-2


def test_adam_takes_decoupled_weight_decay_per_group():
    a, b = twins()
    mine = fo.torch.Adam(a[:1], lr=0.1, weight_decay=0.5, state_format="fp32")
    ref = torch.optim.Adam(b[:1], lr=0.1, weight_decay=0.5, foreach=False)
    mine.add_param_group({"params": a[1:], "decoupled_weight_decay": True})
    ref.add_param_group({"params": b[1:], "decoupled_weight_decay": True})
    steps(a, mine, 3, 0)
    steps(b, ref, 3, 0)
    close(a, b)


@pytest.mark.parametrize("flag", ["maximize", "amsgrad"])
def test_flags_fo_has_no_step_for_are_refused_however_they_reach_a_group(flag):
    a, b = twins(1)
    mine = fo.torch.AdamW(a, lr=0.1)
    steps(a, mine, 1, 0)
    mine.param_groups[0][flag] = True
    with pytest.raises(ValueError, match=f"{flag}=True \\(param group 0\\)"):
        steps(a, mine, 1, 1)
    mine.param_groups[0][flag] = False
    ref = torch.optim.AdamW(b, lr=0.1, **{flag: True})
    steps(b, ref, 1, 0)
    before = mine.state_dict()
    with pytest.raises(ValueError, match=f"{flag}=True \\(param group 0 of the loaded state dict\\)"):
        mine.load_state_dict(ref.state_dict())
    assert mine.param_groups[0][flag] is False  # nothing loaded
    assert torch.equal(mine.state_dict()["state"][0]["exp_avg"], before["state"][0]["exp_avg"])
