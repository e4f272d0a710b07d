"""fo.torch in one process, against torch.optim itself."""
import copy

import pytest

torch = pytest.importorskip("torch")
import fo  # noqa: E402
import fo.torch  # noqa: E402
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, OneCycleLR  # noqa: E402

STEPS = 20


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 7, generator=g), torch.randn(16, 3, generator=g)


def train(model, opt, steps=STEPS, sched=None, start=0):
    losses = []
    for s in range(start, start + steps):
        x, y = batch(s)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def assert_params_close(a, b, rtol=1e-5):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb, pa, rtol=rtol, atol=1e-7, msg=lambda m: f"{name}: {m}")


PARITY = [
    ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
     lambda ps: fo.torch.AdamW(ps, lr=1e-2, weight_decay=0.1, state_format="fp32")),
    ("adam_l2", lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05),
     lambda ps: fo.torch.Adam(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05, state_format="fp32")),
    ("adam_decoupled", lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05, decoupled_weight_decay=True),
     lambda ps: fo.torch.Adam(ps, lr=1e-2, weight_decay=0.05, decoupled_weight_decay=True, state_format="fp32")),
    ("sgd_momentum", lambda ps: torch.optim.SGD(ps, lr=5e-2, momentum=0.9, dampening=0.1, weight_decay=1e-3),
     lambda ps: fo.torch.SGD(ps, lr=5e-2, momentum=0.9, dampening=0.1, weight_decay=1e-3, state_format="fp32")),
    ("sgd_nesterov", lambda ps: torch.optim.SGD(ps, lr=5e-2, momentum=0.9, nesterov=True),
     lambda ps: fo.torch.SGD(ps, lr=5e-2, momentum=0.9, nesterov=True, state_format="fp32")),
    ("sgd_plain", lambda ps: torch.optim.SGD(ps, lr=5e-2),
     lambda ps: fo.torch.SGD(ps, lr=5e-2, state_format="fp32")),
]


@pytest.mark.parametrize("name,make_torch,make_fo", PARITY, ids=[p[0] for p in PARITY])
def test_follows_torch_optim_within_rtol_1e5_over_20_steps(name, make_torch, make_fo):
    a, b = make_model(), make_model()
    ta, tb = make_torch(a.parameters()), make_fo(b.parameters())
    la, lb = train(a, ta), train(b, tb)
    assert_params_close(a, b)
    assert lb == pytest.approx(la, rel=1e-5)
    sa, sb = ta.state_dict(), tb.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        for k in sa["state"][i]:
            torch.testing.assert_close(sb["state"][i][k], sa["state"][i][k], rtol=1e-5, atol=1e-7)


def lion_reference(params, lr, betas, wd, state):
    b1, b2 = betas
    for p in params:
        if p.grad is None:
            continue
        m = state.setdefault(p, torch.zeros_like(p))
        with torch.no_grad():
            p.mul_(1 - lr * wd)
            p.add_(torch.sign(b1 * m + (1 - b1) * p.grad), alpha=-lr)
            m.mul_(b2).add_(p.grad, alpha=1 - b2)


def test_lion_follows_its_definition():
    a, b = make_model(), make_model()
    opt = fo.torch.Lion(b.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, state_format="fp32")
    ref_state = {}
    for s in range(STEPS):
        x, y = batch(s)
        for m in (a, b):
            m.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
        lion_reference(list(a.parameters()), 1e-3, (0.9, 0.99), 0.1, ref_state)
        opt.step()
    assert_params_close(a, b)
    assert set(opt.state_dict()["state"][0]) == {"exp_avg"}


