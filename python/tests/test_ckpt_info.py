"""fo.ckpt.info (fo_checkpoint_info_json): a checkpoint's logical keys and param groups as
the library reads them, and fo.ckpt.torch_state_dict(directory) built on it (no header
parsing or key suffixes in Python)."""
import shutil

import numpy as np
import pytest

import fo


def quant8_adamw(rows, steps=2):
    opt = fo.Optimizer("adamw", lr=1e-2, state_format="quant8", master_weight_bits=0)
    w = np.linspace(-1, 1, rows * 40, dtype=np.float32).reshape(rows, 40)
    b = np.zeros(40, np.float32)
    opt.add_param("fc.weight", w)
    opt.add_param("fc.bias", b)
    for s in range(steps):
        opt.step([np.full_like(w, 0.1 * (s + 1)), None])
    return opt, (w, b)


def test_info_lists_a_compressed_pair_as_its_logical_key(tmp_path):
    opt, (w, _) = quant8_adamw(3)
    fo.ckpt.save(opt, tmp_path, mode="compressed", save_id="a")
    toc = fo.ckpt.info(tmp_path)
    assert toc["mode"] == "compressed"
    assert toc["param_groups"][0]["params"] == ["fc.weight", "fc.bias"]
    keys = toc["keys"]
    assert not [k for k in keys if "::" in k], keys
    assert keys["state.fc.weight.exp_avg"] == {"dtype": "F32", "shape": [3, 40], "compressed": True}
    assert keys["state.fc.weight.exp_avg_sq"]["compressed"] is True
    assert keys["state.fc.weight.step"] == {"dtype": "F32", "shape": [], "compressed": False}
    assert not [k for k in keys if k.startswith("state.fc.bias")]  # never stepped: no state

    portable = tmp_path / "portable"
    fo.ckpt.save(opt, portable, mode="portable", save_id="p")
    assert fo.ckpt.info(portable)["keys"]["state.fc.weight.exp_avg"] == {
        "dtype": "F32", "shape": [3, 40], "compressed": False}


def test_info_errors_name_the_directory(tmp_path):
    with pytest.raises(fo.FoError, match="does not exist") as e:
        fo.ckpt.info(tmp_path / "absent")
    assert e.value.name == "FO_ERR_NOT_FOUND"
    with pytest.raises(fo.FoError, match="no shard-"):
        fo.ckpt.info(tmp_path)


def test_torch_state_dict_of_a_directory_reads_the_committed_save_only(tmp_path):
    # A rank file of another save left beside the committed one (a save killed before
    # its cleanup, or a copy): the loader ignores it, and so must the torch layout, whose
    # shapes and groups came from globbing every shard file before.
    old, _ = quant8_adamw(3)
    fo.ckpt.save(old, tmp_path / "old", save_id="old")
    new, (w, _) = quant8_adamw(5)
    fo.ckpt.save(new, tmp_path / "new", save_id="new")
    stale = tmp_path / "new" / "shard-00002-model-00001-of-00001.safetensors"
    shutil.copyfile(tmp_path / "old" / "shard-00001-model-00001-of-00001.safetensors", stale)

    sd = fo.ckpt.torch_state_dict(tmp_path / "new", framework="numpy")
    assert sd["param_groups"][0]["params"] == [0, 1]
    np.testing.assert_array_equal(sd["state"][0]["exp_avg"], new.get_state(0, "exp_avg"))
    assert sd["state"][0]["exp_avg"].shape == w.shape


def test_torch_state_dict_of_a_non_checkpoint_directory_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no fo checkpoint files"):
        fo.ckpt.torch_state_dict(tmp_path)
