"""fo.torch overlap=True is measured (issue 33, fo._torch_overlap_tune): after a warm-up the
loop's own iterations are timed with and without hand-over, and the hooks keep handing over
only where the overlapped iterations are not slower. Timed here with an injected clock, so
every decision is deterministic; the bits are overlap=False's throughout."""
import copy
import pickle
import warnings

import pytest

torch = pytest.importorskip("torch")
import fo.torch  # noqa: E402
import fo._torch_overlap_tune as tune  # noqa: E402
from test_torch_overlap import assert_same_bits, backward, build, snapshot  # noqa: E402
from test_torch_overlap_edits import settle  # noqa: E402

# what the probe does from the first iteration: WARM_UP overlapped, then plain and overlapped
# in turn until PAIRS of each are timed (6 = the hooks handed every gradient over, 0 = none)
PROBED = [6] * tune.WARM_UP + [0, 6] * tune.PAIRS


class Clock:
    """The probe's clock, moved on by the test: each iteration takes what the test says."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(tune, "_clock", c)
    return c


def iterate(model, opt, its, clock=None, overlapped=0.0, plain=0.0, between=None):
    """One training iteration per `it`; on `clock` it takes `overlapped` seconds if backward
    handed gradients over, else `plain`. `between(model, opt, it)` runs between backward and
    step() and may return the iteration's time instead. Returns each step's stats."""
    stats = []
    for it in its:
        opt.zero_grad()
        backward(model, it)
        took = between(model, opt, it) if between else None
        if clock is not None:
            clock.t += took if took is not None else overlapped if opt._open else plain
        opt.step()
        stats.append(opt.last_step_stats)
    return stats


def caught_warnings(fn, files=None):
    """fn()'s result and the messages of the warnings it raised (their files into `files`)."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn()
    if files is not None:
        files += [x.filename for x in w]
    return out, [str(x.message) for x in w]


def test_overlap_is_kept_where_overlapped_iterations_are_faster(clock):
    ref_model, ref = build("adamw", False)
    model, opt = build("adamw", True)
    n = len(PROBED) + 5
    iterate(ref_model, ref, range(n))
    stats, said = caught_warnings(lambda: iterate(model, opt, range(n), clock, overlapped=0.030, plain=0.031))
    assert not said
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))
    assert [s["handed_over_in_backward"] for s in stats] == PROBED + [6] * 5
    assert [s["not_overlapped"] for s in stats] == [tune.HELD if h == 0 else None for h in PROBED] + [None] * 5
    phases = [s["overlap_probe"]["phase"] for s in stats]
    assert phases == ["warm-up"] * (tune.WARM_UP - 1) + ["probing"] * (2 * tune.PAIRS) + ["decided"] * 6
    probe = stats[-1]["overlap_probe"]
    assert probe["decision"] == "overlap" and probe["warmed_up"] == tune.WARM_UP and probe["discarded"] == 0
    assert probe["overlapped_ms"] == pytest.approx([30.0] * 3) and probe["plain_ms"] == pytest.approx([31.0] * 3)
    assert opt._deferred is None


def test_overlap_stops_for_good_where_overlapped_iterations_are_slower(clock):
    """The H200's case: 33.9 ms overlapped against 30.5 ms without hand-over."""
    ref_model, ref = build("adamw", False, max_grad_norm=0.5)
    model, opt = build("adamw", True, max_grad_norm=0.5)
    n = len(PROBED)
    iterate(ref_model, ref, range(n))
    files = []
    stats, said = caught_warnings(lambda: iterate(model, opt, range(n), clock, overlapped=0.0339, plain=0.0305),
                                  files)
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))  # through the probe
    assert [s["handed_over_in_backward"] for s in stats] == PROBED
    why = "measured: overlapped iterations 33.9 ms (median of 3) vs 30.5 ms without hand-over (median of 3)"
    assert opt._deferred == why and stats[-1]["not_overlapped"] is None  # decided after that overlapped step
    assert stats[-1]["overlap_probe"]["decision"] == "no hand-over"
    assert len(said) == 1 and why in said[0] and "overlap='always'" in said[0], said
    assert files == [__file__]  # the loop's step() line, not fo's
    # The undo records kept for the next overlapped step go back at the decision, once: at
    # most every parameter's bytes and its state.
    bound = sum(p.numel() * p.element_size() for p in model.parameters()) + opt.state_memory()["host_bytes"]
    assert 0 < stats[-1]["undo_released_bytes"] <= bound
    assert all("undo_released_bytes" not in s for s in stats[:-1]) and opt._fo.release_undo() == 0

    # It stays dropped, whatever the iterations take from now on: never measured again.
    iterate(ref_model, ref, range(n, n + 6))
    stats, said = caught_warnings(lambda: iterate(model, opt, range(n, n + 6), clock, overlapped=0.001, plain=1.0))
    assert not said
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))  # after the switch
    assert all(s["handed_over_in_backward"] == 0 and s["not_overlapped"] == why for s in stats)
    assert all(s["speculative"] == 0 and s["undo_high_water_bytes"] == 0 for s in stats)  # the plain step
    assert all(s["clipped"] and s["total_norm"] > 0.5 for s in stats)
    assert all("undo_released_bytes" not in s for s in stats)


