"""scripts/profile_gpu_step.py without a GPU: its command line (help, refusals naming the
argument), the one-line exit 2 where there is nothing to measure, and, where torch is
installed, the timer it wraps around fo.torch's C call (one time per call, the call's result
passed through, the real function put back)."""

import pytest

from conftest import ROOT, load_script, run_script

SCRIPT = ROOT / "scripts" / "profile_gpu_step.py"


def test_help_names_every_flag():
    r = run_script(SCRIPT, "--help")
    assert r.returncode == 0, r.stderr
    for flag in ("--layers", "--width", "--batch", "--rounds", "--steps", "--only", "--kernels", "--device"):
        assert flag in r.stdout
    assert "ncu" in r.stdout  # how to get one kernel's counters


@pytest.mark.parametrize("args,named", [(["--only", "fo quant9"], "--only"), (["--steps", "0"], "--steps"),
                                        (["--rounds", "-1"], "--rounds")])
def test_bad_arguments_are_refused_naming_the_argument(args, named):
    r = run_script(SCRIPT, *args)
    assert r.returncode == 2 and named in r.stderr, r.stderr


def test_without_a_gpu_it_exits_2_with_one_line_saying_why():
    r = run_script(SCRIPT, "--rounds", "1")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("profile_gpu_step: ")


def test_the_call_timer_times_each_step_call_and_puts_the_call_back():
    torch = pytest.importorskip("torch")
    import fo.optim
    import fo.torch

    mod = load_script(SCRIPT)
    real = fo.optim._step
    p = torch.nn.Parameter(torch.ones(8))
    opt = fo.torch.AdamW([p], lr=0.1)
    timer = mod.CallTimer()
    try:
        for _ in range(2):
            p.grad = torch.ones(8)
            opt.step()
        assert len(timer.times) == 2 and all(t >= 0 for t in timer.times)
    finally:
        timer.close()
    assert fo.optim._step is real
    assert not torch.equal(p.detach(), torch.ones(8))  # the steps ran through the timer
