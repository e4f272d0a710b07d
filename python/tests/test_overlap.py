"""The overlapped step from Python (`Optimizer.step_begin` / `grads_ready` / `step_end`):
the same bits as `step`, and with clipping as `fo.clip_grad_norm` then `step`, whatever
the order and bucketing; failures change nothing; misuse raises."""
import ml_dtypes
import numpy as np
import pytest

import fo

SHAPES = [(300,), (7, 9), (2125,), (5,), (0,)]


def make(seed, dtype=ml_dtypes.bfloat16, **hp):
    rng = np.random.default_rng(seed)
    opt = fo.Optimizer("adamw", lr=1e-2, **hp)
    params = [rng.uniform(-1, 1, s).astype(dtype) for s in SHAPES]
    for i, p in enumerate(params):
        opt.add_param(f"p{i}", p)
    return opt, params


def grads(seed, dtype=np.float32):
    rng = np.random.default_rng(1000 + seed)
    return [rng.uniform(-1, 1, s).astype(dtype) for s in SHAPES]


def state(opt):
    return {(i, k): opt.get_state(i, k).tobytes() for i in range(opt.num_params) for k in opt.state_keys(i)}


def overlapped(opt, gs, rng, **options):
    order = rng.permutation(len(gs))
    opt.step_begin(**options)
    at = 0
    while at < len(order):
        n = int(rng.integers(1, len(order) - at + 1))
        idx = [int(i) for i in order[at:at + n]]
        opt.grads_ready(idx, [gs[i] for i in idx])
        at += n
    return opt.step_end()


@pytest.mark.parametrize("state_format,bits,dtype", [("quant8", 24, ml_dtypes.bfloat16), ("fp32", 0, np.float32),
                                                     ("quant8", 0, np.float16)])
def test_overlapped_step_has_the_bits_of_step(state_format, bits, dtype):
    a, pa = make(1, dtype, state_format=state_format, master_weight_bits=bits)
    b, pb = make(1, dtype, state_format=state_format, master_weight_bits=bits)
    rng = np.random.default_rng(7)
    for s in range(3):
        ga, gb = grads(s), grads(s)
        gb[1] = np.asfortranarray(gb[1])  # a strided gradient
        a.step(ga)
        st = overlapped(b, gb, rng)
        # The empty array has no data pointer: no gradient, in step() as here.
        assert st["speculative"] == st["handed_over"] == len(SHAPES) - 1
        assert st["rolled_back"] == 0 and st["total_norm"] == -1
        assert all(x.tobytes() == y.tobytes() for x, y in zip(pa, pb))
        assert state(a) == state(b)


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_has_the_bits_of_clip_grad_norm_then_step(max_norm):
    comm = fo.Comm.local_group(1)[0]
    a, pa = make(2)
    b, pb = make(2)
    rng = np.random.default_rng(3)
    for s in range(2):
        ga, gb = grads(s), grads(s)
        total = fo.clip_grad_norm(comm, [(g, False) for g in ga], max_norm)
        a.step(ga)
        st = overlapped(b, gb, rng, max_norm=max_norm)
        assert st["total_norm"] == total
        assert st["clipped"] == (max_norm / (total + 1e-6) < 1)
        assert all(x.tobytes() == y.tobytes() for x, y in zip(ga, gb)), "gradients scaled alike"
        assert all(x.tobytes() == y.tobytes() for x, y in zip(pa, pb))
        assert state(a) == state(b)