SCHEDULERS = [
    ("lambda", lambda o: LambdaLR(o, lambda s: 1.0 / (1 + s))),
    ("onecycle", lambda o: OneCycleLR(o, max_lr=5e-2, total_steps=STEPS)),  # cycles betas[0] too
    ("cosine", lambda o: CosineAnnealingLR(o, T_max=STEPS // 2, eta_min=1e-4)),
]


@pytest.mark.parametrize("name,make_sched", SCHEDULERS, ids=[s[0] for s in SCHEDULERS])
def test_lr_schedulers_take_effect(name, make_sched):
    a, b = make_model(), make_model()
    ta = torch.optim.AdamW(a.parameters(), lr=1e-2)
    tb = fo.torch.AdamW(b.parameters(), lr=1e-2, state_format="fp32")
    sa, sb = make_sched(ta), make_sched(tb)
    train(a, ta, sched=sa)
    train(b, tb, sched=sb)
    assert tb.param_groups[0]["lr"] == ta.param_groups[0]["lr"] != 1e-2
    assert_params_close(a, b)
    # And without the schedule the result is measurably different: the schedule mattered.
    c = make_model()
    train(c, fo.torch.AdamW(c.parameters(), lr=1e-2, state_format="fp32"))
    assert max((pc - pb).abs().max().item() for pc, pb in zip(c.parameters(), b.parameters())) > 1e-4


def test_never_stepped_state_dict_is_torchs():
    a, b = make_model(), make_model()
    sa = torch.optim.AdamW(a.parameters(), lr=3e-3).state_dict()
    sb = fo.torch.AdamW(b.parameters(), lr=3e-3).state_dict()
    assert sb["state"] == {} and set(sb) == {"state", "param_groups"}
    ga, gb = sa["param_groups"][0], sb["param_groups"][0]
    assert {k: gb[k] for k in ga} == ga  # torch's keys, torch's values
    assert set(gb) - set(ga) == {"state_format", "master_weight_bits", "arithmetic"}


@pytest.mark.parametrize("fmt", ["fp32", "quant8", "quant8_wide"])
def test_state_dict_round_trip_continues_identically(fmt):
    a = make_model()
    oa = fo.torch.AdamW(a.parameters(), lr=1e-2, state_format=fmt)
    train(a, oa, steps=5)
    sd = oa.state_dict()
    assert sd["state"][0]["exp_avg"].dtype == torch.float32  # exported decoded
    b = make_model()
    b.load_state_dict(a.state_dict())
    ob = fo.torch.AdamW(b.parameters(), lr=1e-2, state_format=fmt)
    ob.load_state_dict(sd)
    assert ob.state_dict()["state"][0]["step"].item() == 5
    train(a, oa, steps=5, start=5)
    train(b, ob, steps=5, start=5)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_torch_optim_checkpoint_loads_into_any_format():
    a = make_model()
    ta = torch.optim.AdamW(a.parameters(), lr=1e-2)
    train(a, ta, steps=5)
    b, c = make_model(), make_model()
    b.load_state_dict(a.state_dict())
    c.load_state_dict(a.state_dict())
    fb = fo.torch.AdamW(b.parameters(), lr=1e-2, state_format="fp32")
    fb.load_state_dict(ta.state_dict())
    fc = fo.torch.AdamW(c.parameters(), lr=1e-2, state_format="quant8")
    fc.load_state_dict(ta.state_dict())
    assert fc.param_groups[0]["state_format"] == "quant8"  # the optimizer keeps its own format
    la = train(a, ta, steps=5, start=5)
    train(b, fb, steps=5, start=5)
    lc = train(c, fc, steps=5, start=5)
    assert_params_close(a, b)
    assert lc == pytest.approx(la, rel=1e-2)
    # the other way: fo's export loads into torch.optim
    d = make_model()
    d.load_state_dict(b.state_dict())
    td = torch.optim.AdamW(d.parameters(), lr=1e-2)
    # fp32 state_dict() tensors are fb's live state, as torch's are its optimizer's: torch
    # loads same-dtype tensors without a copy, so a second optimizer that steps beside fb
    # takes a copy (as a saved checkpoint is), exactly as between two torch optimizers
    td.load_state_dict(copy.deepcopy(fb.state_dict()))
    train(d, td, steps=3, start=10)
    train(b, fb, steps=3, start=10)
    assert_params_close(d, b)


def test_param_groups_no_grad_frozen_and_zero_grad():
    torch.manual_seed(0)
    w1, w2, frozen = (torch.nn.Parameter(torch.randn(4, 3)) for _ in range(3))
    frozen.requires_grad_(False)
    unused = torch.nn.Parameter(torch.randn(2))
    opt = fo.torch.AdamW([{"params": [w1, frozen, unused]}], lr=1e-2, state_format="fp32")
    ref = torch.optim.AdamW([{"params": [w1.detach().clone().requires_grad_(), frozen.clone(), unused.detach().clone()]}],
                            lr=1e-2)
    before_frozen, before_unused = frozen.clone(), unused.detach().clone()
    for step in range(3):
        for o, w in ((opt, w1), (ref, ref.param_groups[0]["params"][0])):
            o.zero_grad(set_to_none=step % 2 == 0)
            (w * w).sum().backward()
            o.step()
        if step == 0:
            opt.add_param_group({"params": [w2], "lr": 1e-1, "weight_decay": 0.0})
        w2.grad = torch.ones_like(w2)
    torch.testing.assert_close(w1, ref.param_groups[0]["params"][0], rtol=1e-5, atol=1e-7)
    assert torch.equal(frozen, before_frozen) and torch.equal(unused.detach(), before_unused)
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 3]  # frozen/unused: no state
    # w2 is stepped once: at step 1 zero_grad(set_to_none=False) left it a zero gradient,
    # at step 2 zero_grad() set it to None
    assert sd["state"][3]["step"].item() == 1
    assert sd["param_groups"][1]["lr"] == 1e-1 and sd["param_groups"][1]["params"] == [3]
    assert w1 in opt.state and frozen not in opt.state and len(opt.state) == 2
    opt.zero_grad(set_to_none=False)
    assert torch.count_nonzero(w1.grad) == 0
    opt.zero_grad()
    assert w1.grad is None


def test_storage_moved_is_registered_again_with_its_state():
    a, b = make_model(), make_model()
    ta = torch.optim.AdamW(a.parameters(), lr=1e-2)
    tb = fo.torch.AdamW(b.parameters(), lr=1e-2, state_format="fp32")
    train(a, ta, steps=3)
    train(b, tb, steps=3)
    for p in b.parameters():
        p.data = p.data.clone()  # new storage, same values
    train(a, ta, steps=3, start=3)
    train(b, tb, steps=3, start=3)
    assert_params_close(a, b)


def test_strided_gradients_are_read_in_place():
    a, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(3, 4))
    with torch.no_grad():
        b.copy_(a)
    oa = torch.optim.AdamW([a], lr=1e-2)
    ob = fo.torch.AdamW([b], lr=1e-2, state_format="fp32")
    g = torch.randn(4, 3)
    a.grad, b.grad = g.t().contiguous(), g.t()  # b's gradient: a transposed view
    oa.step()
    ob.step()
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_device_tensors_are_refused_naming_the_parameter():
    w = torch.nn.Parameter(torch.empty(4, 3, device="meta"))
    opt = fo.torch.AdamW([("decoder.proj.weight", w)], lr=1e-3)
    w.grad = torch.empty_like(w)
    with pytest.raises(fo.FoError, match="parameter decoder.proj.weight is on meta") as e:
        opt.step()
    assert e.value.name == "FO_ERR_UNSUPPORTED"


