"""fo.torch's overlapped step against loops that read or write the parameters fo stepped
early, between their hand-over and step() (fo._torch_overlap_params): a second backward
through a retained graph, a gradient penalty, activation checkpointing of a layer used in
several segments, a compiled model's forward, in-place edits and new storage. Each gives
overlap=False's bits or a clear error with the early steps put back; none a silent
difference (each was one before: an audit's loops, 2026-11-28)."""
import warnings

import pytest

torch = pytest.importorskip("torch")
import fo.torch  # noqa: E402
from test_torch_overlap import assert_same_bits, backward, build, snapshot  # noqa: E402
from test_torch_overlap_edits import run_pair, settle  # noqa: E402


def same_params(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def last_two(model):
    return list(model.head.parameters())


# -- a backward that keeps its graph hands nothing over ---------------------------------------
def two_losses(model, opt, it):
    """Two losses on one graph: the second backward reads what the first one's forward saved
    (fo.torch's hooks must not have stepped those parameters in the first)."""
    opt.zero_grad()
    x = torch.randn(6, 9, generator=torch.Generator().manual_seed(it))
    h = torch.tanh(model.fc2(torch.tanh(model.fc1(x))))
    model.head(h).pow(2).sum().backward(retain_graph=True)
    settle(opt)
    h.pow(2).sum().backward()
    opt.step()


def inputs_in_turn(model, opt, it):
    """backward(inputs=the head, retain_graph=True), then backward(inputs=the rest)."""
    opt.zero_grad()
    x = torch.randn(6, 9, generator=torch.Generator().manual_seed(it))
    loss = model(x).pow(2).sum()
    loss.backward(inputs=last_two(model), retain_graph=True)
    settle(opt)
    loss.backward(inputs=[p for n, p in model.named_parameters() if n.startswith(("fc1", "fc2"))])
    opt.step()


def gradient_penalty(model, opt, it):
    """create_graph=True, then a penalty on the gradients' norm backpropagated."""
    opt.zero_grad()
    x = torch.randn(6, 9, generator=torch.Generator().manual_seed(it))
    loss = model(x).pow(2).sum()
    loss.backward(create_graph=True)
    settle(opt)
    sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None).backward()
    opt.step()


@pytest.mark.parametrize("loop", [two_losses, inputs_in_turn, gradient_penalty])
def test_a_backward_that_keeps_its_graph_hands_nothing_over(loop):
    ref, mine, stats, caught, _ = run_pair(loop, state_format="fp32")
    assert_same_bits(ref, mine)
    assert sum("retain_graph=True" in c for c in caught) == 1, caught  # said once
    if loop is not inputs_in_turn:  # the second backward reaches fc1 and fc2: those go over early
        assert all(s["handed_over_in_backward"] >= 4 for s in stats), stats


# -- forwards that read the stepped parameters ---------------------------------------------
class SharedBlock(torch.nn.Module):
    """One block applied three times, each under reentrant activation checkpointing: its
    gradient is final only after the first segment's recompute, which reads it."""

    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = torch.nn.Linear(9, 24), torch.nn.Linear(24, 24), torch.nn.Linear(24, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.inp(x))
        for _ in range(3):
            h = checkpoint(self.block, h, use_reentrant=True)
        return self.out(h)


def test_a_layer_recomputed_in_backward_after_its_hand_over_sees_it_as_before():
    def run(overlap):
        torch.manual_seed(0)
        model = SharedBlock()
        opt = fo.torch.AdamW(model.parameters(), lr=1e-2, overlap=overlap)
        caught = []
        for it in range(3):
            opt.zero_grad()
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                backward(model, it)
                opt.step()
            caught += [str(x.message) for x in w]
        return [p.detach().clone() for p in model.parameters()], caught, opt.last_step_stats

    ref, _, _ = run(False)
    mine, caught, stats = run("always")
    same_params(ref, mine)
    # each inner backward hands the block over; the next segment's recompute puts it back
    assert sum("recomputed inside backward" in c for c in caught) == 1, caught
    assert stats["rolled_back"] >= 1, stats


