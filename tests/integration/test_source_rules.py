"""Rules of the source tree that the compiler does not enforce.

The compute seam (common/backend/backend.h): the CPU kernels are reached
only through the CPU backend's ops table. No `td_cpu_` symbol and no
`kernels/cpu/` header appears in any C source outside kernels/ and the CPU
backend (common/backend/backend-cpu.c), except the kernels' own tests and
benchmark, which test the kernels themselves. Likewise the CUDA kernels:
no `td_cuda_` kernel entry and no `kernels/cuda/` header outside kernels/
and the CUDA backend (common/backend/backend-cuda.c), and no kernel launch
(`<<<`) outside kernels/cuda. The scanners are checked on planted
violations too, so a rule cannot pass by scanning nothing."""

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
    "tests/unit/test_dequant_gguf.c",  # every ISA's dequantizer against gguf-py
    "tests/unit/test_attn_cp.c",
    "tests/unit/test_x24.c",
    "tests/bench/bench_kernels.c",   # the kernels' microbenchmark
}
CPU_SYMBOL = re.compile(r"\btd_cpu_\w+")
CPU_HEADER = re.compile(r'#\s*include\s*["<][^">]*kernels/cpu/')
CUDA_SYMBOL = re.compile(r"\btd_cuda_\w+")
CUDA_HEADER = re.compile(r'#\s*include\s*["<][^">]*kernels/cuda/')
LAUNCH = re.compile(r"<<<")


def source_files(root):
    """The tree's files as git sees them (tracked and new, not ignored: no
    build directory or golden worktree), else every file under root."""
    p = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard"],
                       capture_output=True, text=True)
    if p.returncode == 0 and p.stdout.strip():
        return [root / f for f in p.stdout.splitlines()]
    return [f for f in root.rglob("*") if f.is_file()]


def scan(root, rules, allowed):
    found = []
    for path in sorted(source_files(root)):
        rel = path.relative_to(root).as_posix()
        if path.suffix not in EXTS or not path.is_file() or rel in allowed:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for rx, inside in rules:
                m = rx.search(line)
                if m and not rel.startswith(inside):
                    found.append(f"{rel}:{n}: {m.group(0)}")
    return found


def violations(root):
    return scan(root, [(CPU_SYMBOL, "kernels/"), (CPU_HEADER, "kernels/")], ALLOWED)


def cuda_violations(root):
    return scan(root, [(CUDA_SYMBOL, "kernels/"), (CUDA_HEADER, "kernels/"),
                       (LAUNCH, "kernels/cuda/")],
                {"common/backend/backend-cuda.c"} | {f for f in ALLOWED if "test_" in f})


def test_no_cpu_kernel_reference_outside_the_cpu_backend():
    bad = violations(SRC)
    assert not bad, "CPU kernels referenced outside kernels/ and the CPU backend:\n" + "\n".join(bad)


def test_the_scan_finds_a_planted_reference(tmp_path):
    (tmp_path / "common/engine").mkdir(parents=True)
    (tmp_path / "kernels/cpu").mkdir(parents=True)
    (tmp_path / "common/engine/forward.c").write_text(
        '#include "kernels/cpu/cpu.h"\nvoid f(void) { td_cpu_rmsnorm(0, 0, 0, 0, 0); }\n')
    (tmp_path / "kernels/cpu/cpu.c").write_text("void td_cpu_rmsnorm(void) {}\n")
    bad = violations(tmp_path)
    assert bad == ["common/engine/forward.c:1: #include \"kernels/cpu/",
                   "common/engine/forward.c:2: td_cpu_rmsnorm"], bad


def test_no_cuda_kernel_reference_outside_the_cuda_backend():
    bad = cuda_violations(SRC)
    assert not bad, ("CUDA kernels referenced or launched outside kernels/cuda and the CUDA "
                     "backend:\n" + "\n".join(bad))


def test_the_cuda_scan_finds_planted_references(tmp_path):
    (tmp_path / "common/engine").mkdir(parents=True)
    (tmp_path / "kernels/cuda").mkdir(parents=True)
    (tmp_path / "kernels/cpu").mkdir(parents=True)
    (tmp_path / "common/engine/forward.c").write_text(
        '#include "kernels/cuda/ops.h"\nvoid f(void) { td_cuda_add(0, 0, 0, 0, 0); }\n')
    (tmp_path / "kernels/cpu/x.cu").write_text("void g(void) { k<<<1, 1>>>(); }\n")
    (tmp_path / "kernels/cuda/rows.cu").write_text("void h(void) { k<<<1, 1>>>(); }\n")
    bad = cuda_violations(tmp_path)
    assert bad == ["common/engine/forward.c:1: #include \"kernels/cuda/",
                   "common/engine/forward.c:2: td_cuda_add",
                   "kernels/cpu/x.cu:1: <<<"], bad
