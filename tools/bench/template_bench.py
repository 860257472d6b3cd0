#!/usr/bin/env python3
"""Chat-template rendering cost: Tandem's engine (td-template --repeat)
against Python jinja2 through transformers' own renderer, on the same
template and conversation (a 20-turn conversation with 5 tools, tool calls
and tool results), medians of several rounds, for docs/PERFORMANCE.md.

    python3 tools/bench/template_bench.py --td-template build/td-template \\
        --templates ~/.cache/tandem/templates/llama.cpp-11434.0.0 [--json OUT]

Each round renders N times on both sides; Tandem's figure is td-template's
median render (the template compiled once, as the server does), jinja2's
the median of transformers' render_jinja_template with its template cache
warm (compiled once, as vLLM and SGLang do). The ratio is jinja2 / Tandem.
"""
import argparse
import json
import pathlib
import statistics
import subprocess
import tempfile
import time

from transformers.utils import chat_template_utils

TEMPLATES = ["Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen-Qwen3-0.6B.jinja",
             "meta-llama-Llama-3.1-8B-Instruct.jinja",
             "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
             "HuggingFaceTB-SmolLM3-3B.jinja", "openai-gpt-oss-120b.jinja"]


def conversation():
    tools = []
    for i in range(5):
        tools.append({"type": "function", "function": {
            "name": f"tool_{i}", "description": f"Tool number {i}: does thing {i} to its input.",
            "parameters": {"type": "object", "properties": {
                "query": {"type": "string", "description": "what to look up"},
                "limit": {"type": "integer", "description": "how many results"},
                "filters": {"type": "object", "properties": {"lang": {"type": "string"}}}},
                "required": ["query"]}}})
    msgs = [{"role": "system", "content": "You are a helpful assistant with tools."}]
    for t in range(20):
        if t % 2 == 0:
            msgs.append({"role": "user", "content": f"Question {t}: tell me about topic {t} " * 4})
        elif t % 4 == 1:
            msgs.append({"role": "assistant", "content": "", "tool_calls": [{
                "id": f"call_{t}", "type": "function", "function": {
                    "name": f"tool_{t % 5}", "arguments": {"query": f"topic {t}", "limit": 3}}}]})
            msgs.append({"role": "tool", "tool_call_id": f"call_{t}", "content": f"result {t} " * 8})
        else:
            msgs.append({"role": "assistant", "content": f"Answer {t}: here is what I found. " * 5})
    msgs.append({"role": "user", "content": "Summarise."})
    return msgs, tools


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--td-template", required=True)
    ap.add_argument("--templates", required=True)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    msgs, tools = conversation()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        ctx = {"messages": msgs, "tools": tools, "documents": None, "add_generation_prompt": True,
               "bos_token": "<s>", "eos_token": "</s>"}
        cf = pathlib.Path(d) / "ctx.json"
        cf.write_text(json.dumps(ctx))
        for name in TEMPLATES:
            path = pathlib.Path(a.templates) / name
            text = path.read_text()
            td, py, nbytes = [], [], 0
            for _ in range(a.rounds):
                out = subprocess.run([a.td_template, str(path), str(cf), "--repeat", str(a.repeat)],
                                     capture_output=True, text=True, check=True).stdout
                r = json.loads(out)
                td.append(r["render_us_median"])
                nbytes = r["bytes"]
                times = []
                for _ in range(a.repeat):
                    t0 = time.perf_counter()
                    chat_template_utils.render_jinja_template(
                        conversations=[msgs], tools=tools, chat_template=text,
                        add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
                    times.append((time.perf_counter() - t0) * 1e6)
                py.append(statistics.median(times))
            row = {"template": name, "bytes": nbytes, "tandem_us": statistics.median(td),
                   "jinja2_us": statistics.median(py), "tandem_samples": td, "jinja2_samples": py}
            row["ratio"] = row["jinja2_us"] / row["tandem_us"]
            rows.append(row)
            print(f"{name:55s} {nbytes:7d} B  tandem {row['tandem_us']:8.1f} us  "
                  f"jinja2 {row['jinja2_us']:8.1f} us  {row['ratio']:5.1f}x")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(
            {"turns": 20, "tools": 5, "repeat": a.repeat, "rounds": a.rounds, "rows": rows},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
