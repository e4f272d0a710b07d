"""Checkpoints through the Python binding: files fo writes open with the `safetensors`
package and carry DCP's sharding info; state saved on 3 ranks loads on 2; torch's own
checkpoints consolidate to full.safetensors; errors raise FoError naming the file."""
import json
import os

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

import fo
from conftest import ORACLE

ROWS, COLS = 10, 7


def make_rank(world, rank, state_format="fp32", steps=2):
    spec = fo.ShardSpec((ROWS, COLS), (world,), (rank,), ["S0"])
    info = spec.info()
    r0, n = info.global_offset[0], info.local_shape[0]
    flat = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    w = np.ascontiguousarray(np.sin(0.3 * flat[r0:r0 + n]))
    opt = fo.Optimizer("adamw", lr=1e-2, state_format=state_format, master_weight_bits=0)
    opt.add_param("w", w, shard=spec)
    for s in range(steps):
        opt.step([np.ascontiguousarray(np.cos(0.7 * flat[r0:r0 + n] + s))])
    return opt, w, r0, n


def test_files_open_with_the_safetensors_package_and_carry_dcp_sharding_info(tmp_path):
    ranks = [make_rank(3, r, "quant8") for r in range(3)]
    for r, (opt, _, _, _) in enumerate(ranks):
        fo.ckpt.save(opt, tmp_path, rank=r, world_size=3, mode="compressed", save_id="py")
    # Every rank's file is visible once the last rank has saved.
    for r, (opt, _, r0, n) in enumerate(ranks):
        path = tmp_path / f"shard-{r + 1:05d}-model-00001-of-00001.safetensors"
        tensors = load_file(str(path))
        np.testing.assert_array_equal(tensors["state.w.exp_avg::quantized"], opt.get_state(0, "exp_avg::quantized"))
        np.testing.assert_array_equal(tensors["state.w.exp_avg::scales"], opt.get_state(0, "exp_avg::scales"))
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata()
        assert meta["format"] == "pt" and meta["DCP_VERSION"] == "1.0"
        info = json.loads(meta["DCP_SHARDING_INFO"])
        assert info["state.w.exp_avg::quantized"]["saved_offsets"] == [r0, 0]
        assert json.loads(meta["fo"])["mode"] == "compressed"
        assert ("state.w.step" in tensors) == (r == 0)
    fo.ckpt.verify(tmp_path)


def test_saved_on_three_ranks_loads_on_two_bit_for_bit(tmp_path):
    m = np.zeros((ROWS, COLS), np.float32)
    for r in range(3):
        opt, _, r0, n = make_rank(3, r)
        m[r0:r0 + n] = opt.get_state(0, "exp_avg")
        fo.ckpt.save(opt, tmp_path, rank=r, world_size=3, mode="portable", save_id="three")
    for r in range(2):
        opt, _, r0, n = make_rank(2, r, steps=0)
        report = fo.ckpt.load(opt, tmp_path)
        assert report["loaded"] == ["state.w.exp_avg", "state.w.exp_avg_sq", "state.w.step"]
        np.testing.assert_array_equal(opt.get_state(0, "exp_avg"), m[r0:r0 + n])
        assert opt.get_state(0, "step") == 2.0


def test_packed_view_matches_the_state():
    opt, _, r0, n = make_rank(3, 1)
    with fo.ckpt.pack(opt, rank=1, world_size=3, mode="portable") as p:
        entries = {e["key"]: e for e in p.entries()}
        e = entries["state.w.exp_avg"]
        assert e["global_shape"] == (ROWS, COLS) and e["global_offset"] == (r0, 0) and e["shape"] == (n, COLS)
        np.testing.assert_array_equal(e["data"], opt.get_state(0, "exp_avg"))
        assert p.metadata()["param_groups"][0]["lr"] == 1e-2


