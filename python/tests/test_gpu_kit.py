"""scripts/gpu_kit.sh, the one prepared GPU run, without a GPU: its usage, the refusal where
torch sees no GPU (nothing run), the refusal of a missing kit, and its time budget: a step
past its timeout is reported as such and later steps are skipped once the budget is spent,
each a line of SUMMARY.txt (a GPU session has minutes, so a hung step must not eat them)."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_kit.sh"


def run(*args, **env):
    # CUDA_VISIBLE_DEVICES="" hides any GPU; python3 is this interpreter (torch or not).
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    e = dict(os.environ, CUDA_VISIBLE_DEVICES="", PATH=path)
    e.update(env)  # a test may set its own PATH
    return subprocess.run(["bash", str(SCRIPT), *args], env=e, capture_output=True, text=True, timeout=120)


def test_usage_names_both_modes():
    r = run()
    assert r.returncode == 2
    assert "gpu_kit.sh pack" in r.stdout and "gpu_kit.sh run" in r.stdout


def test_run_without_a_gpu_runs_nothing(tmp_path):
    out = tmp_path / "out"
    r = run("run", "checks", FO_GPU_KIT=str(tmp_path), OUT=str(out))
    assert r.returncode == 2
    assert "no GPU" in r.stderr and "nothing ran" in r.stderr
    assert not out.exists()


def test_a_missing_kit_is_named(tmp_path):
    r = run("run", "checks", FO_GPU_KIT=str(tmp_path / "kit"), FO_GPU_KIT_ANYWAY="1")
    assert r.returncode == 2
    assert f"{tmp_path / 'kit'}/fo" in r.stderr and "pack" in r.stderr


def fake_kit(tmp_path, fo_script):
    """A kit whose `fo` is `fo_script` (no test binaries, an empty libfo), and where its run
    writes: (kit, out)."""
    kit, out = tmp_path / "kit", tmp_path / "out"
    (kit / "tests").mkdir(parents=True)
    (kit / "libfo.so").write_bytes(b"")
    fo = kit / "fo"
    fo.write_text("#!/bin/sh\n" + fo_script)
    fo.chmod(0o755)
    return kit, out


def test_a_hung_step_times_out_and_the_rest_are_skipped_within_the_budget(tmp_path):
    kit, out = fake_kit(tmp_path, "echo selftest started\nsleep 60\n")
    r = run("run", "checks", "13", FO_GPU_KIT=str(kit), FO_GPU_KIT_ANYWAY="1", OUT=str(out))
    assert r.returncode == 0, r.stderr
    summary = (out / "SUMMARY.txt").read_text().splitlines()
    steps = {line.split()[0]: line for line in summary if line.split() and line.split()[0] in
             ("selftest", "gpu_abi", "optim_api", "comm_nccl", "unit_device", "pytest_cuda")}
    assert "timeout" in steps["selftest"] and "selftest started" in steps["selftest"], summary
    assert "selftest started" in (out / "selftest.log").read_text()
    # 13 s: the selftest's timeout leaves under 10 s, so every later step is skipped, not run.
    for name in ("gpu_abi", "optim_api", "comm_nccl", "unit_device", "pytest_cuda"):
        assert "skipped" in steps[name] and "budget" in steps[name], summary


def test_the_logs_travel_as_one_archive_when_asked(tmp_path):
    """FO_GPU_KIT_TAR=1: the device tool returns a few files from $OUT, so the logs go back
    as one archive beside SUMMARY.txt."""
    import tarfile

    kit, out = fake_kit(tmp_path, "echo selftest ran\n")
    r = run("run", "checks", "11", FO_GPU_KIT=str(kit), FO_GPU_KIT_ANYWAY="1", FO_GPU_KIT_TAR="1", OUT=str(out))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["SUMMARY.txt", "logs-checks.tgz"]
    with tarfile.open(out / "logs-checks.tgz") as t:
        assert b"selftest ran" in t.extractfile("./selftest.log").read()


def test_a_steps_last_line_is_cut_at_110_characters_not_bytes(tmp_path):
    """SUMMARY.txt shows each step's last line cut at 110 characters; cut by bytes, a UTF-8
    character at the cut (timeout's quotes under LANG=C.UTF-8) left invalid text."""
    line = "x" * 108 + "\u2018\u2019\u2026 tail"
    kit, out = fake_kit(tmp_path, f"echo '{line}'\n")
    r = run("run", "checks", "11", FO_GPU_KIT=str(kit), FO_GPU_KIT_ANYWAY="1", OUT=str(out), LANG="C.UTF-8",
            LC_ALL="C.UTF-8")
    assert r.returncode == 0, r.stderr
    summary = (out / "SUMMARY.txt").read_bytes().decode("utf-8")  # strict: valid UTF-8
    (shown,) = [ln for ln in summary.splitlines() if ln.startswith("selftest ")]
    assert shown.endswith(line[:110]), shown


def test_profile_splits_a_step_and_reads_counters_only_where_ncu_is(tmp_path):
    """`run profile` (a dry run here): the step split runs and, without ncu on the PATH, the
    counters' step says why it was skipped."""
    kit, out = fake_kit(tmp_path, "echo fo\n")
    env = dict(FO_GPU_KIT=str(kit), FO_GPU_KIT_ANYWAY="1", OUT=str(out))
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if not os.path.exists(os.path.join(d, "ncu")))
    r = run("run", "profile", "60", PATH=os.path.dirname(sys.executable) + os.pathsep + path, **env)
    assert r.returncode == 0, r.stderr
    summary = (out / "SUMMARY.txt").read_text()
    lines = {line.split()[0]: line for line in summary.splitlines() if line.split()}
    # No GPU here: the script says so and exits 2, which the step records.
    assert "rc=2" in lines["profile_gpu_step"] and "profile_gpu_step:" in lines["profile_gpu_step"], summary
    assert "skipped" in lines["ncu_step_p4"] and "no ncu" in lines["ncu_step_p4"], summary
    assert "selftest" not in lines  # the checks are not part of it


def test_overlap_times_fsdp2_at_three_pool_sizes_and_needs_a_gpu(tmp_path):
    """`run overlap` (a dry run here): bench_fsdp2_overlap.py at fo's pool of every core, all
    but one and half, each on the GPU, so without one each step refuses at once (rc 2); then
    `fo bench overlap --backward launch` at every core and all but one."""
    pytest.importorskip("torch")  # the benchmark needs torch to say there is no GPU
    kit, out = fake_kit(tmp_path, "echo fo\n")
    r = run("run", "overlap", "120", FO_GPU_KIT=str(kit), FO_GPU_KIT_ANYWAY="1", OUT=str(out))
    assert r.returncode == 0, r.stderr
    summary = (out / "SUMMARY.txt").read_text()
    lines = {line.split()[0]: line for line in summary.splitlines() if line.split()}
    cores = len(os.sched_getaffinity(0))
    sizes = sorted({t for t in (cores, cores - 1, cores // 2) if t >= 1}, reverse=True)
    steps = [name for name in lines if name.startswith("fsdp2_overlap_t")]
    assert sorted(steps) == sorted(f"fsdp2_overlap_t{t}" for t in sizes), summary
    for name in steps:
        assert "rc=2" in lines[name] and "torch sees no GPU" in lines[name], summary
    # Then the host's own model of that backward (the kit's fo: a stand-in that echoes).
    launch = [name for name in lines if name.startswith("bench_overlap_launch_t")]
    assert sorted(launch) == sorted(f"bench_overlap_launch_t{t}" for t in {cores, cores - 1} if t >= 1), summary
    assert "selftest" not in lines and "bench_fsdp2_overlap" not in lines
