"""Issue 11's bounds through the Python binding: the values the C ABI refuses raise FoError
naming the argument (never a hang, an abort, or a MemoryError from the binding itself)."""
import math

import numpy as np
import pytest

import fo

I32_MAX = 2**31 - 1
I64_MAX = 2**63 - 1


def test_thread_count_is_capped():
    with pytest.raises(fo.FoError, match="at most 1024"):
        fo.set_num_threads(100000)
    fo.set_num_threads(3)
    assert fo.get_num_threads() == 3
    fo.set_num_threads(0)


def test_huge_split_factor_answers_at_once_or_is_refused():
    info = fo.ShardSpec((10, 3), (2,), (0,), [fo.StridedShard(0, I32_MAX)]).info()
    assert info.local_shape == (10, 3)
    with pytest.raises(fo.FoError, match="boxes"):
        fo.ShardSpec((2**40,), (2,), (0,), [fo.StridedShard(0, I32_MAX)]).info()


def test_shard_indices_of_2_63_rows_is_an_foerror():
    spec = fo.ShardSpec((I64_MAX, 1), (1,), (0,), [fo.Shard(0)])
    assert spec.indices(1) == [0]
    with pytest.raises(fo.FoError, match="capacity"):
        spec.indices(0)


def test_grouped_placements_never_wrap():
    with pytest.raises(fo.FoError, match="placements\\[0\\].dim"):
        fo.grouped_placements([fo.Shard(I32_MAX)])


@pytest.mark.parametrize("world", [I32_MAX, 1025, 0, -1])
def test_local_group_size_is_bounded(world):
    with pytest.raises(fo.FoError, match="world_size"):
        fo.Comm.local_group(world, timeout=1.0)


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf, 0.0, -1.0])
def test_local_group_timeout_is_finite_and_positive(timeout):
    with pytest.raises(fo.FoError, match="timeout_s"):
        fo.Comm.local_group(2, timeout=timeout)


def _optimizer():
    opt = fo.Optimizer("adamw", master_weight_bits=0)
    opt.add_param("w", np.ones(4, dtype=np.float32))
    opt.step([np.full(4, 0.5, dtype=np.float32)])
    return opt


def test_checkpoint_options_outside_their_values(tmp_path):
    opt = _optimizer()
    with pytest.raises(fo.FoError, match="options.write_unsharded"):
        fo.ckpt.save(opt, tmp_path, write_unsharded=5)
    fo.ckpt.save(opt, tmp_path, save_id="ok")
    with pytest.raises(fo.FoError, match="options.strict"):
        fo.ckpt.load(opt, tmp_path, strict=7)
    with pytest.raises(fo.FoError, match="options.param_groups"):
        fo.ckpt.load(opt, tmp_path, param_groups=2)
    fo.ckpt.load(opt, tmp_path, strict=True)
