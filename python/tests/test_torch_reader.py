"""torch 2.15's own DCP reader (`HuggingFaceStorageReader`) loads fo's portable checkpoints
of box shards: uneven `Shard(0)` with an empty trailing rank, and a 2-D mesh of `Shard(0)`,
`Shard(1)` (FSDP2 + TP's box layout), and of non-box `_StridedShard` shards (each box of a
rank's shard in its own part file, so torch sees chunks of one key). Values equal the state
each rank held."""
import numpy as np
import pytest

import fo

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

ROWS, COLS = 10, 7


def save_ranks(path, mesh, placements):
    """Steps one AdamW param per mesh coordinate, saves each rank, returns the full state."""
    world = int(np.prod(mesh))
    full = {"exp_avg": np.zeros((ROWS, COLS), np.float32), "exp_avg_sq": np.zeros((ROWS, COLS), np.float32)}
    base = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    for rank in range(world):
        coord = np.unravel_index(rank, mesh)
        spec = fo.ShardSpec((ROWS, COLS), mesh, [int(c) for c in coord], placements)
        # The global indices a rank holds on each dim (a strided shard is not one box).
        box = np.ix_(*[np.asarray(spec.indices(d), dtype=np.intp) for d in range(2)])
        w = np.ascontiguousarray(np.sin(0.3 * base[box]))
        opt = fo.Optimizer("adamw", lr=1e-2, state_format="fp32", master_weight_bits=0)
        opt.add_param("w", w, shard=spec)
        for s in range(2):
            opt.step([np.ascontiguousarray(np.cos(0.7 * base[box] + s))])
        if w.size:
            for k in full:
                full[k][box] = opt.get_state(0, k)
        fo.ckpt.save(opt, path, rank=rank, world_size=world, mode="portable", save_id="torch-reader")
    fo.ckpt.verify(path)
    return full


@pytest.mark.parametrize(
    "mesh,placements",
    [
        ((6,), ["S0"]),
        ((4,), ["S0"]),
        ((2, 2), ["S0", "S1"]),
        ((2, 3), ["S0", "S1"]),
        ((2,), ["SS0:3"]),
        ((3,), ["SS0:2"]),
        ((2, 2), ["SS0:2", "S0"]),
        ((2, 2), ["SS0:3", "S1"]),
        ((5,), ["SS1:3"]),
    ],
    ids=[
        "uneven-6-ranks-one-empty",
        "uneven-4-ranks",
        "mesh-2x2-S0-S1",
        "mesh-2x3-S0-S1",
        "strided-SS0:3-2-ranks",
        "strided-SS0:2-3-ranks",
        "mesh-2x2-SS0:2-S0",
        "mesh-2x2-SS0:3-S1",
        "strided-SS1:3-5-ranks",
    ],
)
def test_torch_hf_reader_loads_fo_shards(tmp_path, mesh, placements):
    full = save_ranks(tmp_path, mesh, placements)
    world = int(np.prod(mesh))
    non_box = any(
        not fo.ShardSpec((ROWS, COLS), mesh, [int(c) for c in np.unravel_index(r, mesh)], placements).info().is_box
        for r in range(world)
    )
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    # Non-box shards add part files; box shards keep one file per rank.
    assert (len(files) > world) == non_box, files
    sd = {
        "state.w.exp_avg": torch.full((ROWS, COLS), float("nan")),
        "state.w.exp_avg_sq": torch.full((ROWS, COLS), float("nan")),
    }
    dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path)), no_dist=True)
    np.testing.assert_array_equal(sd["state.w.exp_avg"].numpy(), full["exp_avg"])
    np.testing.assert_array_equal(sd["state.w.exp_avg_sq"].numpy(), full["exp_avg_sq"])
