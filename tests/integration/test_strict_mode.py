"""Strict mode (conftest.py, TANDEM_TEST_STRICT=1, set by scripts/test.sh):
a planted suite run under this directory's conftest, once strict and once
not. Strict, a skip for a prerequisite the machine should have fails and
one for a CPU feature stays a skip; not strict, both skip."""

import os
import shutil
import subprocess
import sys

from conftest import HERE

PLANTED = '''
import pytest

def test_needs_kubectl():
    pytest.skip("kubectl (with kustomize v5) is not installed")

def test_needs_an_isa():
    pytest.skip("this CPU has no avx512")

def test_passes():
    assert 1 + 1 == 2
'''


def run(tmp_path, strict):
    env = dict(os.environ)
    env.pop("TANDEM_TEST_STRICT", None)
    if strict:
        env["TANDEM_TEST_STRICT"] = "1"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider",
                        str(tmp_path / "test_planted.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout.strip().splitlines()[-1]


def test_strict_mode_fails_a_skip_the_machine_should_not_need(tmp_path):
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_planted.py").write_text(PLANTED)
    rc, last = run(tmp_path, strict=True)
    assert rc == 1 and "1 failed, 1 passed, 1 skipped" in last, last
    rc, last = run(tmp_path, strict=False)
    assert rc == 0 and "1 passed, 2 skipped" in last, last
