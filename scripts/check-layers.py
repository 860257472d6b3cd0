#!/usr/bin/env python3
"""The include graph of the product's sources against its layers.

The layers, lowest first (docs/ARCHITECTURE.md): a source may include a
header of its own directory or of a lower layer, never one of a higher
layer and never one of another directory on its own layer (kernels/cpu and
kernels/cuda; the services prefill/, decode/, router/ and tools/). Includes
name headers by their path from the source root ("common/kv/kv.h") or, in
the same directory, by their name; a "../" include is an error, as is one
that names no file of the tree. tests/ and tools/bench/ (the benchmark
drivers) are outside the product and may include anything.

It also checks the CMake layer libraries (td_layer(NAME DIR DEPS...) in
CMakeLists.txt): each links only libraries of lower layers.

Prints the directory graph (each edge with its include count) and any
cycle in it, then the violations; exits 1 if there is any.
Usage: scripts/check-layers.py [SOURCE_DIR]"""

import os
import pathlib
import re
import subprocess
import sys

# (layer, directories); a directory's subdirectories are their own entries.
LAYERS = [
    ("kernels", ["kernels"]),
    ("kernel sets", ["kernels/cpu", "kernels/cuda"]),
    ("base", ["common/base"]),
    ("obs", ["common/obs"]),
    ("format", ["common/format", "proto"]),
    ("template", ["common/template"]),
    ("tokenizer", ["common/tokenizer"]),
    ("grammar", ["common/grammar"]),
    ("model", ["common/model"]),
    ("kv", ["common/kv"]),
    ("backend", ["common/backend"]),
    ("comm", ["common/comm"]),
    ("engine", ["common/engine"]),
    ("parallel", ["common/parallel"]),
    ("sched", ["common/sched"]),
    ("route", ["common/route"]),
    ("api", ["common/api"]),
    ("transfer", ["common/transfer"]),
    ("runtime", ["common/runtime"]),
    ("serve", ["common/serve"]),
    ("planner", ["planner"]),
    ("services", ["prefill", "decode", "router", "tools"]),
]
LEVEL = {d: i for i, (_, dirs) in enumerate(LAYERS) for d in dirs}
OUTSIDE = ("tests/", "tools/bench/", "build")
EXTS = {".c", ".h", ".cu", ".cuh"}
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.M)
# td_layer(NAME DIR DEP...) in CMakeLists.txt, over one or more lines
CMAKE_LAYER = re.compile(r"^td_layer\(([^)]*)\)", re.M)


def tree_files(root):
    p = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard"],
                       capture_output=True, text=True)
    if p.returncode == 0 and p.stdout.strip():
        return sorted(f for f in p.stdout.splitlines() if (root / f).is_file())
    return sorted(f.relative_to(root).as_posix() for f in root.rglob("*") if f.is_file())


def resolve(root, files, src, inc):
    """The tree path an include names, or None."""
    if "/" in inc and inc in files:
        return inc
    if inc.startswith("proto/") and inc.endswith(".pb-c.h"):
        proto = inc[: -len(".pb-c.h")] + ".proto"  # generated at build time
        return inc if proto in files else None
    local = os.path.normpath(os.path.join(os.path.dirname(src), inc))
    return local if local in files else None


def scan(root):
    """(edges {(from_dir, to_dir): count}, violations [str])."""
    files = set(tree_files(root))
    edges, bad = {}, []
    for src in sorted(files):
        if pathlib.PurePath(src).suffix not in EXTS or src.startswith(OUTSIDE):
            continue
        d = os.path.dirname(src)
        if d not in LEVEL:
            bad.append(f"{src}: its directory {d or '.'} is on no layer")
            continue
        text = (root / src).read_text(errors="replace")
        for m in INCLUDE.finditer(text):
            inc = m.group(1)
            line = text.count("\n", 0, m.start()) + 1
            where = f'{src}:{line}: #include "{inc}"'
            if ".." in pathlib.PurePath(inc).parts:
                bad.append(f"{where}: a ../ include (name the header from the source root)")
                continue
            target = resolve(root, files, src, inc)
            if target is None:
                bad.append(f"{where}: names no file of the tree")
                continue
            td = os.path.dirname(target)
            if td == d:
                continue
            edges[(d, td)] = edges.get((d, td), 0) + 1
            if td not in LEVEL:
                bad.append(f"{where}: {td} is on no layer")
            elif LEVEL[td] > LEVEL[d]:
                bad.append(f"{where}: points up ({LAYERS[LEVEL[d]][0]} -> "
                           f"{LAYERS[LEVEL[td]][0]})")
            elif LEVEL[td] == LEVEL[d]:
                bad.append(f"{where}: points across ({d} -> {td}, one layer)")
    return edges, bad


def cycles(edges):
    """Every elementary cycle's directories, found by depth-first search."""
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    found, seen = [], set()

    def walk(node, path):
        for nxt in sorted(graph.get(node, ())):
            if nxt == path[0]:
                key = frozenset(path)
                if key not in seen:
                    seen.add(key)
                    found.append(path + [nxt])
            elif nxt not in path and nxt > path[0]:
                walk(nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


def cmake_violations(root):
    """td_layer() libraries that link a library of their own or a higher layer."""
    lists = root / "CMakeLists.txt"
    if not lists.is_file():
        return []
    text = re.sub(r"#[^\n]*", "", lists.read_text())
    layers = {}
    for m in CMAKE_LAYER.finditer(text):
        words = m.group(1).split()
        if len(words) >= 2 and words[0] != "name":  # not the function's own definition
            layers[words[0]] = (words[1], [w for w in words[2:] if w.startswith("td_")])
    bad = []
    for name, (d, deps) in sorted(layers.items()):
        if d not in LEVEL:
            bad.append(f"CMakeLists.txt: {name} builds {d}, which is on no layer")
            continue
        for dep in deps:
            if dep in layers and layers[dep][0] in LEVEL and \
                    LEVEL[layers[dep][0]] >= LEVEL[d]:
                bad.append(f"CMakeLists.txt: {name} ({d}) links {dep} "
                           f"({layers[dep][0]}), which is not below it")
    return bad


def main(argv):
    root = pathlib.Path(argv[1] if len(argv) > 1 else pathlib.Path(__file__).parents[1])
    edges, bad = scan(root)
    bad += cmake_violations(root)
    print("include graph (directory -> directory: includes):")
    for (a, b), n in sorted(edges.items()):
        print(f"  {a} -> {b}: {n}")
    loops = cycles(edges)
    for c in loops:
        bad.append("cycle: " + " -> ".join(c))
    print(f"{len(edges)} edges, {len(loops)} cycles, {len(bad)} violations")
    for b in bad:
        print("  " + b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