@pytest.mark.parametrize("max_norm", [None, 0.5, 1e6], ids=["noclip", "clip_triggers", "clip_idle"])
def test_gradients_handed_over_at_the_end_step_at_step_end_with_no_undo_record(max_norm):
    comm = fo.Comm.local_group(1)[0]
    a, pa = make(5)
    b, pb = make(5)
    for s in range(3):
        ga, gb = grads(s), grads(s)
        if max_norm is not None:
            fo.clip_grad_norm(comm, [(g, False) for g in ga], max_norm)
        a.step(ga)
        b.step_begin(max_norm=max_norm)
        b.grads_ready([0, 2], [gb[0], gb[2]])  # early, during "backward"
        b.grads_at_end([1, 3], [gb[1], gb[3]])  # the rest, right before step_end
        st = b.step_end(comm)
        assert st["handed_over"] == 4 and st["deferred"] == 2
        assert st["speculative"] == 2
        if max_norm == 0.5:  # the clip scales: the early ones were put back, all stepped at the end
            assert st["clipped"] and st["rolled_back"] == 2
        else:
            assert st["rolled_back"] == 0
        # Undo records of the two early parameters only: their bf16 bytes, and from the
        # second step on (the first creates the state) their state's: int8 error bits,
        # quant8 codes of both moments and an fp16 scale per 32 elements of each.
        n = [pb[0].size, pb[2].size]
        undo = sum(2 * k + (s > 0) * (3 * k + 2 * 2 * -(-k // 32)) for k in n)
        assert st["undo_high_water_bytes"] == undo
        assert all(x.tobytes() == y.tobytes() for x, y in zip(pa, pb))
        assert state(a) == state(b)


def test_a_bad_gradient_fails_the_step_and_changes_nothing():
    opt, params = make(4)
    gs = grads(0)
    opt.step(gs)
    before = [p.copy() for p in params], state(opt)
    opt.step_begin()
    opt.grads_ready([0, 2], [gs[0], gs[2]])
    with pytest.raises(fo.FoError, match="gradient of p1") as e:
        opt.grads_ready([1], [gs[0]])
    assert e.value.name == "FO_ERR_SHAPE"
    with pytest.raises(fo.FoError, match="FO_ERR_SHAPE"):
        opt.step_end()
    assert all(x.tobytes() == y.tobytes() for x, y in zip(before[0], params)) and state(opt) == before[1]


def test_misuse_raises_and_other_calls_wait_for_step_end():
    opt, _ = make(5)
    gs = grads(1)
    with pytest.raises(fo.FoError, match="no overlapped step is open"):
        opt.grads_ready([0], [gs[0]])
    with pytest.raises(fo.FoError, match="no overlapped step is open"):
        opt.step_end()
    opt.step_begin()
    with pytest.raises(fo.FoError, match="already open"):
        opt.step_begin()
    opt.grads_ready([0], [gs[0]])
    with pytest.raises(fo.FoError, match="FO_ERR_BUSY") as e:
        opt.step(gs)
    assert "fo_optimizer_step_end" in e.value.message
    assert opt.num_params == len(SHAPES)
    with pytest.raises(fo.FoError, match="already handed over"):
        opt.grads_ready([0], [gs[0]])
    with pytest.raises(fo.FoError):
        opt.step_end()
    opt.step(gs)


def test_release_undo_frees_the_records_kept_for_the_next_step():
    opt, params = make(6)
    gs = grads(2)
    assert opt.release_undo() == 0  # no overlapped step yet
    opt.step_begin()
    opt.grads_ready(list(range(len(gs))), gs)
    with pytest.raises(fo.FoError, match="fo_optimizer_release_undo") as e:
        opt.release_undo()  # the step is open
    assert e.value.name == "FO_ERR_BUSY"
    stats = opt.step_end()
    assert stats["speculative"] > 0
    assert 0 < opt.release_undo() <= stats["undo_high_water_bytes"]
    assert opt.release_undo() == 0  # freed once
    opt.step_begin()  # and made again by the next overlapped step
    opt.grads_ready(list(range(len(gs))), gs)
    assert opt.step_end()["speculative"] == stats["speculative"] and opt.release_undo() > 0


def test_step_abort_puts_every_early_step_back():
    opt, params = make(6)
    gs = grads(2)
    opt.step(gs)
    before = [p.copy() for p in params], state(opt)
    with pytest.raises(fo.FoError, match="no overlapped step is open"):
        opt.step_abort()
    opt.step_begin()
    opt.grads_ready(list(range(len(gs))), gs)
    stats = opt.step_abort()
    # An empty array has no data pointer: fo takes it as "no gradient" (fo_optimizer_step's rule).
    assert stats["handed_over"] == sum(g.size > 0 for g in gs)
    assert stats["speculative"] > 0 and stats["rolled_back"] == stats["speculative"]
    assert all(x.tobytes() == y.tobytes() for x, y in zip(before[0], params)) and state(opt) == before[1]
    opt.step(gs)  # the step is closed


def test_grads_changed_names_gradients_edited_after_their_early_step():
    opt, params = make(7)
    ref, ref_params = make(7)
    gs = grads(3)
    opt.set_full_fingerprints(True)
    opt.step_begin()
    opt.grads_ready(list(range(len(gs))), gs)
    assert opt.grads_changed(full=range(len(gs))) == []
    gs[1] *= 0.5  # scaled: the sampled fingerprint sees it
    gs[0] *= 1.0  # the same bits
    assert opt.grads_changed() == [1]
    assert opt.grads_changed(full=[0, 1]) == [1]
    with pytest.raises(fo.FoError, match="fo_optimizer_set_full_fingerprints") as e:
        opt.set_full_fingerprints(False)
    assert e.value.name == "FO_ERR_BUSY"
    with pytest.raises(fo.FoError, match=r"full\[0\]"):
        opt.grads_changed(full=[99])
    opt.step_abort()  # redone with the final gradients: the plain step's bits
    opt.step(gs)
    ref.step(gs)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(params, ref_params)) and state(opt) == state(ref)
    with pytest.raises(fo.FoError, match="no overlapped step is open"):
        opt.grads_changed()


def test_bench_grads_changed_prints_each_cost():
    from conftest import ROOT, run_script

    r = run_script(ROOT / "scripts" / "bench_grads_changed.py", "--params", "2", "--size", "4K", "--rounds", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("bench_grads_changed: 2 x 4096 f32 params"), lines[0]
    for label in ("early steps, sampled fingerprint:", "early steps, full fingerprint:", "  full / sampled:",
                  "sampled check of every gradient:", "full check of every gradient:", "plain step:"):
        assert any(line.startswith(label) for line in lines[1:]), (label, r.stdout)
