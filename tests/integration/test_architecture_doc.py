"""docs/ARCHITECTURE.md matches the tree: every directory it names (a
backticked path ending in `/`) exists, and every directory that holds
source files (C, CUDA, Python, shell, protobuf) is named. Checked on a
planted tree too, so the check cannot pass by reading nothing."""

import os
import pathlib
import re
import subprocess

SRC = pathlib.Path(os.environ.get("TANDEM_SOURCE_DIR", pathlib.Path(__file__).parents[2]))
EXTS = {".c", ".h", ".cu", ".cuh", ".py", ".sh", ".proto"}
NAMED = re.compile(r"`([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*/)`")


def tree_files(root):
    p = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard"],
                       capture_output=True, text=True)
    if p.returncode == 0 and p.stdout.strip():
        return p.stdout.splitlines()
    return [f.relative_to(root).as_posix() for f in root.rglob("*") if f.is_file()]


def check(root):
    doc = (root / "docs/ARCHITECTURE.md").read_text()
    named = {m.rstrip("/") for m in NAMED.findall(doc)}
    missing_dirs = sorted(d for d in named if not (root / d).is_dir())
    source_dirs = {os.path.dirname(f) for f in tree_files(root)
                   if pathlib.PurePosixPath(f).suffix in EXTS and os.path.dirname(f)
                   and not f.startswith(".")}
    unnamed = sorted(d for d in source_dirs if d not in named)
    return missing_dirs, unnamed


def test_the_doc_names_the_tree():
    missing, unnamed = check(SRC)
    assert not missing, f"docs/ARCHITECTURE.md names directories that do not exist: {missing}"
    assert not unnamed, f"source directories docs/ARCHITECTURE.md does not name: {unnamed}"


def test_the_check_finds_planted_differences(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/ARCHITECTURE.md").write_text("`lib/` and `gone/` and `lib/sub/`\n")
    (tmp_path / "lib/sub").mkdir(parents=True)
    (tmp_path / "lib/a.c").write_text("")
    (tmp_path / "lib/sub/b.h").write_text("")
    (tmp_path / "new").mkdir()
    (tmp_path / "new/c.py").write_text("")
    assert check(tmp_path) == (["gone"], ["new"])
