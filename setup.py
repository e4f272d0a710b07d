"""`pip install .` (here or in python/): builds libfo.so with cargo and installs the `fo`
package with the library and the C header inside it, so `import fo` needs no FO_LIBRARY.

Why plain setuptools driving `cargo build` (and not setuptools-rust, maturin or
scikit-build-core): fo ships a C-ABI cdylib loaded through ctypes, with no Python binding
crate. setuptools-rust builds it with `cargo rustc --crate-type cdylib`, whose fingerprint
differs from the `cargo build --release` that cargo test, CMake and the CLI use, so on a
shared target/ every alternation recompiled the crate (measured 32 s each way on this
machine); maturin expects a pyo3/cffi/uniffi binding or a binary; scikit-build-core would
route through CMake only to call cargo. `cargo build --release --lib` here is the same
command CMakeLists.txt runs, so after the project's own build it is a no-op.

Environment: CARGO (default cargo), CARGO_TARGET_DIR (default <repo>/target),
FO_CARGO_FEATURES (e.g. "cuda").
"""
import json
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# Paths relative to where pip runs the build: the repository root or python/.
SRC = os.path.relpath(ROOT / "python", os.getcwd())


def cargo_target_dir():
    out = subprocess.run([os.environ.get("CARGO", "cargo"), "metadata", "--format-version", "1", "--no-deps",
                          "--manifest-path", str(ROOT / "Cargo.toml")], check=True, capture_output=True, text=True)
    return Path(json.loads(out.stdout)["target_directory"])


class BuildWithLibfo(build_py):
    """build_py, plus libfo.so and include/fo.h copied into the built package."""

    def run(self):
        super().run()
        cmd = [os.environ.get("CARGO", "cargo"), "build", "--release", "--lib", "--manifest-path", str(ROOT / "Cargo.toml")]
        if os.environ.get("FO_CARGO_FEATURES"):
            cmd += ["--features", os.environ["FO_CARGO_FEATURES"]]
        self.announce("running " + " ".join(cmd), level=2)
        subprocess.run(cmd, check=True, cwd=ROOT)
        pkg = Path(self.build_lib) / "fo"
        shutil.copyfile(cargo_target_dir() / "release" / "libfo.so", pkg / "libfo.so")
        (pkg / "include").mkdir(exist_ok=True)
        shutil.copyfile(ROOT / "include" / "fo.h", pkg / "include" / "fo.h")


class BinaryDistribution(Distribution):
    """The wheel holds a native library: tag it for this platform, not py3-none-any."""

    def has_ext_modules(self):
        return True


setup(
    name="fo",
    version="0.2.0",
    description="Memory-efficient optimizer steps and distributed checkpoint state (ctypes binding of libfo)",
    license="Apache-2.0",
    python_requires=">=3.9",
    install_requires=["numpy>=1.26"],
    extras_require={"bf16": ["ml_dtypes>=0.4"], "checkpoints": ["safetensors>=0.4"], "torch": ["torch>=2.4"]},
    package_dir={"": SRC},
    packages=find_packages(where=SRC, include=["fo", "fo.*"]),
    package_data={"fo": ["py.typed"]},
    cmdclass={"build_py": BuildWithLibfo},
    distclass=BinaryDistribution,
    # Keep setuptools' scratch out of the source tree (build/ is CMake's).
    options={"build": {"build_base": os.path.relpath(ROOT / "target" / "pybuild", os.getcwd())}},
)
