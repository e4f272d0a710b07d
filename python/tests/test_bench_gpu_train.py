"""scripts/bench_torch_gpu_train.py without a GPU: its command line (help, refusals naming the
argument), the one-line exit 2 where there is nothing to measure, and, where torch is
installed, the optimizers it builds and the state memory it reports (on a host model: torch's
fused AdamW keeps 8 B/param, fo's default quant8 2.125, as the table must say)."""

import pytest

from conftest import ROOT, load_script, run_script

SCRIPT = ROOT / "scripts" / "bench_torch_gpu_train.py"


def run(*args):
    return run_script(SCRIPT, *args)


def load():
    return load_script(SCRIPT)


def test_help_names_every_flag_and_runner():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for flag in ("--layers", "--width", "--batch", "--dtype", "--rounds", "--steps", "--warmup", "--only", "--device"):
        assert flag in r.stdout
    text = " ".join(r.stdout.split())  # argparse wraps the default list anywhere
    for runner in ("torch fused", "fo quant8", "fo quant8 exact", "fo quant8 overlap", "fo fp32", "fo offload"):
        assert runner in text


@pytest.mark.parametrize("args,named", [(["--only", "fo quant9"], "--only"), (["--layers", "0"], "--layers"),
                                        (["--warmup", "-1"], "--warmup"), (["--dtype", "f16"], "--dtype")])
def test_bad_arguments_are_refused_naming_the_argument(args, named):
    r = run(*args)
    assert r.returncode == 2 and named in r.stderr, r.stderr


def test_without_a_gpu_it_exits_2_with_one_line_saying_why():
    r = run("--rounds", "1")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_torch_gpu_train: ")
    assert "torch" in lines[0]


def test_the_state_column_counts_what_each_optimizer_keeps():
    torch = pytest.importorskip("torch")
    mod = load()
    a = mod.parse(["--layers", "2", "--width", "64", "--dtype", "fp32"])
    kept = {}
    for name in ("torch fused", "fo quant8", "fo fp32"):
        model = mod.build(torch, a, torch.device("cpu"))
        opt = mod.optimizer(torch, name, model)
        model(torch.randn(4, 64)).square().sum().backward()
        opt.step()
        dev, host = mod.state_bytes(torch, opt)
        n = sum(p.numel() for p in model.parameters())
        assert dev == 0
        kept[name] = host / n
    assert kept["fo quant8"] == pytest.approx(2.125, abs=0.03)  # codes + fp16 scales per 32
    assert kept["fo fp32"] == pytest.approx(8.0)
    assert 8.0 <= kept["torch fused"] < 8.1  # exp_avg, exp_avg_sq and a step count per tensor
