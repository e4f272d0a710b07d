"""fo.ckpt.save_async: the checkpoint holds the state as of the call (the same bytes as
fo.ckpt.save then) while the optimizer steps and sets state; wait() raises the
background failure with its path; done(), bytes_written and stats() report progress."""
import math
import os
import threading

import numpy as np
import pytest

import fo

ROWS, COLS = 1001, 67


def make_rank(world, rank, state_format="quant8", steps=1):
    spec = fo.ShardSpec((ROWS, COLS), (world,), (rank,), ["S0"])
    info = spec.info()
    r0, n = info.global_offset[0], info.local_shape[0]
    flat = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    ws = [np.ascontiguousarray(np.sin(0.3 * flat[r0:r0 + n] + k)) for k in range(3)]
    opt = fo.Optimizer("adamw", lr=1e-2, state_format=state_format, master_weight_bits=0)
    for k, w in enumerate(ws):
        opt.add_param(f"layer{k}.weight", w, shard=spec)

    def step(s):
        opt.step([np.ascontiguousarray(np.cos(0.7 * flat[r0:r0 + n] + s + k)) for k in range(3)])

    for s in range(steps):
        step(s)
    return opt, ws, step


def files(d):
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d)) if not n.startswith(".")}


@pytest.mark.parametrize("state_format", ["quant8", "fp32"])
def test_async_save_equals_a_sync_save_of_the_call_state_while_steps_run(tmp_path, state_format):
    sync, asy = tmp_path / "sync", tmp_path / "async"
    ranks = [make_rank(2, r, state_format) for r in range(2)]
    handles = []
    for r, (opt, _, step) in enumerate(ranks):
        fo.ckpt.save(opt, sync, rank=r, world_size=2, save_id="py")
        h = fo.ckpt.save_async(opt, asy, rank=r, world_size=2, save_id="py", staging_budget=1 << 20)
        step(5)
        opt.set_state(0, {"exp_avg": np.full(opt.get_state(0, "exp_avg").shape, 0.25, np.float32)})
        handles.append(h)
    for h in handles:
        h.wait()
        h.wait(timeout=0)  # the same outcome again
        assert h.done()
        st = h.stats()
        assert h.bytes_written == st["bytes_total"] > 0
        assert 0 <= st["staging_high_water"] <= st["staging_budget"] == 1 << 20
        h.close()
    assert files(asy) == files(sync) and len(files(sync)) == 3
    fo.ckpt.verify(asy)


def test_a_background_failure_raises_at_wait_naming_the_path(tmp_path):
    opt, _, step = make_rank(1, 0)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with fo.ckpt.save_async(opt, blocker / "ckpt") as h:
        step(1)
        with pytest.raises(fo.FoError) as e:
            h.wait(timeout=60)
        assert e.value.name == "FO_ERR_IO" and str(blocker) in e.value.message


def test_add_param_during_a_save_is_refused_or_the_save_was_done(tmp_path):
    opt, _, step = make_rank(1, 0)
    h = fo.ckpt.save_async(opt, tmp_path)
    extra = np.zeros(4, np.float32)
    try:
        opt.add_param("late", extra)
        assert h.done() or h.stats()["bytes_written"] == h.stats()["bytes_total"]
    except fo.FoError as e:
        assert e.name == "FO_ERR_INVALID_ARGUMENT" and "async checkpoint save" in e.message
    h.wait()
    h.close()
    fo.ckpt.verify(tmp_path)


def test_comm_save_commits_at_wait_on_every_rank(tmp_path):
    comms = fo.Comm.local_group(2, timeout=60)
    errors = []

    def run(r):
        try:
            opt, _, step = make_rank(2, r)
            h = fo.ckpt.save_async(opt, tmp_path, rank=r, world_size=2, comm=comms[r])
            step(3)
            h.wait()
            h.close()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    fo.ckpt.verify(tmp_path)


@pytest.mark.parametrize("timeout", [math.inf, 1e300, 8 * 24 * 3600.0])
def test_wait_takes_infinity_and_huge_timeouts_as_no_limit(tmp_path, timeout):
    opt, _, step = make_rank(1, 0)
    with fo.ckpt.save_async(opt, tmp_path) as h:
        step(1)
        h.wait(timeout=timeout)  # refused as "inf is not a duration" before issue 38
    fo.ckpt.verify(tmp_path)
    with fo.ckpt.save_async(opt, tmp_path / "nan") as h:
        with pytest.raises(fo.FoError) as e:
            h.wait(timeout=math.nan)
        assert e.value.name == "FO_ERR_INVALID_ARGUMENT" and "timeout_s" in e.value.message
        h.wait()


def test_a_second_save_into_the_same_dir_commits_after_the_first(tmp_path):
    opt, _, step = make_rank(1, 0)
    latest, ref = tmp_path / "latest", tmp_path / "ref"
    for run in range(10):
        step(2 * run)
        a = fo.ckpt.save_async(opt, latest, save_id=f"a{run}")
        step(2 * run + 1)
        fo.ckpt.save(opt, ref, save_id=f"b{run}")
        b = fo.ckpt.save_async(opt, latest, save_id=f"b{run}")
        a.wait()
        b.wait()
        a.close()
        b.close()
        assert files(latest) == files(ref), f"run {run}: latest/ is not the newest save"
        fo.ckpt.verify(latest)


def test_a_second_save_through_a_comm_before_the_first_wait_is_busy(tmp_path):
    (comm,) = fo.Comm.local_group(1, timeout=60)
    opt, _, step = make_rank(1, 0)
    ref = tmp_path / "ref"
    fo.ckpt.save(opt, ref, save_id="first")
    first = fo.ckpt.save_async(opt, tmp_path / "latest", save_id="first", comm=comm)
    step(1)
    with pytest.raises(fo.FoError) as e:
        fo.ckpt.save_async(opt, tmp_path / "latest", save_id="second", comm=comm)
    assert e.value.name == "FO_ERR_BUSY" and '"first"' in e.value.message
    first.wait()
    first.close()
    assert files(tmp_path / "latest") == files(ref)
    with fo.ckpt.save_async(opt, tmp_path / "latest", save_id="second", comm=comm) as h:
        h.wait()
    fo.ckpt.verify(tmp_path / "latest")
