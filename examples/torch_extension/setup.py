"""Builds the example extension against the installed torch and fo (`pip install .` at the
repository root, or a checkout with FO_LIBRARY / PYTHONPATH=python):

    pip install --no-build-isolation examples/torch_extension     # or:
    python examples/torch_extension/setup.py build_ext --inplace

It compiles against fo.h (`fo.get_include()`) and links the libfo.so that `import fo`
loads (`fo.library_path`), with an rpath to it, so the extension and the ctypes binding
use the same library file."""
import os
from pathlib import Path

import fo
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = Path(__file__).resolve().parent
libdir = str(Path(fo.library_path).resolve().parent)
libname = Path(fo.library_path).name
link = [f"-l:{libname}"] if libname != "libfo.so" else ["-lfo"]

setup(
    name="fo_torch_ext",
    version=fo.version(),
    ext_modules=[CppExtension(
        "fo_torch_ext",
        [os.path.relpath(HERE / "fo_torch_ext.cpp", os.getcwd())],
        include_dirs=[fo.get_include()],
        depends=[os.path.join(fo.get_include(), "fo.h")],  # a new header (ABI) rebuilds the cached module
        library_dirs=[libdir],
        extra_link_args=link + [f"-Wl,-rpath,{libdir}"],
        extra_compile_args=["-O2"],
    )],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
)