def test_unsupported_options_are_refused():
    ps = list(make_model().parameters())
    with pytest.raises(ValueError, match="amsgrad"):
        fo.torch.AdamW(ps, amsgrad=True)
    with pytest.raises(ValueError, match="maximize"):
        fo.torch.SGD(ps, maximize=True)
    with pytest.raises(fo.FoError, match="capturable"):  # fused/foreach are accepted (fo's step is fused)
        fo.torch.AdamW(ps, capturable=True)
    with pytest.raises(ValueError, match=r"state_format 'fp8' is not one of \['fp32', 'param_dtype', "):
        fo.torch.AdamW(ps, state_format="fp8")
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):  # at construction, as torch
        fo.torch.AdamW(ps, lr=-1.0)


def test_bf16_params_with_24_bit_master_weights_export_the_master():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 32).bfloat16())
    opt = fo.torch.AdamW([w], lr=1e-3, state_format="quant8", master_weight_bits=24)
    for _ in range(3):
        w.grad = torch.randn(8, 32).bfloat16()
        opt.step()
    st = opt.state_dict()["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq", "master"}
    assert st["master"].dtype == torch.float32
    # the master is the bf16 parameter plus bits below its precision
    torch.testing.assert_close(st["master"], w.detach().float(), rtol=2**-7, atol=0)
    assert not torch.equal(st["master"], w.detach().float())


