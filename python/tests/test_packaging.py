"""`pip install .` from the repository root and from python/ into a throwaway venv: the
installed package carries libfo.so and fo.h, and imports and steps with FO_LIBRARY and
PYTHONPATH unset, from a directory outside the repository.

The venv borrows this interpreter's site-packages (numpy, setuptools) through a .pth file
and pip runs with --no-build-isolation --no-deps, so nothing is downloaded; cargo reuses the
repository's target/ (a no-op after the project's own release build)."""
import os
import subprocess
import sys
import sysconfig
import time

import pytest

from conftest import ROOT

SMOKE = """
import os, sys, numpy as np, fo
here = sys.argv[1]
assert fo.__file__.startswith(here), fo.__file__
assert str(fo.library_path).startswith(here), fo.library_path
assert fo.get_include().startswith(here) and os.path.isfile(os.path.join(fo.get_include(), "fo.h"))
w = np.ones(4, np.float32)
opt = fo.Optimizer("sgd", lr=0.5, master_weight_bits=0)
opt.add_param("w", w)
opt.step([np.full(4, 2.0, np.float32)])
assert (w == 0.0).all(), w
print("ok", fo.version())
"""


def pip_available():
    return subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not pip_available(), reason="this interpreter has no pip")
@pytest.mark.parametrize("source", [".", "python"])
def test_pip_install_builds_libfo_into_the_package_and_imports_without_fo_library(tmp_path, source):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "borrowed.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("FO_LIBRARY", "PYTHONPATH")}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-build-isolation",
                          "--no-deps", "--no-cache-dir", "-q", str(ROOT / source)],
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    print(f"pip install {source}: {time.monotonic() - t0:.1f} s")
    pkg = os.path.join(site, "fo")
    assert os.path.isfile(os.path.join(pkg, "libfo.so")) and os.path.isfile(os.path.join(pkg, "py.typed"))
    assert os.path.isfile(os.path.join(pkg, "include", "fo.h"))
    run = subprocess.run([str(py), "-c", SMOKE, site], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("ok 0.2.0"), run.stdout + run.stderr
