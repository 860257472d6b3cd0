"""Shared pytest fixtures and helpers for Tandem's integration tests.

Environment (CTest sets all of them, see tests/CMakeLists.txt):
  TANDEM_BIN          path of the `tandem` binary                  (required by tandem fixtures)
  TANDEM_SOURCE_DIR   repository root         (default: two levels above this file)
  TANDEM_BUILD_DIR    build tree              (optional)
  TANDEM_TEST_MODELS  tiny random models made by tests/models/make_models.py
                      (default: $TMPDIR/tandem-test-models-$UID; generated in
                      place when the directory lacks its up-to-date stamp)
  TANDEM_MODEL        default model file      (default: ~/.cache/tandem/models/
                      SmolLM2-135M-Instruct.Q4_1.gguf, as common/runtime/cli.h says)
  TANDEM_TEST_TIMEOUT_SCALE  multiplies every timeout (e.g. 5 under sanitizers)
  TANDEM_TEST_STRICT  1: a skip fails, unless for a CPU feature or a GPU
                      (scripts/test.sh, and so CI, sets it)

Fixtures:
  source_dir, build_dir       pathlib.Path (build_dir may be None)
  tandem_bin                  pathlib.Path of the binary; a missing binary fails
                              the test (never a skip: a silent skip hides coverage)
  test_models                 pathlib.Path of the models directory
  manifest                    list of model entries of DIR/models.json (see
                              tests/models/make_models.py for the fields)
  default_model               pathlib.Path of the default model (fails if absent)
  tandem                      callable: tandem("generate", "--model", p, ...,
                              timeout=60, input=None, env=None, check=True)
                              -> TandemResult(returncode, stdout, stderr, argv)
  tandem_eval                 callable: tandem_eval(model, sequences, threads=None,
                              chunk=None, batch=False, isa=None, timeout=120)
                              -> list of float32 arrays (len(seq), n_vocab)
  spawn                       callable: spawn(argv, env=None) -> subprocess.Popen
                              for long-running servers; stdout/stderr go to files
                              (proc.log_path()); every spawned process group is
                              terminated (then killed) at teardown, even on failure
Helpers (import from conftest): run_tandem, tandem_eval_raw, free_port, wait_until,
  scaled(seconds), ensure_test_models(), load_manifest(dir) (the last two work
  at collection time, e.g. in pytest_generate_tests), register_log(label, path, proc=None).

Evidence on failure: every process a test starts has its log registered
(register_log; serve_util's Server and the spawn fixture do it themselves),
and when the test fails, in its setup, body or teardown, the report carries
the last LOG_TAIL_BYTES of each of those logs in full, one section each
("log LABEL: PATH"), after the assertion message; so do the logs of the
processes a module- or session-scoped fixture started, while they run.

Every run has a timeout; on timeout the whole process group is killed and the
test fails with the command line and the captured output.
"""

import os
import re

# The tests' NumPy work is many small matmuls: multi-threaded BLAS only adds
# contention (70x slower on a loaded 2-core CI machine). Must precede numpy.
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import json  # noqa: E402
import pathlib  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def scaled(seconds):
    """A timeout scaled by TANDEM_TEST_TIMEOUT_SCALE (default 1)."""
    return seconds * float(os.environ.get("TANDEM_TEST_TIMEOUT_SCALE", "1"))


class TandemResult:
    def __init__(self, argv, returncode, stdout, stderr):
        self.argv = argv
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr

    def describe(self):
        return (f"$ {' '.join(map(str, self.argv))}\nexit {self.returncode}\n"
                f"--- stdout (tail) ---\n{self.stdout[-3000:]}\n"
                f"--- stderr (tail) ---\n{self.stderr[-3000:]}")


def _find_bin():
    b = os.environ.get("TANDEM_BIN")
    if b:
        return pathlib.Path(b)
    bd = os.environ.get("TANDEM_BUILD_DIR")
    if bd and (pathlib.Path(bd) / "tandem").exists():
        return pathlib.Path(bd) / "tandem"
    return None