def test_arithmetic_reaches_fo():
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = fo.torch.AdamW([w], lr=1e-3, arithmetic="fast")
    w.grad = torch.ones_like(w)
    opt.step()
    assert opt._fo.group_config(0).arithmetic == 1
    fo.torch.AdamW([w], arithmetic="exact")  # fo's default arithmetic, with or without the field
    with pytest.raises(ValueError, match="arithmetic"):
        fo.torch.AdamW([w], arithmetic="sloppy")


def test_state_dict_hooks_run_as_torchs():
    m = make_model()
    opt = fo.torch.SGD(m.parameters(), lr=1e-2, momentum=0.9, state_format="fp32")
    train(m, opt, steps=2)
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: {k: v for k, v in sd.items() if k != "extra"})
    opt.register_load_state_dict_post_hook(lambda o: seen.append("loaded"))
    sd = opt.state_dict()
    assert sd["extra"] == 1 and set(sd["state"][0]) == {"momentum_buffer"}
    opt.load_state_dict(sd)
    assert seen == ["pre", "loaded"]


# -- constructor checks: torch's conditions, exception types and words --------------------
T = torch.tensor
BAD = [  # (kwargs, refused by AdamW/Adam, refused by SGD)
    (dict(lr=-1e-3), True, True),
    (dict(lr=float("nan")), True, False),  # torch's Adam writes `not 0 <= lr`, its SGD `lr < 0`
    (dict(lr=T([1e-3, 1e-3])), True, True),
    (dict(lr=T(1e-3), foreach=True), True, False),
    (dict(betas=(1.0, 0.999)), True, None),
    (dict(betas=(-0.1, 0.999)), True, None),
    (dict(betas=(0.9, 1.5)), True, None),
    (dict(betas=(0.9, T(0.99))), True, None),
    (dict(betas=(T(0.9), 0.99)), True, None),
    (dict(betas=(T(0.9), T(0.99)), foreach=True), True, None),
    (dict(betas=(T([0.9, 0.9]), T(0.99))), True, None),
    (dict(eps=-1e-8), True, None),
    (dict(weight_decay=-0.1), True, True),
    (dict(momentum=-0.5), None, True),
    (dict(nesterov=True), None, True),
    (dict(nesterov=True, momentum=0.9, dampening=0.1), None, True),
]


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD"])
@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_hyper_parameters_are_refused_at_construction_as_torch_refuses_them(name, case):
    kwargs, adam, sgd = BAD[case]
    if (sgd if name == "SGD" else adam) is None:
        pytest.skip(f"{name} has no such argument")
    ps = list(make_model().parameters())
    try:
        getattr(torch.optim, name)(ps, **kwargs)
        want = None
    except (ValueError, RuntimeError) as e:  # a 2-element beta fails torch's range check itself
        want = (type(e), str(e))
    assert (want is not None) == (sgd if name == "SGD" else adam), f"torch's {name} changed: {want}"
    if want is None:
        getattr(fo.torch, name)(ps, **kwargs)  # accepted by both
        return
    with pytest.raises(want[0]) as got:
        getattr(fo.torch, name)(ps, **kwargs)
    assert (type(got.value), str(got.value)) == want


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=-1e-4), "Invalid learning rate: -0.0001"),
    (dict(lr=T([1e-4, 1e-4])), "Tensor lr must be 1-element"),
    (dict(betas=(1.0, 0.99)), "Invalid beta parameter at index 0: 1.0"),
    (dict(betas=(0.9, -0.5)), "Invalid beta parameter at index 1: -0.5"),
    (dict(weight_decay=-1.0), "Invalid weight_decay value: -1.0"),
])
def test_lion_refuses_what_adam_would_in_adams_words(kwargs, message):
    with pytest.raises(ValueError) as got:
        fo.torch.Lion(make_model().parameters(), **kwargs)
    assert str(got.value) == message


