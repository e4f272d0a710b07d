"""The examples and README snippets run as a user runs them: as scripts, with the binding
on PYTHONPATH and the library through FO_LIBRARY."""
import importlib.util
import os
import re
import subprocess
import sys

from conftest import ROOT


def run(args, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def readme_blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_train_numpy_reloads_and_keeps_training_identically(tmp_path):
    r = run([str(ROOT / "examples/python/train_numpy.py"), str(tmp_path / "ckpt")], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reloaded state steps identically" in r.stdout
    assert (tmp_path / "ckpt" / "shard-00001-model-00001-of-00001.safetensors").exists()


def test_quickstart_runs_and_saves_both_ranks(tmp_path):
    r = run([str(ROOT / "examples/python/quickstart.py")], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 1: rows 3..5, received 24 bytes" in r.stdout
    assert len(list((tmp_path / "quickstart_ckpt").glob("shard-*.safetensors"))) == 2


def test_readme_shows_the_quickstarts_verbatim():
    # The README's C++ and Python blocks are these files, so the tests that run the files
    # (this one for Python, ctest's examples_cpp for C++) run what the README shows.
    assert (ROOT / "examples/cpp/quickstart.cpp").read_text() in readme_blocks("cpp")
    assert (ROOT / "examples/python/quickstart.py").read_text() in readme_blocks("python")


def test_readme_python_snippets_run(tmp_path):
    blocks = readme_blocks("python")
    assert blocks
    for code in blocks:
        if "import torch" in code and importlib.util.find_spec("torch") is None:
            continue  # torch snippets run where torch is (the torch venv's pytest)
        r = run(["-c", code], tmp_path)
        assert r.returncode == 0, code + "\n" + r.stdout + r.stderr


def test_import_fo_needs_no_ml_dtypes(tmp_path):
    # torch users run examples/python/torch_distributed.py without ml_dtypes installed.
    code = ("import sys; sys.modules['ml_dtypes'] = None\n"
            "import numpy as np, fo\n"
            "opt = fo.Optimizer('adamw', state_format='quant8', master_weight_bits=0)\n"
            "w = np.ones(40, np.float32); opt.add_param('w', w); opt.step([np.ones(40, np.float32)])\n"
            "assert opt.get_state(0, 'exp_avg').shape == (40,)\n"
            "try:\n    fo.optim.numpy_dtype(2)\nexcept ImportError as e:\n    assert 'ml_dtypes' in str(e)\n"
            "else:\n    raise SystemExit('bfloat16 without ml_dtypes should explain itself')\n")
    r = run(["-c", code], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
