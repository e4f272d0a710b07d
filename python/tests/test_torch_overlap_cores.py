"""fo.torch's overlapped step (overlap=True or "always") leaves the cores to a backward that uses them all: when backward runs
on the host CPU with a team of torch intra-op threads on every core, early steps would only
stall that team (measured: 1.12-1.19x the sequential FSDP2 iteration on 2 cores), so the hooks
hand nothing over, step() takes the plain step (no undo record), a warning says so once and
last_step_stats names why; with cores to spare the hooks hand over again. Same bits either way."""
import warnings

import pytest

torch = pytest.importorskip("torch")
import fo.torch  # noqa: E402
from fo._torch_overlap import _host_cores  # noqa: E402
from test_torch_overlap import assert_same_bits, build, snapshot, train  # noqa: E402

CORES = _host_cores()


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.skipif(CORES < 2, reason="one core: no team of torch threads to stall")
@pytest.mark.parametrize("overlap", ["always", True])  # measured or not, the rule holds
@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip_triggers"])
def test_a_backward_on_every_core_gets_the_plain_step_and_one_warning(torch_threads, clip, overlap):
    ref_model, ref = build("adamw", False, state_format="quant8", max_grad_norm=clip)
    model, opt = build("adamw", overlap, state_format="quant8", max_grad_norm=clip)
    torch_threads(CORES)
    ref_stats = train(ref_model, ref)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        stats = train(model, opt)
    said = [str(x.message) for x in w if "intra-op threads" in str(x.message)]
    assert len(said) == 1 and f"{CORES} torch intra-op threads on its {CORES} cores" in said[0], said
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))
    for s, r in zip(stats, ref_stats):
        assert s["handed_over"] == 6 and s["handed_over_in_backward"] == 0 and s["speculative"] == 0
        assert s["undo_high_water_bytes"] == 0 and "intra-op threads" in s["not_overlapped"]
        if clip is not None:
            assert s["total_norm"] == r["total_norm"] and s["clipped"] == r["clipped"] is True
        else:
            assert s["total_norm"] == -1.0

    # Cores to spare again: the hooks hand over during backward, and the bits stay.
    torch_threads(1)
    ref_stats = train(ref_model, ref, steps=2)
    stats = train(model, opt, steps=2)
    assert_same_bits(snapshot(ref_model, ref), snapshot(model, opt))
    assert all(s["handed_over_in_backward"] == 6 and s["not_overlapped"] is None for s in stats)


@pytest.mark.skipif(CORES < 2, reason="one core: no team of torch threads to stall")
def test_fewer_torch_threads_than_cores_overlap(torch_threads):
    model, opt = build("adamw", "always")
    torch_threads(CORES - 1 if CORES > 2 else 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning about cores
        stats = train(model, opt, steps=2)
    assert all(s["handed_over_in_backward"] == 6 and s["speculative"] == 6 for s in stats)
    assert all(s["not_overlapped"] is None for s in stats)


def test_one_torch_thread_is_no_team_to_stall(torch_threads, monkeypatch):
    # A single backward thread is time-sliced, not stalled at barriers: early steps stay on
    # even where that thread has the only core.
    import fo._torch_overlap as ov

    monkeypatch.setattr(ov, "_host_cores", lambda: 1)
    model, opt = build("sgd", "always")
    torch_threads(1)
    stats = train(model, opt, steps=2)
    assert all(s["handed_over_in_backward"] == 6 and s["not_overlapped"] is None for s in stats)


def test_a_module_computed_on_a_gpu_mesh_leaves_the_host_cores_to_fo():
    from fo._torch_overlap import _computes_on_host

    assert _computes_on_host(torch.nn.Parameter(torch.zeros(2)))
    meta = torch.nn.Parameter(torch.zeros(2, device="meta"))
    assert not _computes_on_host(meta)


@pytest.mark.skipif(CORES < 2, reason="one core: no team of torch threads to stall")
def test_warnings_point_at_the_users_line(torch_threads):
    # Raised inside a backward hook, under torch's wrappers: the warning names this file.
    model, opt = build("adamw", True)
    torch_threads(CORES)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        train(model, opt, steps=1)
    said = [x for x in w if "intra-op threads" in str(x.message)]
    assert len(said) == 1 and said[0].filename.endswith("test_torch_overlap.py"), said[0].filename
    # From step() too: test_torch_overlap.py's lr-changed test checks that warning's file.
