"""fo.torch's overlapped step (overlap="always"; some loops with overlap=True, measured, too)
in the loops users really run (issue 33): gradients edited between
backward and step() (torch's clip_grad_norm_, GradScaler.unscale_), a step GradScaler skips,
model.zero_grad() instead of the optimizer's, and a gradient whose device-to-host copy is
still in flight when its hook runs (FSDP2 + CPUOffloadPolicy, emulated: no GPU needed). In
every case the parameters and state have the bits of the same loop with overlap=False."""
import warnings

import pytest

torch = pytest.importorskip("torch")
import fo.torch  # noqa: E402
from test_torch_overlap import assert_same_bits, backward, build, snapshot  # noqa: E402


def settle(opt):
    """Waits until fo's early steps have read the gradients handed over so far: behind a
    real model's backward they have by the time the loop edits them; behind this tiny one
    the edit may come first, and an early step that reads the edited (final) bits needs no
    redo, which would make a count of redone steps depend on timing."""
    if getattr(opt, "_open", False):
        opt._fo.grads_changed()


def run_pair(loop, rule="adamw", steps=4, overlap="always", **kw):
    """Runs `loop(model, opt, it)` for overlap=False and `overlap`; returns both snapshots
    and the overlapped optimizer's stats per step and warnings."""
    ref_model, ref = build(rule, False, **kw)
    model, opt = build(rule, overlap, **kw)
    stats, caught = [], []
    for it in range(steps):
        loop(ref_model, ref, it)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            loop(model, opt, it)
        caught += [str(x.message) for x in w]
        stats.append(opt.last_step_stats)
    return snapshot(ref_model, ref), snapshot(model, opt), stats, caught, opt


