"""The real Qwen2.5-Coder-0.5B-Instruct Q4_K_M file (scripts/fetch-test-models.sh)
answers a chat request through the OpenAI API of `tandem serve` (the PyPI
`openai` client) and through a 1P+1D cluster (`tandem up --chat`), and both
answers contain Paris. Its own template mentions tools, which the built-in
template families refuse until the chat-template work lands, so both run
with --chat-template chatml (docs/MODELS.md)."""

from reference_util import kquant_model_path as model_path
from serve_util import serve  # noqa: F401 (fixture)

QUESTION = "What is the capital of France? Answer in one word."


def test_serve_answers_paris(serve):  # noqa: F811
    import openai

    s = serve(model_path(), "--chat-template", "chatml", "--threads", "2", ready_timeout=120)
    client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="none")
    name = client.models.list().data[0].id
    r = client.chat.completions.create(model=name,
                                       messages=[{"role": "user", "content": QUESTION}],
                                       max_tokens=16, temperature=0)
    answer = r.choices[0].message.content
    assert "Paris" in answer, answer


def test_one_prefill_one_decode_answer_paris(tandem):
    r = tandem("up", "--model", model_path(), "--port", "0", "--grpc-port", "0",
               "--threads", "1", "--router-arg", "--chat-template", "--router-arg", "chatml",
               "--prefill-arg", "--chat-template", "--prefill-arg", "chatml",
               "--decode-arg", "--chat-template", "--decode-arg", "chatml",
               "--chat", QUESTION, "--max-tokens", "16", timeout=300)
    first, answer = r.stdout.split("\n", 1)
    assert "Paris" in answer, r.describe()
    assert "tandem up: stopped\n" in r.stderr, r.describe()


def test_tp_split_off_a_super_block_is_refused(tandem):
    """--tp 2 would cut ffn_down's 4864 Q6_K columns into 2432, not whole
    256-element super-blocks: one clear error naming the tensor and the
    plan, exit 1, no rank left behind."""
    r = tandem("generate", "--model", model_path(), "--prompt", "hi", "--max-tokens", "1",
               "--tp", "2", check=False, timeout=120)
    assert r.returncode == 1, r.describe()
    assert "tensor 'blk.0.ffn_down.weight'" in r.stderr, r.describe()
    assert "(--tp 2)" in r.stderr and "q6_K block boundaries (256 elements)" in r.stderr, \
        r.describe()
    assert "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r.describe()