@pytest.mark.parametrize("evaluate", [True, False])
def test_a_compiled_models_forward_between_backward_and_step_sees_the_parameters_before(evaluate):
    """torch.compile(model) runs its modules inside the compiled frame, where no module's
    forward pre-hook runs; the wrapper's own call does: it holds every parameter."""
    outputs = {}

    def loop(model, opt, it):
        compiled = model.__dict__.setdefault("_compiled", torch.compile(model, backend="eager"))
        x = torch.randn(6, 9, generator=torch.Generator().manual_seed(it))
        opt.zero_grad()
        compiled(x).pow(2).sum().backward()
        settle(opt)
        if evaluate:  # an evaluation between backward and step
            with torch.no_grad():
                outputs.setdefault(opt.overlap, []).append(compiled(x * 2))
        else:  # a second micro-batch without no_handover()
            compiled(x * 2).pow(2).sum().backward()
        opt.step()

    torch._dynamo.reset()
    ref, mine, stats, caught, _ = run_pair(loop, steps=3)
    assert_same_bits(ref, mine)
    if evaluate:
        same_params(outputs[False], outputs["always"])
    assert any("a forward ran between backward" in c for c in caught), caught


# -- hooks registered after fo's run before fo takes the gradient ----------------------------
def with_user_hooks(hook):
    """A loop whose parameters carry `hook(opt, p)` as a post-accumulate-grad hook registered
    after the optimizer's (so after fo's own)."""
    def loop(model, opt, it):
        if not getattr(model, "_hooked", False):
            model._hooked = True
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(lambda p, opt=opt: hook(opt, p))
        opt.zero_grad()
        backward(model, it)
        opt.step()
    return loop


def decay_through_the_gradient(opt, p):
    settle(opt)  # fo's early steps so far have run: the parameter must not be among them
    p.grad.add_(p.detach(), alpha=0.1)


def clamp_the_gradient(opt, p):
    p.grad.clamp_(-0.05, 0.05)


@pytest.mark.parametrize("hook", [decay_through_the_gradient, clamp_the_gradient])
def test_a_hook_registered_after_fos_sees_the_parameter_before_and_fo_its_gradient_after(hook):
    """A hook that reads the parameter reads it unstepped; one that edits the gradient edits
    it before fo takes it, so nothing is redone and the step overlaps."""
    ref, mine, stats, _, _ = run_pair(with_user_hooks(hook), state_format="fp32")
    assert_same_bits(ref, mine)
    assert all(s["redone"] is None and s["handed_over_in_backward"] == 6 for s in stats), stats


# -- writes fo cannot carry over: an error, the early steps put back ------------------------
def edit_clamp(model):
    with torch.no_grad():
        model.fc2.weight.clamp_(-0.05, 0.05)


def edit_load(model):
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})


def edit_sam(model):
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(0.01 * p.grad)


def new_storage(model):
    model.fc2.weight.data = model.fc2.weight.data.clone()


@pytest.mark.parametrize("edit, says, then", [
    (edit_clamp, "was edited in place", "step"), (edit_load, "was edited in place", "step"),
    (edit_sam, "was edited in place", "zero_grad"), (new_storage, "was given new storage", "step"),
    (new_storage, "was given new storage", "state_dict")])
