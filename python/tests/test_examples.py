"""The examples and every documented code block run as a user runs them: Python blocks as
scripts (binding on PYTHONPATH, library through FO_LIBRARY), C/C++ blocks as the files ctest
builds, `fo` command lines against the binary's own --help, and every path and link the
docs name exists. A block that cannot run (a fragment) says so with a preceding
`<!-- not-run: reason -->` line, and such blocks stay rare."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"<!-- not-run: (.+?) -->\s*$")
MAX_NOT_RUN = 3  # fragments are the exception: each one is a block nobody checks


def run(args, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def blocks(path, langs):
    """(lang, code, first line, not-run reason or None) of each fenced block of `langs`."""
    out, lines, i = [], path.read_text().splitlines(keepends=True), 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        lang, start = lines[i][3:].strip(), i + 1
        end = next((j for j in range(start, len(lines)) if lines[j].startswith("```")), len(lines))
        prev = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
        reason = NOT_RUN.search(prev)
        if lang in langs:
            out.append((lang, "".join(lines[start:end]), start, reason.group(1) if reason else None))
        i = end + 1
    return out


def all_blocks(langs):
    return [(p, *b) for p in DOCS for b in blocks(p, langs)]


def readme_blocks(lang):
    return [code for _, code, _, _ in blocks(ROOT / "README.md", {lang})]


PY_BLOCKS = all_blocks({"python"})


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


def test_readme_has_one_example_per_language():
    py = readme_blocks("python")
    assert len(readme_blocks("cpp")) == 1 and len(py) == 2, "C++, Python and torch: one each"
    assert sum("import torch" in code for code in py) == 1


@pytest.mark.parametrize("path,lang,code,line,reason", PY_BLOCKS,
                         ids=[f"{p.relative_to(ROOT)}:{line}" for p, _, _, line, _ in PY_BLOCKS])
def test_documented_python_block_runs(tmp_path, path, lang, code, line, reason):
    if reason:
        pytest.skip(f"marked not-run: {reason}")
    if "import torch" in code and importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch (run in the torch venv's pytest)")
    r = run(["-c", code], tmp_path)
    assert r.returncode == 0, f"{path.name}:{line}\n{code}\n{r.stdout}{r.stderr}"


def test_documented_c_blocks_are_files_ctest_builds():
    # ctest's examples_cpp builds and runs examples/cpp/*.cpp; a C/C++ block is one of them,
    # verbatim, or a marked fragment.
    built = {p.read_text() for p in (ROOT / "examples" / "cpp").glob("*.cpp")}
    cmake = (ROOT / "examples" / "cpp" / "CMakeLists.txt").read_text()
    for p in (ROOT / "examples" / "cpp").glob("*.cpp"):
        assert f"{p.name})" in cmake or f"{p.name} " in cmake, f"{p.name} is not built by examples/cpp/CMakeLists.txt"
    unchecked = []
    for path, lang, code, line, reason in all_blocks({"c", "cpp", "c++"}):
        if reason is None and code not in built:
            unchecked.append(f"{path.relative_to(ROOT)}:{line}")
    assert not unchecked, ("these C/C++ blocks are neither a file of examples/cpp/ (built by ctest) nor marked "
                           f"<!-- not-run: reason -->: {unchecked}")


def test_not_run_markers_are_rare_and_say_why():
    marked = [(p, line, reason) for p, _, _, line, reason in all_blocks({"python", "c", "cpp", "c++"}) if reason]
    assert len(marked) <= MAX_NOT_RUN, f"too many blocks nobody runs: {marked}"
    for p, line, reason in marked:
        assert len(reason.split()) >= 4, f"{p.name}:{line}: say why the block cannot run, and what runs instead"
    # A marker must sit right above a block; a stray one hides nothing and means a typo.
    for p in DOCS:
        lines = p.read_text().splitlines()
        for i, ln in enumerate(lines):
            if NOT_RUN.search(ln):
                nxt = next((x for x in lines[i + 1:] if x.strip()), "")
                assert nxt.startswith("```"), f"{p.name}:{i + 1}: a not-run marker must precede a code block"


def fo_binary():
    lib = os.environ.get("FO_LIBRARY")
    for d in ([Path(lib).parent] if lib else []) + [ROOT / "target" / "release", ROOT / "target" / "debug"]:
        if (d / "fo").is_file():
            return d / "fo"
    pytest.skip("the fo binary is not built (cargo build --release)")


def subcommands(fo, *path):
    out = subprocess.run([str(fo), *path, "--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    section = out.split("Commands:", 1)[1].split("\n\n", 1)[0] if "Commands:" in out else ""
    return {m.group(1) for m in re.finditer(r"^  ([a-z][a-z-]*)", section, re.M)} - {"help"}, out


def fo_command_lines():
    """(file, line, words after `fo`) for each `fo ...` line of a shell block and each
    inline `fo ...` span (also spelled `cargo run --release --bin fo -- ...`)."""
    prefix = r"(?:cargo run --release --bin fo --|fo)\s+([a-z-][^`\n]*)"
    found = []
    for path, lang, code, line, _ in all_blocks({"sh", "bash", "console"}):
        for k, ln in enumerate(code.splitlines()):
            m = re.match(prefix + "$", ln.split(" #", 1)[0].strip().lstrip("$ "))
            if m:
                found.append((path, line + k, m.group(1)))
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"`" + prefix.replace("\\n", "") + "`", text):  # a span may wrap a line
            found.append((path, text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())))
    return found


def test_documented_fo_commands_and_flags_exist():
    # Every documented `fo` command line names commands that exist, and every --flag on
    # it is in that command's --help.
    fo = fo_binary()
    cache, problems = {}, []

    def help_of(cmd):
        if cmd not in cache:
            cache[cmd] = subcommands(fo, *cmd)
        return cache[cmd]

    lines = fo_command_lines()
    assert len(lines) > 20
    for path, line, rest in lines:
        words, cmd = rest.split(), ()
        while words:
            subs, _ = help_of(cmd)
            if not subs or not re.fullmatch(r"[a-z][a-z|-]*", words[0]):
                break
            alternatives = words.pop(0).split("|")
            bad = [a for a in alternatives if a not in subs]
            if bad:
                problems.append(f"{path.name}:{line}: `fo {' '.join(cmd)} {bad[0]}` is not a command")
                break
            if len(alternatives) > 1:
                break
            cmd += (alternatives[0],)
        help_text = help_of(cmd)[1]
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", " ".join(words)):
            if not re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", help_text, re.M):
                problems.append(f"{path.name}:{line}: `fo {' '.join(cmd)}` has no {flag}")
        # Inside [...], a concrete value after a flag is its default (docs/cli.md's table).
        for optional in re.findall(r"\[([^\]]*)\]", " ".join(words)):
            for flag, value in re.findall(r"(--[a-z][a-z0-9-]*) ([^\s\]]+)", optional):
                if re.fullmatch(r"[A-Z]+", value):
                    continue  # a placeholder (N, DIR), not a default
                opt = re.search(rf"^\s+(?:-\w, )?{re.escape(flag)} <.*$", help_text, re.M)
                if not opt or f"[default: {value}]" not in opt.group(0):
                    problems.append(f"{path.name}:{line}: `fo {' '.join(cmd)} {flag}` does not default to {value}")
    assert not problems, "\n".join(problems)


PATH_RE = re.compile(r"(?<![\w./-])((?:src|docs|examples|python|cpp_tests|tests|scripts|benches|fuzz|include)"
                     r"/[\w./*-]*[\w*/])")


def test_every_path_the_docs_name_exists():
    missing = []
    for p in DOCS:
        for m in PATH_RE.finditer(p.read_text()):
            name = m.group(1).rstrip(".")
            if not list(ROOT.glob(name.rstrip("/"))):
                missing.append(f"{p.relative_to(ROOT)}: {name}")
    assert not missing, "the docs name paths that do not exist (moved? update the docs):\n" + "\n".join(missing)


def slug(title):
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower().replace("`", "")).replace(" ", "-")


def test_every_link_between_docs_resolves():
    anchors = {p.name: {slug(h) for h in re.findall(r"^#+ (.+)$", p.read_text(), re.M)} for p in DOCS}
    broken = []
    for p in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", p.read_text()):
            if re.match(r"\w+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (p.parent / file).resolve() if file else p
            if not dest.exists():
                broken.append(f"{p.name}: {target}")
            elif anchor and anchor not in anchors.get(dest.name, set()):
                broken.append(f"{p.name}: {target} (no such heading)")
    assert not broken, broken


def test_readme_layout_names_every_top_level_module():
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1]
    for entry in sorted((ROOT / "src").iterdir()):
        name = f"src/{entry.name}" + ("/" if entry.is_dir() else "")
        assert name in layout, f"README's layout does not mention {name}"


def test_readme_fits_on_a_few_screens_and_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    sh = readme_blocks("sh")
    assert "cargo run --release --bin fo -- demo\n" in sh and "scripts/test.sh\n" in sh
    docs = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert docs and all(f"docs/{d}" in text for d in docs), "the README's map lists every docs/ page"


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
