#!/usr/bin/env python3
"""The import graph of src/: which room (top-level module, `optim::math` counted as its own
room `math`, ckpt's four sub-rooms each their own) uses which, read from every `crate::` and `super::` path in the Rust source.
Test modules are left out (they may reach anywhere). Rooms sit on floors, lowest first
(FLOORS); an arrow from a room to one on a higher floor
runs back up. Prints the rooms' arrows, every arrow that runs back up with the files that
make it, and every circle of rooms (strongly connected set), then checks the counts.

    python3 scripts/import_graph.py                       # the picture
    python3 scripts/import_graph.py --max-back N --max-circles M   # fails above those counts

scripts/test.sh runs it with today's counts, so the house gets no new arrow running back up
and no new circle; each restructuring lowers the counts there.
"""
import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

# Lowest first: a room may use rooms on its own floor or below.
FLOORS = [
    ["error", "sync", "codes"],  # codes: the code_table! macro every coded enum uses
    ["dtype", "sys"],
    ["tensor", "cast"],
    ["shard"],
    ["math"],  # rules, quant8, master split (today optim::math)
    ["kernels"],
    ["device"],
    ["comm"],
    ["clip", "broadcast"],
    ["optim"],
    # checkpoints by job, and ckpt/mod.rs's re-exports (the public surface) over them
    ["ckpt::format"],
    ["ckpt::save"],
    ["ckpt::load"],
    ["ckpt::tools"],
    ["ckpt"],
    ["ffi"],
    ["bin"],
]
CKPT_ROOMS = ("format", "save", "load", "tools")
FLOOR = {room: i for i, names in enumerate(FLOORS) for room in names}
PATH = re.compile(r"\b(crate|super)((?:::\w+)+)")
USE_GROUP = re.compile(r"\buse\s+(crate|super)((?:::\w+)*)::\{([^;]*)\};", re.S)


def module_of(src, f):
    """The module path of file f under src (`optim::overlap`; a mod.rs is its folder's)."""
    parts = list(f.relative_to(src).with_suffix("").parts)
    if parts[0] == "bin":
        return ["bin"]
    return parts[:-1] if parts[-1] in ("mod", "lib") else parts


def room(path):
    if not path:
        return None
    if path[0] == "optim" and len(path) > 1 and path[1] == "math":
        return "math"
    if path[0] == "ckpt" and len(path) > 1 and path[1] in CKPT_ROOMS:
        return f"ckpt::{path[1]}"
    return path[0]


TEST_MOD = re.compile(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{")


def is_test_file(f):
    return f.name == "tests.rs" or f.stem.endswith("_tests")


def strip_comments(text):
    """The code without comments and without its inline test module (tests may reach
    anywhere: they are not part of the house)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = "\n".join(line.split("//")[0] for line in text.splitlines())
    # `pub(in crate::x)` limits who sees an item; it imports nothing.
    text = re.sub(r"pub\(in\s+[\w:]+\)", "pub", text)
    m = TEST_MOD.search(text)
    return text[:m.start()] if m else text


def targets(text, mod):
    """Absolute module paths this file names through crate:: and super::."""
    out = []

    def resolve(root, rest):
        segs = [s for s in rest.split("::") if s]
        if root == "crate":
            return segs
        base = list(mod[:-1])  # `super`: the parent of this file's module (mod.rs or not)
        while segs and segs[0] == "super":
            base = base[:-1]
            segs = segs[1:]
        return base + segs

    for m in USE_GROUP.finditer(text):
        root, prefix = m.group(1), m.group(2)
        for item in m.group(3).split(","):
            item = item.strip().split(" as ")[0].strip()
            if item and item != "self":
                out.append(resolve(root, prefix + "::" + item.split("::")[0]))
            elif item == "self":
                out.append(resolve(root, prefix))
    text = USE_GROUP.sub("", text)
    for m in PATH.finditer(text):
        out.append(resolve(m.group(1), m.group(2)))
    return out


def graph(src):
    arrows = defaultdict(set)  # (from room, to room) -> files
    for f in sorted(src.rglob("*.rs")):
        if is_test_file(f):
            continue
        mod = module_of(src, f)
        here = room(mod)
        if here is None:
            continue  # lib.rs: the table of contents names every room
        for t in targets(strip_comments(f.read_text()), mod):
            there = room(t)
            if there and there != here and there in FLOOR:
                arrows[(here, there)].add(str(f.relative_to(src.parent)))
    return arrows


def circles(arrows):
    """Strongly connected sets of more than one room (Tarjan)."""
    nodes = sorted({a for a, _ in arrows} | {b for _, b in arrows})
    succ = defaultdict(list)
    for a, b in arrows:
        succ[a].append(b)
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in nodes:
        if v not in index:
            visit(v)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    ap.add_argument("--max-back", type=int, default=None, help="fail if more arrows run back up")
    ap.add_argument("--max-circles", type=int, default=None, help="fail if there are more circles")
    a = ap.parse_args()
    arrows = graph(Path(a.src))
    back = sorted((k, v) for k, v in arrows.items() if FLOOR[k[0]] < FLOOR[k[1]])
    rings = circles(arrows)
    print(f"{len(arrows)} arrows between {len({r for k in arrows for r in k})} rooms "
          f"(floors, lowest first: {' < '.join('/'.join(f) for f in FLOORS)})")
    print(f"{len(back)} arrows run back up:")
    for (a_, b), files in back:
        shown = ", ".join(sorted(files)[:4]) + (f" (+{len(files) - 4} more)" if len(files) > 4 else "")
        print(f"  {a_} (floor {FLOOR[a_]}) -> {b} (floor {FLOOR[b]}): {shown}")
    print(f"{len(rings)} circles of rooms:")
    for r in rings:
        print("  " + " <-> ".join(r))
    failed = []
    if a.max_back is not None and len(back) > a.max_back:
        failed.append(f"{len(back)} arrows run back up (at most {a.max_back})")
    if a.max_circles is not None and len(rings) > a.max_circles:
        failed.append(f"{len(rings)} circles (at most {a.max_circles})")
    if failed:
        print("import graph: " + "; ".join(failed) + ": a change added an import that runs back up", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
