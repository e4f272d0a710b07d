"""`pip install .` from python/: the repository root's setup.py does the work (it builds
libfo.so with cargo, which needs the whole repository)."""
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent.parent / "setup.py"), run_name="__main__")
