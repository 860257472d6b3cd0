"""The layering the build enforces: scripts/check-layers.py over the tree
passes, and on planted trees it finds an include that points up, one that
points across a layer, a ../ include, one that names nothing, a directory
cycle, and a CMake layer library that links upward."""

import importlib.util
import os
import pathlib
import subprocess
import sys

SRC = pathlib.Path(os.environ.get("TANDEM_SOURCE_DIR", pathlib.Path(__file__).parents[2]))
SCRIPT = SRC / "scripts/check-layers.py"
spec = importlib.util.spec_from_file_location("check_layers", SCRIPT)
layers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layers)


def plant(root, files):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_tree_keeps_its_layers():
    p = subprocess.run([sys.executable, str(SCRIPT), str(SRC)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert " 0 cycles, 0 violations" in p.stdout, p.stdout
    # the graph it reports is the real one: the executor reaches the engine,
    # the transfer reaches the executor, and not the other way round
    assert "  common/parallel -> common/engine:" in p.stdout
    assert "  common/transfer -> common/parallel:" in p.stdout
    assert "common/parallel -> common/transfer" not in p.stdout
    assert "common/model -> common/tokenizer" in p.stdout
    assert "common/tokenizer -> common/model" not in p.stdout


def test_a_clean_planted_tree_passes(tmp_path):
    plant(tmp_path, {
        "common/base/base.h": "",
        "common/kv/kv.h": '#include "common/base/base.h"\n',
        "common/kv/kv.c": '#include "kv.h"\n#include <stdio.h>\n',
    })
    edges, bad = layers.scan(tmp_path)
    assert bad == []
    assert edges == {("common/kv", "common/base"): 1}


def test_planted_bad_includes_are_found(tmp_path):
    plant(tmp_path, {
        "common/base/base.h": "",
        "common/kv/kv.h": '#include "common/base/base.h"\n',
        # up: the KV pool reaching for the scheduler
        "common/kv/kv.c": '#include "kv.h"\n\n#include "common/sched/sched.h"\n',
        "common/sched/sched.h": '#include "common/kv/kv.h"\n',
        # across: one service including another
        "router/main.c": '#include "tools/tools.h"\n',
        "tools/tools.h": "",
        # a relative path out of the directory
        "common/obs/metrics.c": '#include "../base/base.h"\n',
        # nothing by that name
        "common/api/http.c": '#include "common/api/nowhere.h"\n',
    })
    edges, bad = layers.scan(tmp_path)
    assert bad == [
        'common/api/http.c:1: #include "common/api/nowhere.h": names no file of the tree',
        'common/kv/kv.c:3: #include "common/sched/sched.h": points up (kv -> sched)',
        'common/obs/metrics.c:1: #include "../base/base.h": a ../ include '
        '(name the header from the source root)',
        'router/main.c:1: #include "tools/tools.h": points across (router -> tools, one layer)',
    ], bad
    assert layers.cycles(edges) == [["common/kv", "common/sched", "common/kv"]]


def test_tests_and_benchmarks_are_outside(tmp_path):
    plant(tmp_path, {
        "router/router.h": "",
        "tests/unit/test_x.c": '#include "router/router.h"\n',
        "tools/bench/router_bench.c": '#include "router/router.h"\n',
    })
    assert layers.scan(tmp_path) == ({}, [])


def test_an_upward_cmake_link_is_found(tmp_path):
    plant(tmp_path, {"CMakeLists.txt": """
function(td_layer name dir)
endfunction()
td_layer(td_base common/base m)
td_layer(td_kv common/kv td_base
  td_sched)  # up
td_layer(td_sched common/sched td_kv td_base)
td_layer(td_api common/api td_sched td_transfer)
td_layer(td_transfer common/transfer td_api)
"""})
    assert layers.cmake_violations(tmp_path) == [
        "CMakeLists.txt: td_api (common/api) links td_transfer (common/transfer), "
        "which is not below it",
        "CMakeLists.txt: td_kv (common/kv) links td_sched (common/sched), which is not below it",
    ]