def test_equal_medians_keep_the_overlap(clock):
    model, opt = build("sgd", True)
    stats = iterate(model, opt, range(len(PROBED)), clock, overlapped=0.02, plain=0.02)
    assert stats[-1]["overlap_probe"]["decision"] == "overlap" and opt._deferred is None


def step_skipped_by_a_grad_scaler(opt):
    """What GradScaler.step does where it found inf/NaN gradients: fo.torch's optimizers take
    its verdict (`_step_supports_amp_scaling`) and skip the step."""
    opt.found_inf, opt.grad_scale = torch.ones(()), None
    try:
        opt.step()
    finally:
        del opt.found_inf, opt.grad_scale


def test_skipped_and_rolled_back_iterations_are_not_timed(clock):
    """Probing starts with a plain iteration: its step is skipped (GradScaler found inf); the
    next overlapped one drops its first backward (zero_grad() without step()). Both take 10 s
    on the clock and neither is a sample: the probe times 3 clean iterations of each kind."""
    skipped, dropped = tune.WARM_UP, tune.WARM_UP + 2

    def loop(model, opt, it):
        opt.zero_grad()
        backward(model, it)
        if it == dropped:
            opt.zero_grad()  # the step never comes: early steps put back, as torch drops them
            backward(model, it, micro=1)
        if opt.overlap:
            clock.t += 10.0 if it in (skipped, dropped) else 0.030 if opt._open else 0.020
        if it == skipped:
            step_skipped_by_a_grad_scaler(opt)
        else:
            opt.step()

    ref_model, ref = build("sgd", False, state_format="fp32")
    model, opt = build("sgd", True, state_format="fp32")
    n = len(PROBED) + 2
    for it in range(n):
        loop(ref_model, ref, it)
    caught_warnings(lambda: [loop(model, opt, it) for it in range(n)])
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))
    probe = opt.last_step_stats["overlap_probe"]
    assert probe["discarded"] == 2 and probe["phase"] == "decided", probe
    assert probe["overlapped_ms"] == pytest.approx([30.0] * 3) and probe["plain_ms"] == pytest.approx([20.0] * 3)
    assert opt._deferred.startswith("measured: overlapped iterations 30.0 ms")


def test_a_loop_that_keeps_putting_early_steps_back_stops_handing_over(clock):
    """An evaluation forward between backward and step() in every iteration rolls every
    overlapped iteration back: none can be timed, and after DISCARD_LIMIT the hooks stop."""
    def evaluate(model, opt, it):
        with torch.no_grad():
            model(torch.ones(2, 9))

    ref_model, ref = build("adamw", False)
    model, opt = build("adamw", True)
    n = tune.WARM_UP + 1 + tune.DISCARD_LIMIT + 3
    iterate(ref_model, ref, range(n), between=evaluate)
    stats, said = caught_warnings(lambda: iterate(model, opt, range(n), clock, 0.01, 0.02, between=evaluate))
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))
    decided = tune.WARM_UP + tune.DISCARD_LIMIT  # one plain sample, then only discarded overlapped ones
    probe = stats[decided]["overlap_probe"]
    assert probe["discarded"] == tune.DISCARD_LIMIT and probe["decision"] == "no hand-over", probe
    assert probe["overlapped_ms"] == [] and probe["plain_ms"] == pytest.approx([20.0])
    assert opt._deferred.startswith(f"measured: {tune.DISCARD_LIMIT} iterations were left out")
    assert all(s["handed_over_in_backward"] == 0 for s in stats[decided + 1:])
    assert sum("iterations were left out" in m for m in said) == 1


