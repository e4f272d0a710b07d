"""fo.Comm in-process groups from Python threads: broadcast_state_dict and clip_grad_norm."""
import threading

import ml_dtypes
import numpy as np
import pytest

import fo


def run_threads(world, fn, timeout=30):
    comms = fo.Comm.local_group(world, timeout=10)
    out, errs = [None] * world, [None] * world

    def body(r):
        try:
            out[r] = fn(comms[r])
        except BaseException as e:  # noqa: BLE001
            errs[r] = e

    ts = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
        assert not t.is_alive(), "a rank hung"
    for c in comms:
        c.close()
    return out, errs


def test_threads_receive_their_shards_with_a_cast():
    full = {"w": np.arange(30, dtype=np.float32).reshape(10, 3) / 7, "buf": np.arange(5, dtype=np.int64)}

    def rank(comm):
        spec = fo.ShardSpec([10, 3], [4], [comm.rank], ["SS0:2"])
        rows = spec.indices(0)
        w = np.zeros((len(rows), 3), dtype=ml_dtypes.bfloat16)
        buf = np.zeros(5, dtype=np.int64)
        stats = fo.broadcast_state_dict(comm, full if comm.rank == 0 else None, {"w": (w, spec), "buf": buf})
        return rows, w, buf, stats

    out, errs = run_threads(4, rank)
    assert errs == [None] * 4, errs
    for rows, w, buf, stats in out:
        np.testing.assert_array_equal(w, full["w"][rows].astype(ml_dtypes.bfloat16))
        np.testing.assert_array_equal(buf, full["buf"])
        assert stats["bytes_received"] == len(rows) * 12 + 40


def test_missing_key_is_the_same_error_on_every_rank():
    def rank(comm):
        d = np.full(3, 9.0, dtype=np.float32)
        try:
            fo.broadcast_state_dict(comm, {"a": np.ones(3, np.float32)}, {"a": d, "nope": d.copy()})
        finally:
            assert (d == 9.0).all()

    _, errs = run_threads(3, rank)
    assert all(isinstance(e, fo.FoError) and e.name == "FO_ERR_NOT_FOUND" for e in errs), errs
    assert len({str(e) for e in errs}) == 1 and "nope" in str(errs[0])


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_counts_shards_once_and_scales(norm_type):
    shards = [np.array([1.0, -2.0], np.float32), np.array([3.0], np.float32), np.zeros(0, np.float32)]
    rep = np.array([0.5], np.float32)
    allv = np.concatenate(shards + [rep]).astype(np.float64)
    want = np.abs(allv).max() if norm_type == float("inf") else np.linalg.norm(allv, norm_type)

    def rank(comm):
        g, r = shards[comm.rank].copy(), rep.copy()
        total = fo.clip_grad_norm(comm, [(g, True), (r, False)], 1.0, norm_type)
        return total, g, r

    out, errs = run_threads(3, rank)
    assert errs == [None] * 3, errs
    coef = np.float32(1.0 / (want + 1e-6))
    for i, (total, g, r) in enumerate(out):
        assert total == pytest.approx(want, rel=1e-12)
        np.testing.assert_array_equal(g, shards[i] * coef)
        np.testing.assert_array_equal(r, rep * coef)


def test_nccl_without_the_cuda_feature_is_unsupported():
    with pytest.raises(fo.FoError) as e:
        fo.Comm.from_nccl(1, 0, 0, 1)
    assert e.value.name == "FO_ERR_UNSUPPORTED"


def test_a_stream_is_taken_by_a_cuda_build_only():
    [c] = fo.Comm.local_group(1)
    c.set_stream(0)  # the legacy default stream: always
    try:
        c.set_stream(0x10)  # taken where libfo has `cuda` and libcuda loads
    except fo.FoError as e:  # else refused, saying why
        assert e.name == "FO_ERR_UNSUPPORTED" and "fo_comm_set_stream" in str(e), e
    c.close()


def test_torch_distributed_example_is_valid_python():
    import py_compile
    from conftest import ROOT
    py_compile.compile(str(ROOT / "examples" / "python" / "torch_distributed.py"), doraise=True)


def test_tensorarg_values_pass_bf16_bits_without_ml_dtypes():
    bits = np.array([0x3F80, 0x4000], dtype=np.int16)  # bf16 1.0, 2.0

    def rank(comm):
        d = np.zeros(2, np.float32)
        fo.broadcast_state_dict(comm, {"b": fo.TensorArg(bits, dtype="bf16")} if comm.rank == 0 else None, {"b": d})
        return d

    out, errs = run_threads(2, rank)
    assert errs == [None, None], errs
    assert all(d.tolist() == [1.0, 2.0] for d in out)


@pytest.mark.skipif(__import__("importlib").util.find_spec("torch") is None, reason="torch is not installed")
def test_torch_distributed_example_matches_distribute_tensor():
    import os
    import subprocess
    import sys
    from conftest import ROOT
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), FO_LIBRARY=str(fo.library_path))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                        str(ROOT / "examples" / "python" / "torch_distributed.py")],
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(": OK;") == 4, r.stdout
