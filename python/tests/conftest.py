import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
ORACLE = ROOT / "tests" / "oracle"

# torch's own C++ teardown can abort a worker with this line: gloo's worker thread frees the
# last collective's tensors while the interpreter finalizes (a core dump showed ~AsyncWork in
# ProcessGroupGloo::runLoop taking the GIL from Py_FinalizeEx). It failed 1 launch in 2 with
# both cores busy; the workers now skip finalization (`exit_skipping_finalization`), which
# passed 12 of 12 launches under the same load. The one relaunch stays as a safety net.
TORCH_TEARDOWN_ABORT = "terminate called without an active exception"


@pytest.fixture(autouse=True)
def torch_on_one_thread():
    """Every test computes torch's host ops on one intra-op thread, as scripts/test.sh runs
    the suite (OMP_NUM_THREADS=1), whatever the caller's environment: fo.torch's overlapped
    step leaves the cores to a host backward whose torch threads cover them all (no early
    steps), so on a 16-core GPU machine without OMP_NUM_THREADS the overlap tests' host
    models handed nothing over in backward. Tests of that rule set the count themselves."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def torchrun(nproc, script, *args):
    """Runs `script` under torchrun on `nproc` gloo ranks and returns its stdout. A launch
    that fails only by torch's teardown abort is run once more (and says so on stderr);
    any other failure fails the test with the launch's output."""
    import os
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "python"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(script), *map(str, args)]
    for attempt in (1, 2):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if r.returncode == 0:
            return r.stdout
        if attempt == 1 and TORCH_TEARDOWN_ABORT in r.stderr:
            print(f"torchrun {script.name}: torch's teardown abort; launching once more", file=sys.stderr)
            continue
        break
    raise AssertionError(r.stdout[-4000:] + r.stderr[-8000:])


def run_script(script, *args, timeout=300):
    """Runs a scripts/ file with this interpreter and fo's package on the path, every GPU
    hidden (CUDA_VISIBLE_DEVICES="": "no GPU" holds on a GPU machine too)."""
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def load_script(script):
    """A scripts/ file imported as a module (its functions tested without running main)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(script).stem, script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
