"""Renders a kustomize directory of deploy/k8s with `kubectl kustomize`,
for the tests of the manifests (skipped where kubectl is not installed)."""

import shutil
import subprocess

import pytest

yaml = pytest.importorskip("yaml")


def render(directory):
    """The objects `kubectl kustomize DIRECTORY` prints (a list of dicts)."""
    if not shutil.which("kubectl"):
        pytest.skip("kubectl (with kustomize v5) is not installed")
    p = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, f"kubectl kustomize {directory} failed:\n{p.stderr}"
    objs = [o for o in yaml.safe_load_all(p.stdout) if o]
    assert objs, f"{directory} rendered nothing"
    return objs
