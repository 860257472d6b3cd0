"""`tandem profile` and `tandem plan` (tools/planner) on a tiny model.

- profile (--quick) of a colocated instance and of a prefill + decode pair:
  the JSON holds the machine, model, plan, the fitted step model with its
  residuals, the KV pool as the instance itself logged it, and (the pair)
  the transfer fit;
- plan: the cheapest configuration meeting generous SLOs, its kustomize
  overlay (valid YAML, the replicas of the answer), KEDA thresholds; an SLO
  no configuration can meet: a clear answer naming the SLO and by how much,
  and the best found; --method mean (Dynamo's formula) answers and is
  simulated; a configuration checked against a real run of the same trace
  (its TTFT P50 within a factor of 3: the tiny model's steps are a few ms,
  so this is a sanity bound, the validation is docs/PERFORMANCE.md's);
- the report opens in headless Chromium with its plots and no console
  error;
- bad input: truncated, foreign-version, incomplete and other-model
  profiles, unknown and malformed workloads, each a one-line error, exit 1.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest
import yaml

from conftest import manifest_model, scaled

SLO_EASY = "ttft_p90:60000,tpot_p90:10000"


def run(tandem_bin, *args, timeout=300, check=True, env=None):
    p = subprocess.run([str(tandem_bin), *map(str, args)], capture_output=True, text=True,
                       timeout=scaled(timeout), env=env)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.fixture(scope="module")
def model(manifest, test_models):
    return manifest_model(manifest, test_models, "llama2-f32-gguf")


@pytest.fixture(scope="module")
def profiles(tandem_bin, model, tmp_path_factory):
    d = tmp_path_factory.mktemp("profiles")
    out = {}
    for role, extra in (("colocated", ["--cpus", "0"]),
                        ("both", ["--cpus", "0,1"])):
        path = d / f"{role}.json"
        run(tandem_bin, "profile", "--model", model, "--role", role, "--out", path,
            *extra, timeout=600)
        out[role] = path
    return out


def workload(tmp_path, **kw):
    spec = {"rate": 4.0, "num_requests": 60, "input": {"uniform": [20, 120]},
            "output": {"uniform": [4, 24]}, "seed": 5}
    spec.update(kw)
    p = tmp_path / "w.json"
    p.write_text(json.dumps(spec))
    return p


def test_profile_contents(profiles, model):
    p = json.loads(profiles["colocated"].read_text())
    assert p["tandem_profile"] == 1 and p["neighbour"] is None  # taken alone
    # the traffic loads at 35% and 70% of the instance's time: Poisson
    # rates from the loads before them (the higher share, twice the rate),
    # run at those rates
    rates = p["traffic_rates"]
    assert list(rates) == ["traffic-35", "traffic-70"] and rates["traffic-35"] > 0
    assert rates["traffic-70"] == pytest.approx(2 * rates["traffic-35"])
    for name in rates:
        rep = json.loads((pathlib.Path(p["workdir"]) / f"bench-{name}.json").read_text())
        assert rep["completed"] == 40 and rep["failed"] == 0
        assert rep["mode"]["request_rate"] == pytest.approx(rates[name], rel=1e-3)
    assert p["model"]["file"] == os.path.basename(model) and p["model"]["size_bytes"] > 0
    assert p["plan"]["threads"] == 1 and p["plan"]["cpus"] == "0"
    assert p["machine"]["cores"] == os.cpu_count()
    r = p["roles"]["colocated"]
    # the KV pool as the instance logged it at its start
    log = (pathlib.Path(p["workdir"]) / "up.err").read_text()
    m = re.search(r"KV pool (\d+) blocks x (\d+) tokens", log)
    assert (r["n_blocks"], r["block_size"]) == (int(m.group(1)), int(m.group(2)))
    assert set(r["step"]) == {"c0", "c_tok", "c_tok2", "c_attn", "c_attn2", "c_ctx", "c_seq",
                              "c_n2", "c_n4", "c_n8", "c_n16"}
    assert all(v >= 0 for k, v in r["step"].items() if not k.startswith("c_n"))
    assert r["step"]["c0"] + r["step"]["c_tok"] > 0
    fit = r["fit"]
    assert fit["n"] >= 20 and fit["by_kind"]["decode"]["n"] > 0
    assert fit["by_kind"]["prefill"]["n"] > 0
    assert 0 <= fit["rel_err_p50"] < 0.5, fit  # a model of the steps, not noise
    pd = json.loads(profiles["both"].read_text())
    assert set(pd["roles"]) == {"prefill", "decode"}
    t = pd["transfer"]
    assert t["n"] >= 2 and t["fixed_s"] >= 0 and t["s_per_token"] >= 0


def test_profile_beside_a_neighbour(tandem_bin, model, tmp_path):
    # --neighbour-cpus: the loads again on this instance (core 0) and a
    # second one of its plan (core 1) at once; the profile holds the step
    # model measured alone and the one beside, both clusters stopped; tandem
    # plan charges the beside model only to instances sharing a machine
    # (--host-cores), and a neighbour that slows each step 3x shows
    if (os.cpu_count() or 1) < 2:
        pytest.fail("needs 2 cores")
    out = tmp_path / "nb.json"
    run(tandem_bin, "profile", "--model", model, "--cpus", "0", "--neighbour-cpus", "1",
        "--quick", "--out", out, timeout=900)
    p = json.loads(out.read_text())
    assert p["neighbour"] == {"cpus": "1"}
    r = p["roles"]["colocated"]
    assert r["fit"]["n"] >= 20
    b = r["beside"]
    assert set(b["step"]) == set(r["step"]) and b["fit"]["n"] >= 40  # both instances' steps
    assert b["overhead"]["step_overhead_s"] >= 0
    assert all(v > 0 for v in b["over_alone_p50"].values() if v is not None)
    for name in ("colocated", "neighbour"):
        log = (pathlib.Path(p["workdir"]) / f"up-beside-{name}.err").read_text()
        assert "tandem up: stopped" in log, log[-2000:]
    slow = tmp_path / "slow.json"
    b["step"] = {k: 3 * v for k, v in r["step"].items()}
    slow.write_text(json.dumps(p))
    w = workload(tmp_path, rate=20.0)
    got = {}
    for hc in (0, 1, 2):
        o = json.loads(run(tandem_bin, "plan", "--profile", slow, "--workload", w, "--slo",
                           SLO_EASY, "--config", "colocated=2", "--host-cores", hc,
                           "--json").stdout)
        c = o["configs"][0]
        assert o["host_cores"] == hc and c["neighbours_modelled"] == (hc == 2)
        assert (c["result"]["steps_beside"] > 0) == (hc == 2)
        got[hc] = c["predicted"]["ttft_p90"]
    assert got[0] == got[1] < got[2]
    o = json.loads(run(tandem_bin, "plan", "--profile", slow, "--workload", w, "--slo", SLO_EASY,
                       "--config", "colocated=1", "--host-cores", 2, "--json").stdout)
    assert not o["configs"][0]["neighbours_modelled"]  # alone on its machine
    r = run(tandem_bin, "profile", "--model", model, "--neighbour-cpus", "1", "--role", "both",
            "--out", tmp_path / "x.json", check=False)
    assert r.returncode == 2 and "neighbour" in r.stderr, r.stderr


def plan(tandem_bin, profiles, w, *extra, check=True):
    return run(tandem_bin, "plan", "--profile", profiles["colocated"], "--profile",
               profiles["both"], "--workload", w, *extra, check=check)


def test_plan_answer_and_deploy(tandem_bin, profiles, tmp_path):
    w = workload(tmp_path)
    out = json.loads(plan(tandem_bin, profiles, w, "--slo", SLO_EASY, "--max-instances", 3,
                          "--json").stdout)
    names = [c["config"] for c in out["configs"]]
    assert {"1C@1t", "2C@1t", "3C@1t", "1P+1D@1t", "1P+2D@1t", "2P+1D@1t"} <= set(names)
    ans = out["answer"]
    assert ans and ans["meets"]
    assert ans["cost"] == min(c["cost"] for c in out["configs"] if c["meets"])
    assert out["simulated_requests"] == 60 * len(names)
    overlay = yaml.safe_load(out["kustomize"])
    reps = {r["name"]: r["count"] for r in overlay["replicas"]}
    if "colocated" in ans["shape"]:
        assert reps["tandem-decode"] == ans["shape"]["colocated"] and reps["tandem-prefill"] == 0
    else:
        assert (reps["tandem-prefill"], reps["tandem-decode"]) == (ans["shape"]["prefill"],
                                                                   ans["shape"]["decode"])
    assert out["keda"]["tandem-decode"]["threshold"] >= 1
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    text = run(tandem_bin, "plan", "--profile", profiles["colocated"], "--profile",
               profiles["both"], "--workload", w, "--slo", SLO_EASY, "--max-instances", 3,
               env=dict(os.environ, TMPDIR=str(tmp))).stdout
    assert f"answer: {ans['config']}" in text and "kustomize overlay" in text
    assert not list(tmp.iterdir())  # its work directory removed


def test_unmeetable_slo(tandem_bin, profiles, tmp_path):
    w = workload(tmp_path)
    p = plan(tandem_bin, profiles, w, "--slo", "ttft_p99:0.01,tpot_p90:10000", "--max-instances",
             2)
    assert "no configuration within 2 instances meets the SLOs" in p.stdout
    assert re.search(r"misses ttft_p99 by \d+%", p.stdout), p.stdout
    out = json.loads(plan(tandem_bin, profiles, w, "--slo", "ttft_p99:0.01", "--max-instances",
                          2, "--json").stdout)
    assert out["answer"] is None and "ttft_p99" in out["best"]["misses"]
    assert out["best"]["misses"]["ttft_p99"]["over_pct"] > 0


def test_speed_drift_warning(tandem_bin, profiles, tmp_path):
    # the profile's speed check (its decode load of 4 sequences repeated at
    # the end)
    p = json.loads(profiles["colocated"].read_text())
    sc = p["speed_check"]
    assert sc["load"].startswith("decode-c4-") and len(sc["tpot_ms_p50"]) == 2
    assert sc["change"] == pytest.approx(sc["tpot_ms_p50"][1] / sc["tpot_ms_p50"][0] - 1)
    assert sc["minutes_apart"] > 0
    # a machine that slowed by 30% while it was profiled: tandem plan says
    # so (text and JSON) unless the margin covers it
    p["speed_check"]["change"] = 0.3
    drift = tmp_path / "drift.json"
    drift.write_text(json.dumps(p))
    w = workload(tmp_path)
    args = ["plan", "--profile", drift, "--workload", w, "--slo", SLO_EASY]
    t = run(tandem_bin, *args).stdout
    assert t.startswith(f"warning: profile {drift}: the machine's speed moved by +30%"), t
    assert "--margin of at least 0.30" in t
    o = json.loads(run(tandem_bin, *args, "--json").stdout)
    assert len(o["warnings"]) == 1 and "+30%" in o["warnings"][0]
    o = json.loads(run(tandem_bin, *args, "--json", "--margin", "0.3").stdout)
    assert o["warnings"] == []


def test_validate_at_run_speed(tandem_bin, profiles, tmp_path, monkeypatch):
    # validate.py --at-run-speed: each run predicted again with the
    # profile's step model scaled to the speed its steps showed; a run at
    # twice the profile's step time has a longer TPOT P50, at most twice as
    # long (a light load: a token is a step plus the scheduler's gap, which
    # is not scaled), and each error is against that run
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools" / "planner"))
    import validate
    monkeypatch.setenv("TANDEM_BIN", str(tandem_bin))
    w = workload(tmp_path, rate=0.5, num_requests=20)
    spec = {"slo": SLO_EASY, "profiles": {"c": str(profiles["colocated"])}}
    case = {"name": "c1", "profile": "c", "config": "colocated=1", "workload": str(w)}
    row = {"compare": {"tpot_p50": {"measured": [10.0, 10.0]}},
           "steps": [{"colocated0": {"in_all": 1.0}}, {"colocated0": {"in_all": 2.0}}]}
    got = validate.at_run_speed(case, spec, pathlib.Path("/"), tmp_path, [], row)
    assert got["speeds"] == [1.0, 2.0]
    a, b = got["compare"]["tpot_p50"]["predicted"]
    assert 1.2 * a < b <= 2.0 * a, (a, b)
    assert got["compare"]["tpot_p50"]["errors"] == pytest.approx([a / 10 - 1, b / 10 - 1])
    # a run without its steps: no answer rather than a wrong one
    row["steps"][1] = {"colocated0": {"error": "no steps"}}
    assert validate.at_run_speed(case, spec, pathlib.Path("/"), tmp_path, [], row) is None


def test_mean_method(tandem_bin, profiles, tmp_path):
    w = workload(tmp_path)
    out = json.loads(plan(tandem_bin, profiles, w, "--slo", SLO_EASY, "--method", "mean",
                          "--json").stdout)
    assert len(out["configs"]) == 1 and out["mean_method"]["prefill_tokens_per_s"] > 0
    assert out["configs"][0]["predicted"]["ttft_p90"] > 0


def test_prediction_against_a_real_run(tandem_bin, profiles, model, tmp_path):
    w = workload(tmp_path, rate=2.0, num_requests=30)
    trace = tmp_path / "w.mooncake.jsonl"
    out = json.loads(plan(tandem_bin, profiles, w, "--slo", SLO_EASY, "--config", "colocated=1",
                          "--write-trace", trace, "--json").stdout)
    pred = out["configs"][0]["result"]["ttft_ms"]["p50"]
    up = subprocess.Popen([str(tandem_bin), "up", "--colocated", "1", "--model", model,
                           "--port", "0", "--grpc-port", "-1", "--threads", "1", "--cpus", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          start_new_session=True)
    try:
        line = up.stdout.readline()
        url = re.match(r"^tandem up: ready http=(\S+) ", line).group(1)
        rep = tmp_path / "bench.json"
        run(tandem_bin, "bench", "--url", url, "--trace", trace, "--no-progress", "--json", rep)
        meas = json.loads(rep.read_text())
    finally:
        up.terminate()
        up.wait(timeout=scaled(60))
    assert meas["completed"] == 30
    assert meas["ttft_ms"]["p50"] / 3 <= pred <= meas["ttft_ms"]["p50"] * 3, (pred, meas["ttft_ms"])


def test_report_renders(tandem_bin, profiles, tmp_path):
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not installed (scripts/setup.sh installs it)"
    w = workload(tmp_path)
    page = tmp_path / "plan.html"
    plan(tandem_bin, profiles, w, "--slo", SLO_EASY, "--max-instances", 2, "--report", page)
    html = page.read_text()
    assert "<script" not in html and "src=\"http" not in html and "href=\"http" not in html
    p = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                        "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()],
                       capture_output=True, text=True, timeout=scaled(120))
    assert p.returncode == 0, p.stderr[-2000:]
    dom = p.stdout
    assert dom.count("<svg") >= 2 and "id=\"attainment\"" in dom and "id=\"cdf\"" in dom
    assert "Answer:" in dom
    console = [x for x in p.stderr.splitlines() if "CONSOLE" in x or "Uncaught" in x]
    assert not console, console


def test_bad_profiles(tandem_bin, profiles, model, tmp_path):
    good = json.loads(profiles["colocated"].read_text())
    w = workload(tmp_path)
    text = profiles["colocated"].read_text()
    cases = {
        "truncated": (text[: len(text) // 2], "not JSON, or truncated"),
        "version": (json.dumps({**good, "tandem_profile": 7}), "profile version 7"),
        "foreign": (json.dumps({"hello": 1}), "not a tandem profile"),
        "no-step": (json.dumps({**good, "roles": {"colocated": {
            k: v for k, v in good["roles"]["colocated"].items() if k != "step"}}}),
            "missing step"),
        "bad-coef": (json.dumps({**good, "roles": {"colocated": {
            **good["roles"]["colocated"], "step": {**good["roles"]["colocated"]["step"],
                                                   "c_tok": "fast"}}}}), "c_tok has the wrong type"),
        "other-model": (json.dumps({**good, "model": {**good["model"], "size_bytes": 1}}),
                        "profiles of different models"),
        "bad-beside": (json.dumps({**good, "roles": {"colocated": {
            **good["roles"]["colocated"], "beside": {"step": "x", "overhead": {}}}}}),
            "roles.colocated.beside: must be an object with step and overhead"),
        "bad-speed-check": (json.dumps({**good, "speed_check": {"change": "slow"}}),
                            "speed_check: change has the wrong type"),
    }
    for name, (body, msg) in cases.items():
        bad = tmp_path / f"{name}.json"
        bad.write_text(body)
        p = run(tandem_bin, "plan", "--profile", bad, "--profile", profiles["colocated"],
                "--workload", w, "--slo", SLO_EASY, check=False)
        assert p.returncode == 1 and msg in p.stderr, (name, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1, (name, p.stderr)
    # a profile of another model than the one planned for
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + b"\0" * 64)
    p = run(tandem_bin, "plan", "--profile", profiles["colocated"], "--workload", w, "--slo",
            SLO_EASY, "--model", other, check=False)
    assert p.returncode == 1 and "is not the model profiled" in p.stderr
    p = run(tandem_bin, "plan", "--profile", profiles["colocated"], "--workload", w, "--slo",
            SLO_EASY, "--plan-flags", "--tp 2", check=False)
    assert p.returncode == 1 and "measured with the instance flags" in p.stderr


BAD_WORKLOADS = [
    ("w.csv", "what,is,this\n1,2,3\n", "not a trace tandem bench knows"),
    ("w.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [1]}\n'
                '{"timestamp": 5, "input_len', ":2: not JSON"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,x,3\n",
     "ContextTokens"),
    ("d.json", '{"rate": 1, "speed": 3}', "unknown field 'speed'"),
    ("e.json", '{"rate": 1, "input": {"poisson": 3}}', "unknown distribution 'poisson'"),
    ("f.json", '{"rate": -1}', "rate must be in"),
    ("g.json", '{"rate": 1, "shared_prefix": {"share": 0.5, "tokens": 700}}', "multiple of 512"),
    ("h.json", '{"rate": 1, "diurnal": [[0, 1], [1, 2]]}', "needs duration_s"),
    ("i.json", '{"rate": 1, "input": {"histogram": [[5, 2, 1]]}}', "hi must be in"),
    ("j.json", "{", "not JSON"),
]


@pytest.mark.parametrize("name,body,msg", BAD_WORKLOADS)
def test_bad_workload(tandem_bin, profiles, tmp_path, name, body, msg):
    w = tmp_path / name
    w.write_text(body)
    p = run(tandem_bin, "plan", "--profile", profiles["colocated"], "--workload", w, "--slo",
            SLO_EASY, check=False)
    assert p.returncode == 1 and msg in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_bad_slo_and_usage(tandem_bin, profiles, tmp_path):
    w = workload(tmp_path)
    for slo, msg in (("ttft:100", "METRIC_STAT"), ("ttft_p42:100", "METRIC_STAT"),
                     ("ttft_p99:-4", "must be > 0")):
        p = run(tandem_bin, "plan", "--profile", profiles["colocated"], "--workload", w, "--slo",
                slo, check=False)
        assert p.returncode == 1 and msg in p.stderr, p.stderr
    p = run(tandem_bin, "plan", "--workload", w, "--slo", SLO_EASY, check=False)
    assert p.returncode == 2