def test_a_parameter_changed_after_its_early_step_raises_and_puts_the_steps_back(edit, says, then):
    model, opt = build("adamw", "always", state_format="fp32")
    for it in range(2):
        opt.zero_grad()
        backward(model, it)
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    state = opt.state_dict()
    opt.zero_grad()
    backward(model, 2)
    settle(opt)  # the early steps wrote the parameters
    edit(model)
    with pytest.raises(fo.FoError, match=says) as e:
        {"step": opt.step, "zero_grad": opt.zero_grad, "state_dict": opt.state_dict}[then]()
    assert "no_handover" in str(e.value) and "param_groups[0].params[" in str(e.value)  # names it
    if edit is edit_load:  # rewritten whole: as before that backward
        same_params(before, [p.detach() for p in model.parameters()])
    after = opt.state_dict()  # the step was not taken: the state as before that backward
    assert all(torch.equal(state["state"][i][k], after["state"][i][k]) for i in state["state"] for k in state["state"][i])
    opt.zero_grad()  # and the optimizer goes on
    backward(model, 3)
    opt.step()
    assert opt.last_step_stats["handed_over_in_backward"] == 6


def test_a_parameter_given_new_storage_between_steps_is_read_there():
    """`p.data = ...` between steps (a re-tie, module.to): fo reads the new storage, never the
    freed one (8 MiB: freed, it goes back to the system, and a read of it faults)."""
    import gc

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1 << 22).to(torch.bfloat16))
    opt = fo.torch.AdamW([p], lr=1e-2, state_format="quant8", master_weight_bits=24)
    p.grad = torch.randn(1 << 22).to(torch.bfloat16)
    opt.step()
    before = opt.state_dict()["state"][0]
    old = p.data_ptr()
    p.data = p.data.clone()  # the old storage has no other owner
    gc.collect()
    after = opt.state_dict()["state"][0]
    assert opt._where[p][0] == p.data_ptr() != old  # registered again, at the new storage
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(before[k], after[k]), k
    assert torch.equal(after["master"].to(torch.bfloat16), p.detach())  # read from the new storage
    opt.step()


# -- a second gradient from a forward fo did not see -----------------------------------------
def functional(model, x):
    h = torch.tanh(torch.nn.functional.linear(x, model.fc1.weight, model.fc1.bias))
    h = torch.tanh(torch.nn.functional.linear(h, model.fc2.weight, model.fc2.bias))
    return torch.nn.functional.linear(h, model.head.weight, model.head.bias)


@pytest.mark.parametrize("how", ["functional", "forward_first"])
def test_a_second_backward_from_an_unseen_forward_raises(how):
    model, opt = build("adamw", "always", state_format="fp32")
    before = [p.detach().clone() for p in model.parameters()]
    xs = [torch.randn(6, 9, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    if how == "functional":
        functional(model, xs[0]).pow(2).sum().backward()
        settle(opt)
        second = functional(model, xs[1]).pow(2).sum()  # reads the stepped weights, no module call
    else:  # both forwards first: the second backward reads the weights its forward saved
        first, second = (model(x).pow(2).sum() for x in xs)
        first.backward()
        settle(opt)
    with pytest.raises(fo.FoError, match="got a second gradient after fo had stepped it early"):
        second.backward()
    same_params(before, [p.detach() for p in model.parameters()])  # put back
    opt.zero_grad()
    with opt.no_handover():  # what the error says to do: the bits of overlap=False
        backward(model, 0)
    backward(model, 1)
    opt.step()
    ref_model, ref = build("adamw", False, state_format="fp32")
    backward(ref_model, 0)
    backward(ref_model, 1)
    ref.step()
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))


# -- DistributedDataParallel: the same bits, and a warning that names it ---------------------
def test_ddp_averaging_after_the_hooks_redoes_the_early_steps_and_the_warning_says_so(tmp_path):
    from conftest import ROOT, torchrun

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    torchrun(2, ROOT / "python" / "tests" / "torch_ddp_overlap_worker.py", tmp_path / "r.json")
    import json

    res = json.loads((tmp_path / "r.json").read_text())
    for bucket_view, r in res.items():
        assert r["same_bits_on_every_rank"], (bucket_view, r)
        assert all(r["redone"][:2]) and r["handed_over_in_backward"][2:] == [0, 0], (bucket_view, r)
        assert len(r["warned"]) == 1 and "FSDP2" in r["warned"][0], (bucket_view, r)
