"""fo.torch's overlapped step (overlap="always": the mechanism, handing over in every backward;
overlap=True measures it first, test_torch_overlap_tune.py): post-accumulate-grad hooks hand
each gradient to fo as backward makes it final, step() closes the step. Same bits as overlap=False (params and state) for
every rule and state format, with clipping that triggers and that does not, with gradient
accumulation under no_handover(); misuse raises clear errors and changes nothing."""
import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
import fo  # noqa: E402
import fo.torch  # noqa: E402

RULES = {
    "adamw": lambda ps, **kw: fo.torch.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
    "sgd": lambda ps, **kw: fo.torch.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=1e-3, **kw),
    "lion": lambda ps, **kw: fo.torch.Lion(ps, lr=1e-3, weight_decay=0.1, **kw),
}


class Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.fc1 = torch.nn.Linear(9, 40)
        self.fc2 = torch.nn.Linear(40, 33)  # 1320 + 33 elements: several quant8 groups, a short one
        self.head = torch.nn.Linear(33, 3)
        self.unused = torch.nn.Linear(2, 2)  # never gets a gradient
        self.to(dtype)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def build(rule, overlap, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    model = Net(dtype)
    return model, RULES[rule](model.parameters(), overlap=overlap, **kw)


def backward(model, it, micro=0, scale=1.0):
    g = torch.Generator().manual_seed(100 * it + micro)
    x = torch.randn(6, 9, generator=g).to(next(model.parameters()).dtype)
    (model(x).float().pow(2).sum() * scale).backward()


def train(model, opt, steps=3, scale=1.0, micro=1):
    stats = []
    for it in range(steps):
        opt.zero_grad()
        for m in range(micro - 1):
            with opt.no_handover():
                backward(model, it, m, scale)
        backward(model, it, micro - 1, scale)
        opt.step()
        stats.append(opt.last_step_stats)
    return stats


def snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    sd = opt.state_dict()["state"]
    state = {(i, k): v.clone() for i, s in sd.items() for k, v in s.items()}
    return params, state


def assert_same_bits(a, b):
    (pa, sa), (pb, sb) = a, b
    assert all(torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else x, y.view(torch.uint8)
                           if y.dtype != torch.float32 else y) for x, y in zip(pa, pb))
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("state_format", ["fp32", "quant8"])
@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("clip", [None, 0.5, 1e6], ids=["noclip", "clip_triggers", "clip_idle"])
def test_overlap_has_the_bits_of_the_plain_step(rule, state_format, clip):
    ref_model, ref = build(rule, False, state_format=state_format, max_grad_norm=clip)
    model, opt = build(rule, "always", state_format=state_format, max_grad_norm=clip)
    ref_stats = train(ref_model, ref)
    stats = train(model, opt)
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))
    for r, s in zip(ref_stats, stats):
        assert s["handed_over"] == s["handed_over_in_backward"] == 6  # by the hooks, during backward
        assert s["speculative"] + s["deferred"] == 6
        if clip is None:
            assert r is None and s["total_norm"] == -1 and s["rolled_back"] == 0
            assert s["speculative"] == 6  # every gradient stepped on fo's pool before step()
        else:
            assert s["total_norm"] == r["total_norm"] and s["clipped"] == r["clipped"]
            assert s["clipped"] == (clip == 0.5)
            # a clip certain to scale stops the early steps that would only be redone
            assert s["rolled_back"] == (s["speculative"] if clip == 0.5 else 0)
            assert clip == 0.5 or s["speculative"] == 6


def test_bf16_params_with_24_bit_masters_and_a_small_undo_budget():
    ref_model, ref = build("adamw", False, torch.bfloat16, master_weight_bits=24, max_grad_norm=0.5)
    model, opt = build("adamw", "always", torch.bfloat16, master_weight_bits=24, max_grad_norm=0.5,
                       undo_budget_bytes=2000)  # fc2.weight (2640 B of bf16) never fits
    train(ref_model, ref)
    stats = train(model, opt)
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))
    assert all(s["deferred"] > 0 and 0 < s["undo_high_water_bytes"] <= 2000 for s in stats)