def run_tandem(*args, timeout=60, input=None, env=None, check=True, binary=None):
    """Runs `tandem ARGS...` and returns a TandemResult (text output).

    timeout: seconds (scaled); on expiry the process group is killed and the
    test fails. check: fail the test on a nonzero exit. env: extra variables
    on top of os.environ. input: str fed to stdin."""
    exe = binary or _find_bin()
    if exe is None or not pathlib.Path(exe).exists():
        pytest.fail(f"tandem binary not found (TANDEM_BIN={os.environ.get('TANDEM_BIN')!r})")
    argv = [str(exe)] + [str(a) for a in args]
    full_env = dict(os.environ)
    if env:
        full_env.update({k: str(v) for k, v in env.items()})
    p = subprocess.Popen(argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env,
                         start_new_session=True, text=True, errors="replace")
    try:
        out, err = p.communicate(input=input, timeout=scaled(timeout))
    except subprocess.TimeoutExpired:
        _kill_group(p)
        out, err = p.communicate()
        r = TandemResult(argv, None, out, err)
        pytest.fail(f"timed out after {scaled(timeout):.0f} s\n{r.describe()}")
    r = TandemResult(argv, p.returncode, out, err)
    if check and r.returncode != 0:
        pytest.fail(f"tandem failed\n{r.describe()}")
    if r.returncode is not None and r.returncode < 0:
        # Killed by a signal (crash, sanitizer abort): never acceptable.
        pytest.fail(f"tandem died with signal {-r.returncode}\n{r.describe()}")
    return r


def stale_exec_segments():
    """Shared-memory segments of rank executors whose driver is gone
    (/dev/shm/tandem-exec-PID-N with no process PID): what a plan must never
    leave behind. Segments of live drivers (tests running in parallel) are
    not counted; the executor unlinks its own once every rank attached."""
    out = []
    for f in os.listdir("/dev/shm"):
        m = re.match(r"tandem-exec-(\d+)-\d+$", f)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            out.append(f)
    return out


def tandem_eval_raw(model, sequences, threads=None, chunk=None, batch=False, isa=None,
                    timeout=120, check=True, binary=None, workdir=None, extra=()):
    """Runs `tandem eval` (contract in tools/cmd-eval.c) and returns
    (TandemResult, list of float32 arrays (len(seq), n_vocab) or None on failure).
    extra: more arguments (e.g. plan flags)."""
    with tempfile.TemporaryDirectory(dir=workdir) as td:
        tin = os.path.join(td, "in.json")
        tout = os.path.join(td, "out.bin")
        with open(tin, "w") as f:
            json.dump({"sequences": [[int(t) for t in s] for s in sequences]}, f)
        args = ["eval", "--model", model, "--tokens", tin, "--out", tout]
        if threads is not None:
            args += ["--threads", threads]
        if chunk is not None:
            args += ["--chunk", chunk]
        if batch:
            args += ["--batch"]
        if isa is not None:
            args += ["--isa", isa]
        args += list(extra)
        r = run_tandem(*args, timeout=timeout, check=check, binary=binary)
        if r.returncode != 0:
            return r, None
        raw = np.fromfile(tout, dtype="<f4")
        total = sum(len(s) for s in sequences)
        if total == 0 or raw.size % total != 0:
            pytest.fail(f"tandem eval wrote {raw.size} floats for {total} positions\n{r.describe()}")
        V = raw.size // total
        out, off = [], 0
        for s in sequences:
            out.append(raw[off:off + len(s) * V].reshape(len(s), V))
            off += len(s) * V
        return r, out


# ---------------------------------------------------------------------------
# Logs of the processes the running test started, shown when it fails

LOG_TAIL_BYTES = 24000
# (label, path, proc) in start order: a test's own until its teardown, and
# one of a wider fixture's (module, session) for as long as proc runs
_test_logs = []


def register_log(label, path, proc=None):
    """Shows the tail of the log at path in the report of the running test
    if it fails (a process's stderr, or its merged output); with proc (a
    Popen), in the reports of later tests too while proc runs (a process a
    module-scoped fixture started)."""
    _test_logs.append((str(label), pathlib.Path(path), proc))


def _forget_ended_logs():
    _test_logs[:] = [e for e in _test_logs if e[2] is not None and e[2].poll() is None]


def _log_tail(path, n=LOG_TAIL_BYTES):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            data = f.read()
    except OSError as e:
        return f"(unreadable: {e})"
    if size > n:
        # from the first whole line, and say what was left out
        data = data[data.find(b"\n") + 1:]
        return f"[... {size - len(data)} earlier bytes left out]\n" + data.decode(errors="replace")
    return data.decode(errors="replace") or "(empty)"


# Strict mode (TANDEM_TEST_STRICT=1, what scripts/test.sh and so CI run): a
# test that skips fails instead, unless its reason is one a machine that
# runs CI may lack (a CPU feature, a GPU); a skip for kubectl, the default
# model, root and unshare, a free port... would hide a test that machine
# can run.
STRICT = os.environ.get("TANDEM_TEST_STRICT") == "1"
ALLOWED_SKIPS = re.compile(r"this CPU has no|no GPU|no CUDA")