def test_consolidates_torch_checkpoints_like_full_safetensors(tmp_path):
    for name in ["ckpt_fsdp2_4ranks", "ckpt_fsdp_tp_2x2"]:
        out = tmp_path / name
        fo.ckpt.consolidate(ORACLE / name / "sharded", out)
        got = safe_open(str(out / "model-00001-of-00001.safetensors"), framework="numpy")
        want = safe_open(str(ORACLE / name / "full.safetensors"), framework="numpy")
        assert sorted(got.keys()) == sorted(want.keys())
        for k in want.keys():
            if k == "mixer.weight" or k.startswith("state.mixer"):
                continue  # bf16: numpy cannot hold it; the Rust and C++ tests compare those bytes
            np.testing.assert_array_equal(got.get_tensor(k), want.get_tensor(k), err_msg=k)
        assert got.get_tensor("state.fc1.weight.step") == 3.0
        assert got.get_tensor("bn.num_batches_tracked").dtype == np.int64


def test_corrupt_file_raises_naming_it_and_leaves_the_optimizer(tmp_path):
    opt, _, _, _ = make_rank(1, 0)
    fo.ckpt.save(opt, tmp_path, mode="portable")
    path = tmp_path / "shard-00001-model-00001-of-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    fresh, _, _, _ = make_rank(1, 0, steps=1)
    before = fresh.get_state(0, "exp_avg")
    with pytest.raises(fo.FoError) as e:
        fo.ckpt.load(fresh, tmp_path)
    assert e.value.name == "FO_ERR_CORRUPT" and "shard-00001" in str(e.value) and "checksum" in str(e.value)
    np.testing.assert_array_equal(fresh.get_state(0, "exp_avg"), before)
    with pytest.raises(fo.FoError, match="does not exist"):
        fo.ckpt.load(fresh, tmp_path / "missing")


def test_multi_rank_save_needs_a_save_id_and_commits_when_the_last_rank_is_done(tmp_path):
    opt, _, _, _ = make_rank(2, 0)
    with pytest.raises(fo.FoError, match="save_id"):
        fo.ckpt.save(opt, tmp_path, rank=0, world_size=2, mode="portable")
    fo.ckpt.save(opt, tmp_path, rank=0, world_size=2, mode="portable", save_id="a")
    # One rank of two: nothing is visible yet.
    with pytest.raises(fo.FoError):
        fo.ckpt.verify(tmp_path)
    # A rank of another save does not complete it.
    opt1, _, _, _ = make_rank(2, 1)
    fo.ckpt.save(opt1, tmp_path, rank=1, world_size=2, mode="portable", save_id="b")
    with pytest.raises(fo.FoError):
        fo.ckpt.verify(tmp_path)
    fo.ckpt.save(opt1, tmp_path, rank=1, world_size=2, mode="portable", save_id="a")
    fo.ckpt.verify(tmp_path)
    assert json.loads((tmp_path / "fo-commit.json").read_text())["save_id"] == "a"


def test_a_non_utf8_or_empty_path_raises_foerror(tmp_path):
    # fo's C ABI takes UTF-8 paths; a name that is not (bytes, or str holding surrogate
    # escapes, as Python decodes such names) is FoError naming the argument, never
    # UnicodeEncodeError, and nothing is written (issue 23).
    opt, _, _, _ = make_rank(1, 0)
    raw = os.fsencode(tmp_path) + b"/caf\xe9"
    for bad in (raw, os.fsdecode(raw)):
        with pytest.raises(fo.FoError, match="not valid UTF-8"):
            fo.ckpt.save(opt, bad, rank=0, world_size=1, mode="portable")
        with pytest.raises(fo.FoError, match="not valid UTF-8"):
            fo.ckpt.verify(bad)
    assert not os.path.exists(raw)
    for bad in ("", b""):
        with pytest.raises(fo.FoError, match="empty path"):
            fo.ckpt.verify(bad)
        with pytest.raises(fo.FoError, match="empty path"):
            fo.ckpt.save(opt, bad, rank=0, world_size=1, mode="portable")
