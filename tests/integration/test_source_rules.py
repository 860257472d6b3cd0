"""Rules of the source tree that the compiler does not enforce.

The compute seam (common/backend/backend.h): the CPU kernels are reached
only through the CPU backend's ops table. No `td_cpu_` symbol and no
`kernels/cpu/` header appears in any C source outside kernels/ and the CPU
backend (common/backend/backend-cpu.c), except the kernels' own tests and
benchmark, which test the kernels themselves. The scanner is checked on a
planted violation too, so the rule cannot pass by scanning nothing."""

import os
import pathlib
import re
import subprocess

SRC = pathlib.Path(os.environ.get("TANDEM_SOURCE_DIR", pathlib.Path(__file__).parents[2]))
EXTS = {".c", ".h", ".cc", ".cpp", ".cu", ".cuh"}
ALLOWED = {
    "common/backend/backend-cpu.c",  # the CPU backend: the one caller of the kernels
    "tests/unit/test_kernels.c",     # the kernels' own tests against scalar references
    "tests/unit/test_qmatmul.c",
    "tests/unit/test_attn_cp.c",
    "tests/bench/bench_kernels.c",   # the kernels' microbenchmark
}
CPU_SYMBOL = re.compile(r"\btd_cpu_\w+")
CPU_HEADER = re.compile(r'#\s*include\s*["<][^">]*kernels/cpu/')


def source_files(root):
    """The tree's files as git sees them (tracked and new, not ignored: no
    build directory or golden worktree), else every file under root."""
    p = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard"],
                       capture_output=True, text=True)
    if p.returncode == 0 and p.stdout.strip():
        return [root / f for f in p.stdout.splitlines()]
    return [f for f in root.rglob("*") if f.is_file()]


def violations(root):
    found = []
    for path in sorted(source_files(root)):
        rel = path.relative_to(root).as_posix()
        if path.suffix not in EXTS or not path.is_file():
            continue
        if rel.startswith("kernels/") or rel in ALLOWED:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for rx in (CPU_SYMBOL, CPU_HEADER):
                m = rx.search(line)
                if m:
                    found.append(f"{rel}:{n}: {m.group(0)}")
    return found


def test_no_cpu_kernel_reference_outside_the_cpu_backend():
    bad = violations(SRC)
    assert not bad, "CPU kernels referenced outside kernels/ and the CPU backend:\n" + "\n".join(bad)


def test_the_scan_finds_a_planted_reference(tmp_path):
    (tmp_path / "common/model").mkdir(parents=True)
    (tmp_path / "kernels/cpu").mkdir(parents=True)
    (tmp_path / "common/model/forward.c").write_text(
        '#include "kernels/cpu/cpu.h"\nvoid f(void) { td_cpu_rmsnorm(0, 0, 0, 0, 0); }\n')
    (tmp_path / "kernels/cpu/cpu.c").write_text("void td_cpu_rmsnorm(void) {}\n")
    bad = violations(tmp_path)
    assert bad == ["common/model/forward.c:1: #include \"kernels/cpu/",
                   "common/model/forward.c:2: td_cpu_rmsnorm"], bad