def _skip_reason(rep):
    lr = rep.longrepr
    return lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if STRICT and rep.skipped and not hasattr(rep, "wasxfail"):
        why = _skip_reason(rep)
        if not ALLOWED_SKIPS.search(why):
            rep.outcome = "failed"
            rep.longrepr = (f"strict mode (TANDEM_TEST_STRICT=1): the test skipped for a "
                            f"prerequisite this machine should have: {why}")
    if rep.failed:
        for label, path, _ in _test_logs:
            rep.sections.append((f"log {label}: {path}", _log_tail(path)))
    if rep.when == "teardown":
        _forget_ended_logs()


def _kill_group(p):
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        if p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond, timeout=30, interval=0.05, what="condition", proc=None):
    """Polls cond() until it returns a truthy value (returned). Fails the test
    on timeout, or at once if proc (a Popen) has exited."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        v = cond()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: process exited with {proc.returncode} while waiting"
                        + (f"\n{proc.log_tail()}" if hasattr(proc, "log_tail") else ""))
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {scaled(timeout):.0f} s waiting for {what}")
        time.sleep(interval)


# ---------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="session")
def source_dir():
    return pathlib.Path(os.environ.get("TANDEM_SOURCE_DIR") or HERE.parent.parent).resolve()


@pytest.fixture(scope="session")
def build_dir():
    bd = os.environ.get("TANDEM_BUILD_DIR")
    return pathlib.Path(bd) if bd else None


@pytest.fixture(scope="session")
def tandem_bin():
    b = _find_bin()
    if b is None or not b.exists():
        pytest.fail(f"tandem binary not found: set TANDEM_BIN (now {os.environ.get('TANDEM_BIN')!r})")
    return b


def ensure_test_models(source_dir=None):
    """Directory of the tiny random models, generated if needed (idempotent:
    make_models.py returns at once when the directory's stamp matches).
    $TANDEM_TEST_MODELS, else a per-user directory under the temp dir.
    Usable at collection time (e.g. to parametrize over models.json)."""
    src = pathlib.Path(source_dir or os.environ.get("TANDEM_SOURCE_DIR") or HERE.parent.parent)
    d = os.environ.get("TANDEM_TEST_MODELS")
    d = pathlib.Path(d) if d else pathlib.Path(tempfile.gettempdir()) / f"tandem-test-models-{os.getuid()}"
    r = subprocess.run([sys.executable, str(src / "tests/models/make_models.py"), "--out", str(d)],
                       capture_output=True, text=True, timeout=scaled(300))
    if r.returncode != 0:
        raise RuntimeError(f"make_models.py failed:\n{r.stdout}\n{r.stderr}")
    return d


def load_manifest(models_dir):
    """The model entries of models_dir/models.json."""
    with open(pathlib.Path(models_dir) / "models.json") as f:
        return json.load(f)["models"]


def manifest_model(manifest, test_models, name):
    """The path of the test model called name (fails the test if absent)."""
    for m in manifest:
        if m["name"] == name:
            return test_models / m["path"]
    pytest.fail(f"no test model {name}")


@pytest.fixture(scope="session")
def test_models(source_dir):
    try:
        return ensure_test_models(source_dir)
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def manifest(test_models):
    return load_manifest(test_models)


@pytest.fixture(scope="session")
def default_model():
    p = os.environ.get("TANDEM_MODEL")
    if p:
        p = pathlib.Path(p)
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        p = pathlib.Path(cache) / "tandem" / "models" / DEFAULT_MODEL_NAME
    if not p.exists():
        pytest.fail(f"default model not found at {p} (run the setup script)")
    return p


@pytest.fixture
def tandem(tandem_bin):
    def call(*args, **kw):
        return run_tandem(*args, binary=tandem_bin, **kw)
    return call


@pytest.fixture
def tandem_eval(tandem_bin, tmp_path):
    def call(model, sequences, **kw):
        r, out = tandem_eval_raw(model, sequences, binary=tandem_bin, workdir=tmp_path, **kw)
        return out
    return call


class _Proc(subprocess.Popen):
    def log_path(self):
        return self._log_path

    def log_tail(self, n=4000):
        try:
            with open(self._log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""


@pytest.fixture
def spawn(tmp_path):
    procs = []

    def start(argv, env=None):
        full_env = dict(os.environ)
        if env:
            full_env.update({k: str(v) for k, v in env.items()})
        log = tmp_path / f"proc-{len(procs)}.log"
        f = open(log, "wb")
        p = _Proc([str(a) for a in argv], stdin=subprocess.DEVNULL, stdout=f,
                  stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        f.close()
        p._log_path = log
        register_log(os.path.basename(str(argv[0])), log, p)
        procs.append(p)
        return p

    yield start
    for p in reversed(procs):
        _kill_group(p)
