"""Runs one of the benchmark scripts of tools/bench on a tiny model with
tiny sizes, for the tests that keep them working (the figures are never
judged: a test never times anything)."""

import json
import subprocess
import sys

from conftest import scaled

MODEL = "gguf/llama2-f32.gguf"  # vocab 512, context 256


def run_bench_script(script, source_dir, tandem_bin, test_models, tmp_path, *args):
    """tools/bench/SCRIPT ARGS on MODEL -> (its --json report, its stdout)."""
    out = tmp_path / f"{script}.json"
    argv = [sys.executable, str(source_dir / "tools/bench" / script), *args,
            "--build", str(tandem_bin.parent), "--model", str(test_models / MODEL),
            "--ctx", "256", "--no-wait", "--quiet", "--log-dir", str(tmp_path / "logs"),
            "--json", str(out)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=scaled(240))
    assert r.returncode == 0, f"$ {' '.join(argv)}\n{r.stdout}\n{r.stderr}"
    with open(out) as f:
        return json.load(f), r.stdout