def test_optimizer_clip_equals_torchs_clip_grad_norm_then_step_to_rounding():
    """max_grad_norm is fo's fo_clip_grad_norm: torch's clip_grad_norm_ computes the norm in
    float32, fo in float64, so they agree to rounding, not bit for bit."""
    torch_model, plain = build("adamw", False, state_format="fp32")
    model, opt = build("adamw", True, state_format="fp32", max_grad_norm=0.5)
    for it in range(3):
        plain.zero_grad()
        opt.zero_grad()
        backward(torch_model, it)
        backward(model, it)
        norm = torch.nn.utils.clip_grad_norm_(torch_model.parameters(), 0.5)
        plain.step()
        opt.step()
        assert opt.last_step_stats["total_norm"] == pytest.approx(norm.item(), rel=1e-6)
    for a, b in zip(torch_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_gradient_accumulation_hands_over_only_the_last_micro_batch(clip):
    ref_model, ref = build("adamw", False, max_grad_norm=clip)
    model, opt = build("adamw", "always", max_grad_norm=clip)
    train(ref_model, ref, micro=2)
    stats = train(model, opt, micro=2)
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))
    assert all(s["handed_over"] == s["handed_over_in_backward"] == 6 for s in stats)


def test_a_second_backward_without_no_handover_starts_the_step_over_with_the_accumulated_gradients():
    """Gradient accumulation without no_handover() (HF Trainer's, accelerate's loops): the
    second micro-batch's forward must see the parameters before fo's early steps (fo rolls
    them back when it starts) and its backward accumulates into the gradients: the bits of
    overlap=False."""
    ref_model, ref = build("adamw", False, max_grad_norm=0.5)
    model, opt = build("adamw", "always", max_grad_norm=0.5)
    caught = {ref: [], opt: []}
    for it in range(3):
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                backward(m, it, 0)
                backward(m, it, 1)  # accumulates in place: every gradient changed after hand-over
                o.step()
            caught[o] += [str(x.message) for x in w if "a forward ran between backward" in str(x.message)]
        assert opt.last_step_stats["handed_over_in_backward"] == 6
        assert opt.last_step_stats["redone"] is None
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))
    assert len(caught[opt]) == 1 and not caught[ref]  # said once, with what to do
    assert "no_handover" in caught[opt][0]


def test_zero_grad_after_backward_drops_the_step_like_torch():
    model, opt = build("sgd", "always", state_format="fp32")
    train(model, opt, steps=1)
    before = snapshot(model, opt)
    opt.zero_grad()
    backward(model, 1)  # fo steps these speculatively...
    opt.zero_grad()  # ...and puts them back: torch drops these gradients
    assert all(p.grad is None for p in model.parameters())
    assert opt.last_step_stats["rolled_back"] == 6
    opt.step()  # no gradient: nothing to do
    assert_same_bits(before, snapshot(model, opt))


def test_step_without_any_hook_is_the_plain_step():
    """Gradients set by hand (no backward, so no hook) are handed over by step()."""
    ref_model, ref = build("lion", False)
    model, opt = build("lion", True)
    for it in range(2):
        for m in (ref_model, model):
            torch.manual_seed(it)
            for p in list(m.parameters())[:6]:
                p.grad = torch.randn_like(p)
        ref.step()
        opt.step()
        st = opt.last_step_stats
        assert st["handed_over"] == 6 and st["handed_over_in_backward"] == 0
        assert st["speculative"] == 0 and st["undo_high_water_bytes"] == 0  # nothing to undo
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))


