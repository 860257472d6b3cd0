"""Parallel-plan flags on the CLI: --plan-dry-run prints the plan
validated against the model's real shape; a plan the model does not allow is
a clear error; a valid multi-rank plan runs on rank processes and generates
what one rank generates."""
import os

from conftest import run_tandem, stale_exec_segments

MODEL = os.path.join(os.environ.get("TANDEM_TEST_MODELS", ""), "gguf/llama2-f32.gguf")
# Its shape (tests/models/make_models.py): 2 layers, 4 heads, 4 KV heads, FFN 192.


def test_dry_run_prints_the_plan():
    for cmd in ("generate", "serve"):
        r = run_tandem(cmd, "--model", MODEL, "--tp", "2", "--pp", "2", "--cp", "2",
                       "--plan-dry-run", check=False)
        assert r.returncode == 0, r.describe()
        out = r.stdout
        assert "tp 2 x cp 2 x pp 2 = 8 ranks" in out, out
        rows = [ln.split() for ln in out.splitlines() if ln[:1].isdigit()]
        assert len(rows) == 8, out
        # TP innermost, then CP, then PP; one layer per stage.
        assert [row[1:5] for row in rows] == [
            [str(r % 2), str(r // 2 % 2), str(r // 4), "0-0" if r < 4 else "1-1"] for r in range(8)]
        for q in ("what state is split", "what is replicated",
                  "what crosses the interconnect", "what the plan improves"):
            assert q in out, out


def test_plans_the_model_does_not_allow():
    cases = [(["--tp", "3"], "does not divide the 4 attention heads"),
             (["--pp", "3"], "exceeds the 2 layers"),
             (["--pp", "2", "--pp-layers", "1,2"], "adds up to 3 layers"),
             (["--ep", "2"], "needs a mixture-of-experts model")]
    for flags, msg in cases:
        r = run_tandem("generate", "--model", MODEL, *flags, "--plan-dry-run", check=False)
        assert r.returncode == 2, r.describe()
        assert msg in r.stderr, r.describe()
    r = run_tandem("generate", "--model", MODEL, "--tp", "two", "--prompt", "x", check=False)
    assert r.returncode == 2 and "bad value 'two' for --tp" in r.stderr, r.describe()


def test_multi_rank_generate_matches_one_rank():
    args = ("--prompt", "hello there", "--max-tokens", "12", "--temperature", "0")
    one = run_tandem("generate", "--model", MODEL, *args, check=False)
    assert one.returncode == 0, one.describe()
    assert one.stdout.strip(), one.describe()
    for plan in (["--tp", "1"], ["--pp", "2"], ["--tp", "2", "--pp", "2"]):
        r = run_tandem("generate", "--model", MODEL, *plan, *args, check=False)
        assert r.returncode == 0, r.describe()
        assert r.stdout == one.stdout, (plan, r.describe())
        if plan != ["--tp", "1"]:
            assert "plan: " in r.stderr and "ranks" in r.stderr, r.describe()


def test_moe_plans():
    moe = os.path.join(os.environ.get("TANDEM_TEST_MODELS", ""), "gguf/qwen2moe-f32.gguf")
    # 8 experts, top-2 (tests/models/make_models.py): EP defaults to the TP group.
    r = run_tandem("generate", "--model", moe, "--tp", "2", "--plan-dry-run", check=False)
    assert r.returncode == 0, r.describe()
    assert "ep 2 (8 experts, 2 per token)" in r.stdout, r.stdout
    assert "EP 2: experts (4 per rank)" in r.stdout, r.stdout
    r = run_tandem("generate", "--model", moe, "--tp", "2", "--cp", "2", "--ep", "3",
                   "--plan-dry-run", check=False)
    assert r.returncode == 2, r.describe()
    assert "--ep 3 does not divide the 8 experts" in r.stderr, r.describe()


def test_plan_memory_is_checked_against_the_host():
    # 2 ranks with a 4 TiB KV pool each: more than any test machine has.
    r = run_tandem("serve", "--model", MODEL, "--tp", "2", "--kv-memory", "4096G", "--port", "0",
                   check=False, timeout=60)
    assert r.returncode != 0, r.describe()
    assert "GiB available" in r.stderr and "2 ranks need about" in r.stderr, r.describe()
    assert not stale_exec_segments()