@pytest.mark.parametrize("state_format", ["fp32", "quant8"])
def test_torch_clip_grad_norm_after_backward_gives_the_bits_of_overlap_false(state_format):
    def loop(model, opt, it):
        opt.zero_grad()
        backward(model, it)
        settle(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # edits every gradient in place
        opt.step()

    ref, got, stats, caught, opt = run_pair(loop, state_format=state_format)
    assert_same_bits(ref, got)
    assert stats[0]["redone"].startswith("6 gradients changed") and stats[0]["rolled_back"] == 6
    # two redone steps in a row: the hooks stop handing over, and say so once
    assert opt._deferred is not None
    assert sum("handed over at step()" in m for m in caught) == 1
    assert stats[-1]["handed_over_in_backward"] == 0 and stats[-1]["rolled_back"] == 0


def test_one_edited_gradient_redoes_the_step_and_hand_over_resumes_after_a_clean_step():
    def loop(model, opt, it):
        opt.zero_grad()
        backward(model, it)
        if it == 1:
            next(model.parameters()).grad.mul_(0.5)  # one edit, one step
        opt.step()

    ref, got, stats, _, opt = run_pair(loop)
    assert_same_bits(ref, got)
    assert [s["redone"] is not None for s in stats] == [False, True, False, False]
    assert opt._deferred is None and stats[-1]["handed_over_in_backward"] == 6


def test_a_replaced_or_removed_gradient_is_seen():
    def loop(model, opt, it):
        opt.zero_grad()
        backward(model, it)
        params = list(model.parameters())
        params[0].grad = params[0].grad * 2  # another tensor
        params[1].grad = None  # no gradient: not stepped, as with overlap=False
        opt.step()

    ref, got, stats, _, _ = run_pair(loop, steps=2)
    assert_same_bits(ref, got)
    assert stats[0]["redone"].startswith("2 gradients changed")


def grad_scaler():
    try:
        return torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    except (AttributeError, RuntimeError, TypeError) as e:  # pragma: no cover - older torch
        pytest.skip(f"torch.amp.GradScaler('cpu') is not available: {e}")


@pytest.mark.parametrize("overlap", ["always", True])
@pytest.mark.parametrize("zero_grad", ["optimizer", "model_set_to_none", "model_in_place"])
def test_grad_scaler_unscales_and_skips_a_step_with_inf_gradients(zero_grad, overlap):
    """GradScaler.unscale_ edits every gradient after hand-over; at it == 2 the loss is inf, the
    scaler skips step() and fo must put its early (non-finite) steps back."""
    scalers = {}

    def loop(model, opt, it):
        scaler = scalers.setdefault(id(opt), grad_scaler())
        if zero_grad == "optimizer":
            opt.zero_grad()
        else:
            model.zero_grad(set_to_none=zero_grad == "model_set_to_none")
        g = torch.Generator().manual_seed(it)
        loss = model(torch.randn(6, 9, generator=g)).pow(2).sum() * (float("inf") if it == 2 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)  # unscale_ + found_inf check: skips opt.step() at it == 2
        scaler.update()

    # SGD: a scaled gradient moves the parameters (Adam's update would hide most of the scale)
    ref, got, stats, _, opt = run_pair(loop, rule="sgd", steps=5, overlap=overlap, state_format="fp32")
    assert_same_bits(ref, got)
    assert all(torch.isfinite(p).all() for p in got[0])
    assert set(opt.state_dict()["state"][0]) == {"momentum_buffer"}


def test_state_dict_after_a_skipped_step_is_the_state_before_it():
    model, opt = build("adamw", "always", state_format="fp32")
    opt.zero_grad()
    backward(model, 0)
    opt.step()
    before = snapshot(model, opt)
    opt.zero_grad()
    backward(model, 1, scale=float("inf"))  # fo steps these early: non-finite parameters
    # the loop skips step() (GradScaler found inf) and saves a checkpoint
    sd = opt.state_dict()
    assert all(torch.isfinite(v).all() for s in sd["state"].values() for v in s.values())
    assert_same_bits(before, snapshot(model, opt))


class FakeEvent:
    """A device-to-host copy in flight: the gradient holds garbage until the copy lands,
    which it does when fo synchronizes (or after `lands_after` queries)."""

    def __init__(self, grad, final, lands_after=None):
        self.grad, self.final, self.lands_after, self.queries, self.done = grad, final, lands_after, 0, False

    def _land(self):
        if not self.done:
            self.grad.copy_(self.final)
            self.done = True

    def query(self):
        self.queries += 1
        if self.lands_after is not None and self.queries > self.lands_after:
            self._land()
        return self.done

    def synchronize(self):
        self._land()


class FakeFSDPParam:
    def __init__(self, p, event):
        self.sharded_param, self.grad_offload_event = p, event


def fsdp_style_backward(model, it, lands_after):
    """What FSDP2's foreach_reduce does with CPUOffloadPolicy(pin_memory=True) in torch 2.11:
    the gradient is assigned while its non_blocking copy is in flight, the event recorded on
    fsdp_param.grad_offload_event, then the post-accumulate-grad hooks are called."""
    ref_model = [p.detach().clone().requires_grad_() for p in model.parameters()]
    ref = type(model)()
    with torch.no_grad():
        for p, q in zip(ref.parameters(), ref_model):
            p.copy_(q)
    backward(ref, it)
    events = []
    for p, q in reversed(list(zip(model.parameters(), ref.parameters()))):
        if q.grad is None:
            continue
        p.grad = torch.full_like(q.grad, float("nan"))  # the pinned buffer before the copy lands
        fsdp_param = FakeFSDPParam(p, FakeEvent(p.grad, q.grad, lands_after))  # noqa: F841 (read by fo's hook)
        events.append(fsdp_param.grad_offload_event)
        for hook in p._post_accumulate_grad_hooks.values():
            hook(p)
    for e in events:  # FSDP2's final callback
        e.synchronize()
    return events


@pytest.mark.parametrize("lands_after", [None, 0, 2], ids=["lands_at_step", "lands_at_once", "lands_later"])
def test_a_gradient_whose_offload_copy_is_in_flight_is_not_read_before_it_lands(lands_after):
    ref_model, ref = build("adamw", False)
    model, opt = build("adamw", "always")
    for it in range(3):
        ref.zero_grad()
        backward(ref_model, it)
        ref.step()
        opt.zero_grad()
        events = fsdp_style_backward(model, it, lands_after)
        opt.step()
        assert all(e.done for e in events)
        handed = opt.last_step_stats["handed_over_in_backward"]
        assert handed == {None: 0, 0: 6, 2: 4}[lands_after], opt.last_step_stats
        assert opt.last_step_stats["redone"] is None
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # Every hook found the event (what the FSDP2 test on a GPU prints); in flight as emulated.
    assert opt._copy_events == [18, 0 if lands_after == 0 else 18]


def test_an_evaluation_forward_between_backward_and_step_sees_the_parameters_before_the_step():
    def loop(model, opt, it):
        opt.zero_grad()
        backward(model, it)
        with torch.no_grad():
            out = model(torch.ones(2, 9))  # must not see fo's early steps
        opt.step()
        loop.outs.setdefault(id(opt), []).append(out)

    loop.outs = {}
    ref, got, stats, caught, _ = run_pair(loop, steps=2)
    assert_same_bits(ref, got)
    a, b = loop.outs.values()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert stats[0]["rolled_back"] == 6 and sum("a forward ran between backward" in m for m in caught) == 1


def test_activation_checkpointing_recomputes_inside_backward_without_a_rollback():
    from torch.utils.checkpoint import checkpoint

    def loop(model, opt, it):
        opt.zero_grad()
        x = torch.randn(6, 9, generator=torch.Generator().manual_seed(it))
        h = checkpoint(lambda t: torch.tanh(model.fc1(t)), x, use_reentrant=False)
        h = checkpoint(lambda t: torch.tanh(model.fc2(t)), h, use_reentrant=False)
        model.head(h).pow(2).sum().backward()
        opt.step()

    ref, got, stats, caught, _ = run_pair(loop, steps=3)
    assert_same_bits(ref, got)
    assert all(s["rolled_back"] == 0 and s["handed_over_in_backward"] == 6 for s in stats)
    assert not caught


def test_grad_scaler_flow_has_the_bits_of_torchs_unscale_then_step():
    """fo unscales with GradScaler's own op and factor (`_step_supports_amp_scaling`): the same
    bits as GradScaler unscaling the gradients itself before a plain step()."""
    def loop(model, opt, it):
        scaler = loop.scalers.setdefault(id(opt), grad_scaler())
        opt.zero_grad()
        x = torch.randn(6, 9, generator=torch.Generator().manual_seed(it))
        scaler.scale(model(x).pow(2).sum() * 1e-3).backward()
        if it == 1:
            scaler.unscale_(opt)  # explicit, as before a clip: fo is told grad_scale=None
        scaler.step(opt)
        scaler.update()

    loop.scalers = {}
    torch_model, torch_flow = build("sgd", False, state_format="fp32")
    torch_flow._step_supports_amp_scaling = False  # GradScaler unscales in place, then step()
    for it in range(3):
        loop(torch_model, torch_flow, it)
    ref, got, stats, _, _ = run_pair(loop, rule="sgd", steps=3, state_format="fp32")
    assert_same_bits(snapshot(torch_model, torch_flow), got)
    assert_same_bits(ref, got)


def test_a_compiled_training_step_with_overlap_breaks_only_where_torchs_adamw_does():
    """fo's hooks run eagerly in backward and stay out of Dynamo (they broke the graph 36
    times): the compiled loop breaks where torch's own AdamW's does, with overlap=False's bits."""
    from test_torch_usability import compiled_loop, params_equal

    import re

    def same_site(breaks):
        """Where each break is (the first name in backticks): overlap=True's zero_grad is an
        instance attribute, which Dynamo words as a call rather than an inline of torch's."""
        return {(re.findall(r"`([^`]+)`", b) or [b.splitlines()[0]])[0] for b in breaks}

    model, breaks, warned = compiled_loop(lambda ps: fo.torch.AdamW(ps, lr=1e-2, state_format="fp32", overlap=True))
    _, ref_breaks, _ = compiled_loop(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    assert warned == []
    assert same_site(breaks) <= same_site(ref_breaks), same_site(breaks) - same_site(ref_breaks)
    eager, _, _ = compiled_loop(lambda ps: fo.torch.AdamW(ps, lr=1e-2, state_format="fp32"), compiled=False)
    assert params_equal(model, eager)
