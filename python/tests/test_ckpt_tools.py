"""fo.ckpt.convert and fo.ckpt.diff (fo_checkpoint_convert, fo_checkpoint_diff_json): the
offline converter and the key-by-key comparison as library calls, what `fo ckpt convert` and
`fo ckpt diff` run."""
import os

import numpy as np
import pytest

import fo
from conftest import ORACLE

TORCH_SHARDED = ORACLE / "ckpt_fsdp2_4ranks" / "sharded"
TORCH_FULL = ORACLE / "ckpt_fsdp2_4ranks" / "full.safetensors"


def quant8_adamw(rows=5):
    opt = fo.Optimizer("adamw", lr=1e-2, state_format="quant8", master_weight_bits=0)
    w = np.linspace(-1, 1, rows * 40, dtype=np.float32).reshape(rows, 40)
    opt.add_param("fc.weight", w)
    for s in range(2):
        opt.step([np.full_like(w, 0.1 * (s + 1))])
    return opt


def test_torch_checkpoint_converted_onto_three_ranks_equals_its_full_file(tmp_path):
    dst = tmp_path / "r3"
    fo.ckpt.convert(TORCH_SHARDED, dst, ranks=3)
    assert len(list(dst.glob("shard-*.safetensors"))) == 3
    report = fo.ckpt.diff(dst, TORCH_FULL)
    assert report["equal"] is True and report["keys_compared"] == 48 and report["keys_differing"] == 0
    assert {k["status"] for k in report["keys"]} == {"equal"}
    assert os.listdir(tmp_path) == ["r3"]  # no staging directory left beside it


def test_convert_onto_a_mesh_with_placements_loads_back_the_same_state(tmp_path):
    opt = quant8_adamw()
    fo.ckpt.save(opt, tmp_path / "src", save_id="a")
    fo.ckpt.convert(tmp_path / "src", tmp_path / "mesh", mesh=[2, 2], placements=["S0", fo.shard.Shard(1)])
    # Same layout of quant8 groups? No: each rank now holds other rows, so codes are requantized;
    # the report compares the dequantized values.
    rep = fo.ckpt.diff(tmp_path / "mesh", tmp_path / "src", rtol=0.05, atol=1e-3)
    assert rep["equal"] is True, [k for k in rep["keys"] if k["status"] != "equal"]
    fo.ckpt.convert(tmp_path / "src", tmp_path / "portable", to="portable")
    toc = fo.ckpt.info(tmp_path / "portable")
    assert toc["mode"] == "portable" and toc["keys"]["state.fc.weight.exp_avg"]["compressed"] is False
    # Portable is exact: the dequantized values, bit for bit.
    assert fo.ckpt.diff(tmp_path / "portable", tmp_path / "src")["equal"] is True
    opt2 = fo.Optimizer("adamw", lr=1e-2, state_format="fp32", master_weight_bits=0)
    w = np.zeros((5, 40), np.float32)
    opt2.add_param("fc.weight", w)
    fo.ckpt.load(opt2, tmp_path / "portable")
    np.testing.assert_array_equal(opt2.get_state(0, "exp_avg"), opt.get_state(0, "exp_avg", dtype=np.float32))


def test_diff_reports_a_changed_key_and_a_missing_one(tmp_path):
    a = quant8_adamw()
    b = quant8_adamw()
    b.step([np.full((5, 40), 0.5, np.float32)])
    fo.ckpt.save(a, tmp_path / "a", mode="portable", save_id="a")
    fo.ckpt.save(b, tmp_path / "b", mode="portable", save_id="b")
    rep = fo.ckpt.diff(tmp_path / "a", tmp_path / "b")
    by = {k["key"]: k for k in rep["keys"]}
    assert rep["equal"] is False
    assert by["state.fc.weight.step"]["status"] == "differs" and by["state.fc.weight.step"]["out_of_tolerance"] == 1
    assert by["state.fc.weight.exp_avg"]["status"] == "differs"
    rep = fo.ckpt.diff(tmp_path / "a", TORCH_FULL)
    assert {k["status"] for k in rep["keys"]} == {"missing"}
    assert rep["keys_differing"] == rep["keys_compared"]


def test_failed_convert_leaves_nothing_and_errors_name_the_option(tmp_path):
    with pytest.raises(fo.FoError, match="ranks 3") as e:
        fo.ckpt.convert(TORCH_SHARDED, tmp_path / "x", ranks=3, mesh=[2, 2])
    assert e.value.name == "FO_ERR_INVALID_ARGUMENT"
    with pytest.raises(fo.FoError, match="inside the source"):
        fo.ckpt.convert(TORCH_SHARDED, TORCH_SHARDED / "sub")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine").write_text("keep")
    with pytest.raises(fo.FoError, match="force replaces it"):
        fo.ckpt.convert(TORCH_SHARDED, tmp_path / "full")
    with pytest.raises(ValueError, match="to must be"):
        fo.ckpt.convert(TORCH_SHARDED, tmp_path / "y", to="fp8")
    with pytest.raises(fo.FoError, match="does not exist"):
        fo.ckpt.convert(tmp_path / "absent", tmp_path / "z")
    assert sorted(os.listdir(tmp_path)) == ["full"]
    assert os.listdir(tmp_path / "full") == ["mine"]
    fo.ckpt.convert(TORCH_SHARDED, tmp_path / "full", force=True)
    assert not (tmp_path / "full" / "mine").exists()


def test_diff_errors_are_fo_errors_and_bad_tolerances_are_refused(tmp_path):
    with pytest.raises(fo.FoError, match="rtol"):
        fo.ckpt.diff(TORCH_SHARDED, TORCH_FULL, rtol=-1)
    with pytest.raises(fo.FoError, match="does not exist"):
        fo.ckpt.diff(tmp_path / "absent", TORCH_FULL)
