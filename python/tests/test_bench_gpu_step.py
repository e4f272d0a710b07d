"""scripts/bench_gpu_step.py without a GPU: its command line (help, refusals naming the
argument: an unknown dtype, state format or arithmetic) and, with every GPU hidden, the line
saying that torch sees none."""

import pytest

from conftest import ROOT, run_script

SCRIPT = ROOT / "scripts" / "bench_gpu_step.py"


def run(*args):
    return run_script(SCRIPT, *args)


def test_help_names_every_flag():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for flag in ("--params", "--tensors", "--dtypes", "--fo-formats", "--fo-arithmetic", "--master-bits",
                 "--rounds", "--steps", "--warmup", "--device"):
        assert flag in text
    assert "exact, fast" in text


@pytest.mark.parametrize("args,named", [(["--fo-arithmetic", "slow"], "--fo-arithmetic"),
                                        (["--fo-arithmetic", ","], "--fo-arithmetic"),
                                        (["--fo-formats", "quant9"], "--fo-formats"),
                                        (["--dtypes", "f16"], "--dtypes")])
def test_bad_arguments_are_refused_naming_the_argument(args, named):
    r = run(*args)
    assert r.returncode == 2 and named in r.stderr, r.stderr


def test_without_a_gpu_it_says_so():
    pytest.importorskip("torch")  # run_script hides every GPU, so none is seen on a GPU machine too
    r = run("--params", "1K", "--tensors", "2")
    assert r.returncode != 0 and "no CUDA GPU" in r.stderr + r.stdout, (r.stdout, r.stderr)
