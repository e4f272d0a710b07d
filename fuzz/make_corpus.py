"""Writes the seed corpus from real fo files (run once; the corpus is committed):
a one-rank checkpoint of the fixture's params (fuzz/src/lib.rs PARAMS) saved compressed
and portable, and a 2-rank file whose header carries a sharded key. Usage:
FO_LIBRARY=target/release/libfo.so python fuzz/make_corpus.py"""
import pathlib
import shutil
import tempfile

import numpy as np

import fo

ROOT = pathlib.Path(__file__).parent / "corpus"


def optimizer(shape_w=(4, 3), spec=None):
    opt = fo.Optimizer("adamw", master_weight_bits=0)
    w = np.linspace(-1, 1, int(np.prod(shape_w)), dtype=np.float32).reshape(shape_w)
    b = np.linspace(0, 1, 5, dtype=np.float32)
    opt.add_param("w", w, shard=spec)
    opt.add_param("b", b)
    opt.step([np.cos(w).astype(np.float32), np.sin(b).astype(np.float32)])
    return opt, w, b


def main():
    seeds = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        for mode in ("compressed", "portable"):
            opt, _, _ = optimizer()
            d = tmp / mode
            fo.ckpt.save(opt, d, rank=0, world_size=1, mode=mode, save_id="seed")
            seeds[f"one_rank_{mode}"] = next(d.glob("*.safetensors")).read_bytes()
        spec = fo.ShardSpec((8, 3), (2,), (1,), ["S0"])
        opt, _, _ = optimizer((4, 3), spec)
        d = tmp / "sharded"
        fo.ckpt.save(opt, d, rank=1, world_size=2, mode="portable", save_id="seed")
        seeds["rank1_of_2_portable"] = next(d.glob("*.safetensors")).read_bytes()
    for target in ("header", "load"):
        out = ROOT / target
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for name, data in seeds.items():
            (out / name).write_bytes(data)
    print({k: len(v) for k, v in seeds.items()})


if __name__ == "__main__":
    main()