@pytest.mark.parametrize("clip", [None, 1e-3], ids=["noclip", "clip_triggers"])
def test_gradients_step_hands_over_keep_no_undo_record(clip):
    """A gradient no hook handed over (set by hand after backward) is handed over by step()
    and stepped there with the rest: no early step, no undo record for it."""
    ref_model, ref = build("adamw", False, state_format="quant8", max_grad_norm=clip)
    model, opt = build("adamw", "always", state_format="quant8", max_grad_norm=clip)
    for it in range(3):
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            backward(m, it)
            m.unused.weight.grad = torch.full_like(m.unused.weight, 0.25 * (it + 1))  # by hand
            o.step()
        st = opt.last_step_stats
        assert st["handed_over"] == 7 and st["handed_over_in_backward"] == 6
        assert st["speculative"] + st["deferred"] == 7 and st["clipped"] == bool(clip)
        if clip:
            # Once the clip is sure to scale, later gradients wait for step() too; the
            # early ones are put back and everything steps with the scaled gradients.
            assert st["deferred"] >= 1 and st["rolled_back"] == st["speculative"]
            continue
        assert st["speculative"] == 6 and st["deferred"] == 1 and st["rolled_back"] == 0
        # Only the six early parameters keep undo records (fp32 bytes, from the second
        # step on also their quant8 state: 2 code bytes per element and 2 fp16 scales per 32).
        sizes = [p.numel() for n, p in model.named_parameters() if not n.startswith("unused")]
        assert st["undo_high_water_bytes"] == sum(4 * k + (it > 0) * (2 * k + 4 * -(-k // 32)) for k in sizes)
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))


def test_lr_changed_between_backward_and_step_is_honoured_with_a_warning():
    ref_model, ref = build("adamw", False)
    model, opt = build("adamw", "always")
    for m, o in ((ref_model, ref), (model, opt)):
        train(m, o, steps=1)
        o.zero_grad()
        backward(m, 1)
        o.param_groups[0]["lr"] = 5e-3
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            o.step()
        said = [x for x in w if "param_groups changed" in str(x.message)]
        assert len(said) == (o is opt)
        # The warning points at the user's line (this file), not at fo's or torch's code.
        assert all(x.filename == __file__ for x in said), [x.filename for x in said]
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))


def test_a_non_finite_norm_with_error_if_nonfinite_fails_the_step_and_changes_nothing():
    model, opt = build("adamw", "always", max_grad_norm=1.0, error_if_nonfinite=True)
    train(model, opt, steps=1)
    before = snapshot(model, opt)
    opt.zero_grad()
    backward(model, 1, scale=float("inf"))
    with pytest.raises(fo.FoError, match="norm of the gradients is NaN; nothing was scaled"):
        opt.step()
    assert_same_bits(before, snapshot(model, opt))
    assert opt.last_step_stats["rolled_back"] == 6
    opt.zero_grad()
    backward(model, 2)
    opt.step()  # the next step goes on


def test_bad_arguments_are_refused_by_name():
    params = Net().parameters()
    with pytest.raises(ValueError, match="max_grad_norm"):
        fo.torch.AdamW(params, overlap=True, max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="norm_type"):
        fo.torch.AdamW(Net().parameters(), max_grad_norm=1.0, norm_type=0)
    with pytest.raises(TypeError, match="bucket"):
        fo.torch.AdamW(Net().parameters(), overlap=True, bucket=3)


def test_deepcopy_keeps_overlap_and_hooks_its_own_parameters():
    model, opt = build("adamw", "always", state_format="fp32")
    train(model, opt, steps=1)
    twin_model, twin = copy.deepcopy((model, opt))
    assert twin.overlap == "always"
    for m, o in ((model, opt), (twin_model, twin)):
        o.zero_grad()
        backward(m, 1)
    assert twin._open and opt._open and len(twin._handed) == len(opt._handed) == 6
    opt.step()
    twin.step()
    assert_same_bits(snapshot(model, opt), snapshot(twin_model, twin))


def test_remove_hooks_returns_to_the_plain_step():
    model, opt = build("adamw", True)
    opt.remove_hooks()
    backward(model, 0)
    assert not opt._open
    opt.step()
    assert opt.last_step_stats is None


def test_reading_state_between_backward_and_step_rolls_the_open_step_back():
    """state_dict() (or opt.state, a checkpoint) between backward and step sees the state as
    before that backward; step() then steps as overlap=False would."""
    ref_model, ref = build("adamw", False)
    model, opt = build("adamw", "always")
    train(ref_model, ref, steps=1)
    train(model, opt, steps=1)
    before = snapshot(model, opt)
    opt.zero_grad()
    backward(model, 1)
    assert opt._open
    sd = opt.state_dict()  # rolls the early steps back
    assert not opt._open and opt.last_step_stats["rolled_back"] == 6
    assert all(torch.equal(sd["state"][i][k], v) for (i, k), v in before[1].items())
    assert_same_bits(before, snapshot(model, opt))
    opt.step()
    ref.zero_grad()
    backward(ref_model, 1)
    ref.step()
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))
    assert opt.state_dict()["state"][0]["step"].item() == 2