def test_edge_values_torch_accepts_construct_and_step():
    for name, kwargs in [("AdamW", dict(lr=0.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0)),
                         ("Adam", dict(lr=T(1e-2), betas=(T(0.9), T(0.99)))),
                         ("SGD", dict(lr=T([1e-2]), momentum=0.9, nesterov=True)),
                         ("Lion", dict(lr=0.0, betas=(0.0, 0.0)))]:
        m = make_model()
        opt = getattr(fo.torch, name)(m.parameters(), state_format="fp32", **kwargs)
        train(m, opt, steps=1)


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD", "Lion"])
def test_an_unknown_keyword_names_the_optimizer_as_python_does(name):
    ps = list(make_model().parameters())
    with pytest.raises(TypeError) as got:
        getattr(fo.torch, name)(ps, lr=1e-3, foo=1)
    assert str(got.value) == f"{name}.__init__() got an unexpected keyword argument 'foo'"
    if name != "Lion":
        with pytest.raises(TypeError) as want:
            getattr(torch.optim, name)(ps, lr=1e-3, foo=1)
        assert str(got.value) == str(want.value)


def test_a_bad_state_format_lists_the_formats_also_in_a_new_param_group():
    opt = fo.torch.AdamW(make_model()[0].parameters())
    with pytest.raises(ValueError, match=r"state_format 'q8' is not one of \['fp32', 'param_dtype', 'quant8', "):
        opt.add_param_group({"params": make_model()[2].parameters(), "state_format": "q8"})


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD"])
def test_torchs_own_optimizer_error_inputs(name):
    """torch's error inputs for its own optimizers (torch/testing/_internal/common_optimizers.py),
    run as torch's test_optim.py::test_errors runs them, against fo.torch's."""
    co = pytest.importorskip("torch.testing._internal.common_optimizers")
    inputs = getattr(co, f"optim_error_inputs_func_{name.lower()}")(device="cpu", dtype=torch.float32)
    assert inputs
    for e in inputs:
        oi = e.optimizer_error_input
        cls = getattr(fo.torch, name)
        build = lambda: cls(oi.params, **oi.kwargs)  # noqa: E731
        if e.error_on == co.OptimizerErrorEnum.STEP_ERROR:
            build, opt = (lambda: opt.step()), cls(oi.params, **oi.kwargs)
        if issubclass(e.error_type, Warning):
            with pytest.warns(e.error_type, match=e.error_regex):
                build()
        else:
            with pytest.raises(e.error_type, match=e.error_regex):
                build()


def test_a_gradient_whose_layout_changes_between_steps_is_read_as_it_now_is():
    """fo.torch keeps the gradient array across steps and rewrites a slot's dtype, shape and
    strides only when they change: every change of layout (dtype, strides, none, back) must
    still step exactly as fresh contiguous f32 gradients of the same values do."""
    torch.manual_seed(3)
    w0, b0 = torch.randn(6, 4), torch.randn(6)
    ps = [torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())]
    ref = [torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())]
    opt = fo.torch.AdamW(ps, lr=1e-2, weight_decay=0.1)
    want = fo.torch.AdamW(ref, lr=1e-2, weight_decay=0.1)
    layouts = ["f32", "bf16", "transposed", "none", "f32", "strided", "bf16", "f32"]
    if hasattr(ps[0], "grad_dtype"):
        for p in ps:
            p.grad_dtype = None  # torch refuses a bf16 grad on an f32 param unless told
    else:
        layouts = [x for x in layouts if x != "bf16"]
    for s, layout in enumerate(layouts):
        g = torch.Generator().manual_seed(50 + s)
        gw, gb = torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
        if layout in ("bf16",):
            gw, gb = gw.bfloat16().float(), gb.bfloat16().float()  # the values a bf16 grad holds
        for p, q, v in ((ps[0], ref[0], gw), (ps[1], ref[1], gb)):
            q.grad = None if layout == "none" else v.clone()
            if layout == "none":
                p.grad = None
            elif layout == "bf16":
                p.grad = v.bfloat16()
            elif layout == "transposed" and v.dim() == 2:
                p.grad = v.t().contiguous().t()  # the same values, column-major strides
            elif layout == "strided":
                p.grad = torch.stack([v, torch.zeros_like(v)], dim=-1)[..., 0]  # every other element
            else:
                p.grad = v.clone()
        if layout == "transposed":
            assert ps[0].grad.stride() != ref[0].grad.stride()
        if layout == "strided":
            assert not ps[1].grad.is_contiguous()
        opt.step()
        want.step()
        for p, q in zip(ps, ref):
            assert torch.equal(p, q), f"step {s} ({layout})"
