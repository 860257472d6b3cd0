"""Hypothesis targets for the planner's parsers (bounded: a few hundred
examples each): workload descriptions, trace files in the three formats
(tandem bench's reader, which tandem plan uses) and profiles. Any input is
either accepted or refused with the parser's own error (one line); nothing
else escapes, and what is accepted is usable (requests in time order with
positive lengths)."""

import json
import os
import sys
import tempfile

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

SRC = os.environ.get("TANDEM_SOURCE_DIR") or os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(SRC, "tools", "planner"))

import plan  # noqa: E402
import workload as wl  # noqa: E402

# no example database or patch files in the source tree: every run draws afresh
SETTINGS = settings(max_examples=300, deadline=None, database=None,
                    phases=[Phase.explicit, Phase.generate, Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 10 ** 7),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
dists = st.recursive(
    st.one_of(st.fixed_dictionaries({"fixed": scalars}),
              st.fixed_dictionaries({"uniform": st.lists(scalars, max_size=3)}),
              st.fixed_dictionaries({"lognormal": st.dictionaries(
                  st.sampled_from(["median", "sigma", "min", "max"]), scalars)}),
              st.fixed_dictionaries({"histogram": st.lists(st.lists(scalars, max_size=4),
                                                           max_size=3)}),
              st.fixed_dictionaries({"empirical": st.lists(scalars, max_size=5)}),
              st.dictionaries(st.text(max_size=6), scalars, max_size=2)),
    lambda inner: st.fixed_dictionaries({"mixture": st.lists(st.lists(
        st.one_of(scalars, inner), min_size=2, max_size=2), max_size=3)}),
    max_leaves=6)
descriptions = st.fixed_dictionaries(
    {"rate": st.one_of(scalars, st.floats(0.1, 50))},
    optional={"arrival": st.sampled_from(["poisson", "bursty", "x"]),
              "burst_factor": scalars, "num_requests": st.one_of(st.integers(-3, 40), scalars),
              "duration_s": st.one_of(st.floats(0.01, 20), scalars), "input": dists,
              "output": dists, "seed": scalars,
              "diurnal": st.lists(st.lists(scalars, max_size=3), max_size=4),
              "shared_prefix": st.dictionaries(st.sampled_from(["share", "tokens", "groups"]),
                                               st.one_of(scalars, st.just(512)))})


def check_rows(rows):
    assert rows and all(r[1] >= 1 and r[2] >= 1 for r in rows)
    assert all(a[0] <= b[0] for a, b in zip(rows, rows[1:]))


@SETTINGS
@given(descriptions)
def test_descriptions(spec):
    try:
        rows, summary = wl.generate(spec)
    except wl.WorkloadError as e:
        assert "\n" not in str(e)
        return
    check_rows(rows)
    assert summary["requests"] == len(rows)


lines = st.lists(st.one_of(
    st.text(max_size=60),
    st.builds(lambda t, a, b, ids: json.dumps({"timestamp": t, "input_length": a,
                                               "output_length": b, "hash_ids": ids}),
              scalars, scalars, scalars, st.lists(st.integers(-2, 5), max_size=4)),
    st.builds(lambda t, a, b: f"{t},{a},{b}", st.sampled_from(
        ["2023-11-16 18:15:46.6805900", "x", "1.5", ""]), scalars, scalars)), max_size=8)
headers = st.sampled_from(["", "TIMESTAMP,ContextTokens,GeneratedTokens\n",
                           "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"])


@SETTINGS
@given(headers, lines)
def test_traces(header, body):
    with tempfile.NamedTemporaryFile("w", suffix=".trace", delete=False) as f:
        f.write(header + "\n".join(body) + "\n")
    try:
        rows, summary, _ = wl.load(f.name)
    except wl.WorkloadError as e:
        assert "\n" not in str(e).strip()
        return
    finally:
        os.unlink(f.name)
    check_rows(rows)


GOOD_ROLE = {"sched": {"max_running": 4, "max_batch_tokens": 64, "max_waiting": 8,
                       "reserve_output_tokens": 16, "max_ctx": 256, "prefix_cache": True},
             "n_blocks": 64, "block_size": 16, "compat": "0" * 32,
             "step": dict.fromkeys(plan.STEP_KEYS, 0.001), "fit": {},
             "overhead": {"request_overhead_s": 0.0, "step_overhead_s": 0.0005}}


def mutate(o, path, value):
    if not path:
        return value
    if isinstance(o, dict) and o:
        keys = sorted(o)
        k = keys[path[0] % len(keys)]
        return {**o, k: mutate(o[k], path[1:], value)}
    return o


@SETTINGS
@given(st.lists(st.integers(0, 20), max_size=4), scalars, st.booleans())
def test_profiles(path, value, drop):
    prof = {"tandem_profile": 1, "model": {"file": "m", "size_bytes": 1, "sha256_ends": "x"},
            "plan": {"flags": []}, "machine": {}, "roles": {"colocated": GOOD_ROLE}}
    prof = mutate(prof, path, value)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        text = json.dumps(prof)
        f.write(text[: len(text) // 2] if drop else text)
    try:
        p = plan.load_profile(f.name)
    except plan.PlanError as e:
        assert "\n" not in str(e)
        return
    finally:
        os.unlink(f.name)
    assert p["roles"]