def test_accumulated_micro_batches_are_one_iteration(clock):
    """Only step() boundaries count: three micro-batches of 11 ms under no_handover() and a
    last one of 10 ms (overlapped) or 11 ms are one iteration of 43 or 44 ms."""
    model, opt = build("adamw", True)
    for it in range(len(PROBED)):
        opt.zero_grad()
        for m in range(3):
            with opt.no_handover():
                backward(model, it, m)
            clock.t += 0.011
        backward(model, it, 3)
        clock.t += 0.010 if opt._open else 0.011
        opt.step()
    probe = opt.last_step_stats["overlap_probe"]
    assert probe["overlapped_ms"] == pytest.approx([43.0] * 3) and probe["plain_ms"] == pytest.approx([44.0] * 3)
    assert probe["decision"] == "overlap"


def test_always_hands_over_in_every_backward_and_never_measures(clock):
    model, opt = build("adamw", "always")
    assert opt.overlap == "always" and opt._probe is None
    stats = iterate(model, opt, range(len(PROBED) + 4), clock, overlapped=1.0, plain=0.001)
    assert all(s["handed_over_in_backward"] == 6 and s["overlap_probe"] is None for s in stats)
    assert all(s["not_overlapped"] is None for s in stats) and opt._deferred is None


def test_gradients_edited_after_every_hand_over_stop_the_probe(clock):
    def clip(model, opt, it):
        settle(opt)  # (test_torch_overlap_edits.settle: a redo count that does not depend on timing)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)

    model, opt = build("adamw", True)
    stats, said = caught_warnings(lambda: iterate(model, opt, range(4), clock, 0.01, 0.02, between=clip))
    assert opt._deferred.startswith("6 gradients changed") and stats[-1]["overlap_probe"]["phase"] == "stopped"
    # held for nothing from the step that stopped the hand-over: given back then, once
    released = [s["undo_released_bytes"] for s in stats if "undo_released_bytes" in s]
    assert len(released) == 1 and released[0] > 0 and opt._fo.release_undo() == 0
    assert not any("measured" in m for m in said)


@pytest.mark.parametrize("bad", ["sometimes", "True", 1, 0, None])
def test_overlap_takes_true_false_or_always(bad):
    with pytest.raises(ValueError, match=f"overlap must be True .*'always'.* or False, got {bad!r}"):
        fo.torch.AdamW(torch.nn.Linear(2, 2).parameters(), overlap=bad)
    for good in (True, False, "always"):
        assert fo.torch.SGD(torch.nn.Linear(2, 2).parameters(), overlap=good).overlap == good


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "load_state_dict"])
def test_the_decision_is_the_loops_not_training_state(clock, how):
    """A copy, or a fresh optimizer loading the state, measures again (as after a
    construction, the hooks' other holds are not carried either)."""
    model, opt = build("adamw", True)
    caught_warnings(lambda: iterate(model, opt, range(len(PROBED)), clock, overlapped=0.05, plain=0.01))
    assert opt._deferred.startswith("measured")
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"} and "overlap" not in sd["param_groups"][0]
    if how == "load_state_dict":
        twin_model, twin = build("adamw", True)
        twin_model.load_state_dict(model.state_dict())
        twin.load_state_dict(opt.state_dict())
    else:
        twin_model, twin = copy.deepcopy((model, opt)) if how == "deepcopy" else pickle.loads(pickle.dumps((model, opt)))
    assert twin.overlap is True and twin._deferred is None and twin._probe.phase == "warm-up"
    stats = iterate(twin_model, twin, range(2))
    assert all(s["handed_over_in_backward"] == 6 for s in stats)
    assert iterate(model, opt, range(1))[0]["handed_over_in_backward"] == 0  # the original stays dropped


def test_remove_hooks_ends_the_measurement():
    model, opt = build("adamw", True)
    iterate(model, opt, range(2))  # overlapped (warm-up): fo keeps undo records for the next
    opt.remove_hooks()
    assert opt._fo.release_undo() == 0  # remove_hooks gave them back
    assert opt.overlap is False and opt._probe is None
    iterate(model, opt, range(2))
