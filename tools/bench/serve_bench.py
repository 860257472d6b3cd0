#!/usr/bin/env python3
"""tandem bench: load-test an OpenAI-compatible completions endpoint.

Standard library only (threads + http.client), so it runs wherever Python 3.9+
does, against Tandem, vLLM, SGLang or llama.cpp's llama-server alike.
"""
import argparse
import csv
import datetime
import http.client
import json
import math
import os
import random
import socket
import sys
import threading
import time
import urllib.parse

EPILOG = """\
datasets:
  random         prompts of --input-len tokens of random common English words
                 (each prompt different, so no prefix is shared)
  shared-prefix  --num-groups system prompts of --prefix-len tokens; prompt i
                 is group (i mod G)'s system prompt followed by its own
                 question of --input-len tokens (total = prefix + input)
  multi-turn     --num-groups conversations; request i is turn (i div G) of
                 conversation (i mod G), and carries every earlier turn's
                 question and the server's real answer, then a new question
                 of --input-len tokens; a turn starts only after the previous
                 turn of its conversation has finished
  FILE           JSON Lines, one request per line:
                   {"prompt": "text", "output_len": 128}
                 (--num-prompts takes the first N lines; all by default)

  --trace FILE   a recorded trace, replayed with its timing (below)

  Lengths N[:M] are uniform integers in [N, M]. Prompt lengths are fitted with
  the server's /tokenize when it has one (vLLM-style {"prompt"} or llama.cpp's
  {"content"}), otherwise assumed one token per word; they count the prompt
  text's tokens, without the BOS or chat-template tokens the server adds (the
  report's input tokens are the server's own usage figures).

traces (--trace FILE, --trace-format auto | azure | burstgpt | mooncake):
  azure     Azure LLM inference trace CSV: TIMESTAMP,ContextTokens,GeneratedTokens
            (TIMESTAMP a date and time, e.g. 2023-11-16 18:15:46.6805900)
  burstgpt  BurstGPT CSV: Timestamp (seconds),Model,Request tokens,Response
            tokens,Total tokens,Log Type; rows with 0 response tokens (failed
            requests in the trace) are left out and counted in the notes
  mooncake  Mooncake JSON Lines: {"timestamp": ms, "input_length": N,
            "output_length": M, "hash_ids": [...]}; each hash id names a block
            of 512 prompt tokens: requests that share a hash id share that
            block's text, so the trace's prefix-cache hits happen here too
  Request i is sent at (its timestamp - the first one's) / --trace-speed
  seconds, with a prompt of its recorded length (random words, a block's
  words fixed by its hash id) and its recorded output length
  (--trace-length-scale scales both, for small models); --num-prompts takes
  the first N requests in time order.

load:
  --request-rate R   Poisson arrivals at R requests/s ("inf": all at once)
  --concurrency C    C requests in flight at all times
  Neither given: --request-rate inf; a trace brings its own arrivals.

measurements (vLLM's definitions):
  TTFT   time from sending the request to the first chunk with non-empty text
  ITL    gaps between consecutive text-bearing chunks
  TPOT   (E2E - TTFT) / (output tokens - 1), requests with > 1 output token
  E2E    time from sending the request to the end of the stream
  prefix-cache hit rate  cached / prompt tokens over the requests whose usage
         has prompt_tokens_details.cached_tokens (OpenAI's field: prompt
         tokens served from a prefix cache); null when none has it
  output tokens come from the usage chunk (stream_options.include_usage);
  goodput = requests meeting every --slo bound per second of the run.
  Every request opens its own connection; its times include the connect.

errors are counted by kind: http_<status>, timeout, connection,
stream_error (an error event inside the stream), incomplete_stream (the
stream ended without [DONE]), bad_response (not SSE / not JSON).

exit status: 0 when at least one request completed (errors, if any, are in
the report), 1 when none did (the report is still printed), 2 for bad
arguments or an unreadable dataset file.
"""

# Common English words; with a leading space nearly every one is a single token
# in the BPE vocabularies of current models.
WORDS = (
    "the of and to in is was that for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said each which "
    "she do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over "
    "know water than call first who may down side been now find any new work part take get place "
    "made live where after back little only round man year came show every good me give our under "
    "name very through just form great think say help low line before turn cause same mean move "
    "right boy old too does tell set three want air well also play small end put home read hand "
    "port large spell add even land here must big high such follow act why ask men change went "
    "light kind off need house picture try us again animal point mother world near build self "
    "earth father head stand own page should country found answer school grow study still learn "
    "plant cover food sun four thought let keep eye never last door between city tree cross since "
    "hard start might story saw far sea draw left late run while press close night real life few "
    "stop open seem together next white children begin got walk example ease paper often always "
    "music those both mark book letter until mile river car feet care second group carry took rain "
    "eat room friend began idea fish mountain north once base hear horse cut sure watch color face "
    "wood main enough plain girl usual young ready above ever red list though feel talk bird soon "
    "body dog family direct pose leave song measure state product black short class wind question "
    "happen complete ship area half rock order fire south problem piece told knew pass farm top "
    "whole king size heard best hour better true during hundred am remember step early hold west "
    "ground interest reach fast five sing listen six table travel less morning ten simple several "
    "toward war lay against pattern slow center love person money serve appear road map science "
    "rule govern pull cold notice voice fall power town fine certain fly unit lead cry dark machine "
    "note wait plan figure star box noun field rest correct able pound done beauty drive stood "
    "contain front teach week final gave green oh quick develop sleep warm free minute strong "
    "special mind behind clear tail produce fact street inch lot nothing course stay wheel full "
    "force blue object decide surface deep moon island foot yet busy test record boat common gold "
    "possible plane age dry wonder laugh thousand ago ran check game shape yes hot miss brought "
    "heat snow bed bring sit perhaps fill east weight language among"
).split()


class UsageError(Exception):
    pass


TRACE_FORMATS = ("azure", "burstgpt", "mooncake")
MOONCAKE_BLOCK = 512  # prompt tokens per hash id in Mooncake traces


# ---------------------------------------------------------------- arguments


def parse_range(text, name, minimum=1):
    parts = text.split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise UsageError(f"{name}: expected N or N:M, got {text!r}")
    if lo < minimum or hi < lo:
        raise UsageError(f"{name}: need {minimum} <= N <= M, got {text!r}")
    return lo, hi


def parse_slo(text):
    slo = {}
    for part in text.split(","):
        key, sep, val = part.partition(":")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot", "e2e"):
            raise UsageError(f"--slo: expected ttft:MS,tpot:MS[,e2e:MS], got {text!r}")
        try:
            ms = float(val)
        except ValueError:
            raise UsageError(f"--slo: {key} needs a number of milliseconds, got {val!r}")
        if not ms > 0:
            raise UsageError(f"--slo: {key} must be > 0 ms")
        slo[key] = ms
    return slo


def parse_rate(text):
    if text.lower() in ("inf", "infinity"):
        return math.inf
    try:
        r = float(text)
    except ValueError:
        raise UsageError(f"--request-rate: expected a number or inf, got {text!r}")
    if not r > 0:
        raise UsageError("--request-rate must be > 0")
    return r


def build_parser():
    p = argparse.ArgumentParser(
        prog="tandem bench",
        description="Load-test an OpenAI-compatible endpoint (Tandem, vLLM, SGLang, "
        "llama-server): streams every request, reports TTFT/TPOT/ITL/E2E percentiles, "
        "throughput, goodput and errors.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to request (default: the first of GET /v1/models)")
    p.add_argument("--dataset", default="random",
                   help="random | shared-prefix | multi-turn | FILE (default random)")
    p.add_argument("--num-prompts", type=int, help="number of requests (default 100; FILE: all)")
    p.add_argument("--input-len", default="256", help="prompt tokens, N or N:M (default 256)")
    p.add_argument("--output-len", default="64", help="output tokens, N or N:M (default 64)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--request-rate", help="Poisson arrival rate in requests/s, or inf")
    load.add_argument("--concurrency", type=int, help="requests kept in flight")
    p.add_argument("--slo", help="ttft:MS,tpot:MS[,e2e:MS]: a request is good if all hold")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts, lengths, arrivals")
    p.add_argument("--json", metavar="OUT", help="write every figure and per-request records here")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as Authorization: Bearer KEY (default $OPENAI_API_KEY)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions or /v1/chat/completions (default completions)")
    p.add_argument("--prefix-len", type=int, default=256,
                   help="shared-prefix: tokens of each shared system prompt (default 256)")
    p.add_argument("--num-groups", type=int, default=4,
                   help="shared-prefix: system prompts; multi-turn: conversations (default 4)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a request may take, and may stay silent (default 300)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="send ignore_eos and min_tokens = max_tokens so outputs have exactly "
                   "the requested length (default: on for the synthetic datasets, off for FILE)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    p.add_argument("--request-seed", type=int,
                   help="send seed N + the request's index with each request (seeded sampling "
                   "that can be replayed request by request)")
    p.add_argument("--record-text", action="store_true",
                   help="--json keeps each request's body and the text it streamed back (to "
                   "check the answers against a reference)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--trace", metavar="FILE", help="replay a recorded trace with its timing")
    p.add_argument("--trace-format", choices=("auto",) + TRACE_FORMATS, default="auto",
                   help="the trace's format (default: from its header or first line)")
    p.add_argument("--trace-speed", type=float, default=1.0,
                   help="replay this many times faster than recorded (default 1)")
    p.add_argument("--trace-length-scale", type=float, default=1.0,
                   help="scale the recorded prompt and output lengths (default 1)")
    return p


# ---------------------------------------------------------------- HTTP


class Server:
    def __init__(self, url, api_key, timeout):
        u = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise UsageError(f"--url: expected http://HOST:PORT[/prefix], got {url!r}")
        self.https = u.scheme == "https"
        self.host = u.hostname
        try:
            self.port = u.port or (443 if self.https else 80)
        except ValueError:
            raise UsageError(f"--url: bad port in {url!r}")
        base = u.path.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        self.base = base
        self.api_key = api_key
        self.timeout = timeout
        self.display = f"{u.scheme}://{u.netloc}{base}"

    def connect(self, timeout=None):
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout or self.timeout)

    def headers(self):
        h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def call(self, method, path, obj=None, timeout=None):
        """Small non-streaming request: (status, parsed JSON or None)."""
        conn = self.connect(timeout)
        try:
            body = json.dumps(obj).encode() if obj is not None else None
            conn.request(method, self.base + path, body=body, headers=self.headers())
            resp = conn.getresponse()
            data = resp.read()
            try:
                return resp.status, json.loads(data)
            except ValueError:
                return resp.status, None
        finally:
            conn.close()


class TokenCounter:
    """Counts prompt tokens with the server's /tokenize (vLLM or llama.cpp style)."""

    def __init__(self, server, model):
        self.server, self.model, self.style = server, model, None
        self.lock = threading.Lock()
        probes = [
            ("vllm", {"model": model, "prompt": " the time", "add_special_tokens": False}),
            ("llama", {"content": " the time", "add_special": False}),
        ]
        for style, body in probes:
            try:
                status, obj = server.call("POST", "/tokenize", body, timeout=min(10.0, server.timeout))
            except (OSError, http.client.HTTPException):
                return
            # llama-server answers a body without "content" with no tokens.
            if (status == 200 and isinstance(obj, dict) and isinstance(obj.get("tokens"), list)
                    and len(obj["tokens"]) > 0):
                self.style = style
                return

    def count(self, text):
        if self.style == "vllm":
            body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        else:
            body = {"content": text, "add_special": False}
        status, obj = self.server.call("POST", "/tokenize", body, timeout=min(30.0, self.server.timeout))
        if status != 200 or not isinstance(obj, dict) or not isinstance(obj.get("tokens"), list):
            raise RuntimeError(f"/tokenize answered {status}")
        return len(obj["tokens"])


# ---------------------------------------------------------------- datasets


class Item:
    """One request. Multi-turn items point at the previous turn of their
    conversation and are built when they are sent."""

    def __init__(self, idx, in_len, out_len):
        self.idx, self.in_len, self.out_len = idx, in_len, out_len
        self.group = None
        self.turn = 0
        self.prev = None
        self.prefix = ""  # shared system prompt (shared-prefix)
        self.text = ""  # this request's own prompt text / question
        self.answer = ""  # filled in when it completes (multi-turn)
        self.arrival = None  # seconds after the start (traces)
        self.blocks = None  # [(hash id, tokens)] of its prompt (Mooncake traces)
        self.done = threading.Event()


def words_text(words):
    return "".join(" " + w for w in words)


def fit_prompt(rng, target, counter, notes):
    """Random words whose token count is close to target (exact when the
    server can tokenize, since one word moves the count by ~1 token)."""
    pool = [rng.choice(WORDS) for _ in range(2 * target + 16)]
    if counter is None or counter.style is None:
        return words_text(pool[:target])
    try:
        k = target
        n = counter.count(words_text(pool[:k]))
        best = (abs(n - target), k)
        seen = {k}
        for _ in range(8):
            if n == target:
                break
            step = (target - n) * k / max(n, 1)
            k2 = min(len(pool), max(1, k + int(round(step))))
            if k2 == k:
                k2 = min(len(pool), max(1, k + (1 if n < target else -1)))
            if k2 in seen:
                break
            seen.add(k2)
            k = k2
            n = counter.count(words_text(pool[:k]))
            best = min(best, (abs(n - target), k))
        return words_text(pool[: best[1]])
    except (OSError, http.client.HTTPException, RuntimeError) as e:
        notes.add(f"/tokenize failed during calibration ({e}); assuming 1 token per word")
        return words_text(pool[:target])


def parallel_map(fn, args, workers=4):
    out = [None] * len(args)
    errors = []
    it = iter(enumerate(args))
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                nxt = next(it, None)
            if nxt is None:
                return
            i, a = nxt
            try:
                out[i] = fn(*a)
            except Exception as e:  # re-raised in the caller's thread
                errors.append(e)
                return

    threads = [threading.Thread(target=work) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def json_lines(path, f):
    """(line number, object) of every non-blank line of a JSON Lines file."""
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except ValueError as e:
            raise UsageError(f"{path}:{lineno}: not JSON ({e})")


def load_file(path, limit):
    items = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise UsageError(f"--dataset {path}: {e.strerror}")
    with f:
        for lineno, obj in json_lines(path, f):
            if (not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str)
                    or not isinstance(obj.get("output_len"), int) or obj["output_len"] < 1):
                raise UsageError(f'{path}:{lineno}: expected {{"prompt": str, "output_len": int >= 1}}')
            it = Item(len(items), None, obj["output_len"])
            it.text = obj["prompt"]
            items.append(it)
            if limit is not None and len(items) >= limit:
                break
    if not items:
        raise UsageError(f"{path}: no requests")
    return items


# ---------------------------------------------------------------- traces


def _trace_int(path, lineno, what, v, minimum):
    try:
        n = int(str(v).strip())
    except ValueError:
        raise UsageError(f"{path}:{lineno}: {what} is not an integer: {v!r}")
    if n < minimum:
        raise UsageError(f"{path}:{lineno}: {what} must be >= {minimum}, not {n}")
    return n


def _azure_time(path, lineno, v):
    text = str(v).strip()
    head, _, frac = text.partition(".")
    try:  # up to 7 fractional digits in the published traces; datetime takes 6
        t = datetime.datetime.strptime(head, "%Y-%m-%d %H:%M:%S")
        return t.timestamp() + (float("0." + frac) if frac else 0.0)
    except ValueError:
        raise UsageError(f"{path}:{lineno}: TIMESTAMP is not a date and time: {text!r}")


def _trace_seconds(path, lineno, v):
    try:
        t = float(str(v).strip())
    except ValueError:
        raise UsageError(f"{path}:{lineno}: Timestamp is not a number: {v!r}")
    if not math.isfinite(t) or t < 0:
        raise UsageError(f"{path}:{lineno}: Timestamp must be a finite number >= 0, not {t}")
    return t


def read_trace(path, fmt, notes):
    """The requests of a trace file as (arrival s, input tokens, output
    tokens, hash ids or None), in time order, arrivals from 0."""
    try:
        f = open(path, encoding="utf-8", newline="")
    except OSError as e:
        raise UsageError(f"--trace {path}: {e.strerror}")
    with f:
        first = f.readline()
        f.seek(0)
        if fmt == "auto":
            head = first.strip().lstrip("\ufeff")
            fmt = ("mooncake" if head.startswith("{") else
                   "azure" if head.startswith("TIMESTAMP") else
                   "burstgpt" if head.startswith("Timestamp") else None)
            if fmt is None:
                raise UsageError(f"{path}: not a trace tandem bench knows (give --trace-format)")
        rows = []
        if fmt == "mooncake":
            for lineno, o in json_lines(path, f):
                if not isinstance(o, dict):
                    raise UsageError(f"{path}:{lineno}: expected an object")
                for k in ("timestamp", "input_length", "output_length"):
                    if not isinstance(o.get(k), int) or isinstance(o.get(k), bool):
                        raise UsageError(f"{path}:{lineno}: {k} must be an integer")
                t = _trace_int(path, lineno, "timestamp", o["timestamp"], 0) / 1000.0
                n_in = _trace_int(path, lineno, "input_length", o["input_length"], 1)
                n_out = _trace_int(path, lineno, "output_length", o["output_length"], 1)
                ids = o.get("hash_ids", [])
                if (not isinstance(ids, list)
                        or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids)):
                    raise UsageError(f"{path}:{lineno}: hash_ids must be a list of integers")
                if len(ids) != (n_in + MOONCAKE_BLOCK - 1) // MOONCAKE_BLOCK:
                    raise UsageError(f"{path}:{lineno}: {len(ids)} hash_ids for {n_in} tokens "
                                     f"(one per {MOONCAKE_BLOCK})")
                rows.append((t, n_in, n_out, ids))
        else:
            cols = (("TIMESTAMP", "ContextTokens", "GeneratedTokens") if fmt == "azure"
                    else ("Timestamp", "Request tokens", "Response tokens"))
            reader = csv.DictReader(f)
            missing = [c for c in cols if c not in (reader.fieldnames or [])]
            if missing:
                raise UsageError(f"{path}:1: the {fmt} format needs the columns {', '.join(cols)} "
                                 f"(missing {', '.join(missing)})")
            failed = 0
            for lineno, r in enumerate(reader, 2):
                if fmt == "azure":
                    t = _azure_time(path, lineno, r[cols[0]])
                else:
                    t = _trace_seconds(path, lineno, r[cols[0]])
                n_in = _trace_int(path, lineno, cols[1], r[cols[1]], 1)
                n_out = _trace_int(path, lineno, cols[2], r[cols[2]], 0)
                if n_out == 0:
                    failed += 1
                    continue
                rows.append((t, n_in, n_out, None))
            if failed:
                notes.add(f"{failed} requests of the trace with 0 response tokens left out")
    if not rows:
        raise UsageError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return fmt, [(t - t0, n_in, n_out, ids) for (t, n_in, n_out, ids) in rows]


def trace_items(args, rng, counter, notes):
    fmt, rows = read_trace(args.trace, args.trace_format, notes)
    args.trace_format_used = fmt
    if args.num_prompts is not None:
        rows = rows[: args.num_prompts]
    scale = args.trace_length_scale
    items = []
    blocks = {}  # hash id -> tokens of its text
    for i, (t, n_in, n_out, ids) in enumerate(rows):
        it = Item(i, max(1, round(n_in * scale)), max(1, round(n_out * scale)))
        it.arrival = t / args.trace_speed
        if ids is not None:
            it.blocks = []
            left = it.in_len
            for h in ids:
                n = min(left, max(1, round(MOONCAKE_BLOCK * scale)))
                if n <= 0:
                    break
                it.blocks.append((h, n))
                blocks.setdefault((h, n), None)
                left -= n
        items.append(it)
    plain = [it for it in items if it.blocks is None]
    seeds = [rng.getrandbits(64) for _ in plain]
    texts = parallel_map(fit_prompt, [(random.Random(seeds[k]), it.in_len, counter, notes)
                                      for k, it in enumerate(plain)])
    for it, t in zip(plain, texts):
        it.text = t
    keys = sorted(blocks)
    btexts = parallel_map(fit_prompt, [(random.Random((args.seed << 32) ^ h), n, counter, notes)
                                       for (h, n) in keys])
    blocks = dict(zip(keys, btexts))
    for it in items:
        if it.blocks is not None:
            it.text = "".join(blocks[b] for b in it.blocks)
    return items


def build_dataset(args, rng, counter, notes):
    if args.trace:
        return trace_items(args, rng, counter, notes)
    kind = args.dataset
    if kind not in ("random", "shared-prefix", "multi-turn"):
        return load_file(kind, args.num_prompts)
    n = args.num_prompts if args.num_prompts is not None else 100
    ilo, ihi = args.input_len_range
    olo, ohi = args.output_len_range
    items = [Item(i, rng.randint(ilo, ihi), rng.randint(olo, ohi)) for i in range(n)]
    seeds = [rng.getrandbits(64) for _ in range(n)]
    jobs = [(random.Random(seeds[i]), it.in_len, counter, notes) for i, it in enumerate(items)]
    texts = parallel_map(fit_prompt, jobs)
    for it, t in zip(items, texts):
        it.text = t
    g = max(1, min(args.num_groups, n))
    if kind == "shared-prefix":
        pseeds = [rng.getrandbits(64) for _ in range(g)]
        prefixes = parallel_map(fit_prompt, [(random.Random(s), args.prefix_len, counter, notes)
                                             for s in pseeds])
        for it in items:
            it.group = it.idx % g
            it.prefix = prefixes[it.group]
    elif kind == "multi-turn":
        last = {}
        for it in items:
            it.group = it.idx % g
            it.turn = it.idx // g
            it.prev = last.get(it.group)
            last[it.group] = it
    return items


def request_body(args, item):
    out = item.out_len
    if args.endpoint == "chat":
        msgs = []
        if item.prefix:
            msgs.append({"role": "system", "content": item.prefix.strip()})
        chain = []
        p = item.prev
        while p is not None:
            chain.append(p)
            p = p.prev
        for p in reversed(chain):
            msgs.append({"role": "user", "content": p.text.strip()})
            msgs.append({"role": "assistant", "content": p.answer})
        msgs.append({"role": "user", "content": item.text.strip()})
        body = {"model": args.model, "messages": msgs}
    else:
        if args.dataset == "multi-turn":
            chain = []
            p = item.prev
            while p is not None:
                chain.append(p)
                p = p.prev
            parts = [f"User:{p.text}\nAssistant: {p.answer}\n" for p in reversed(chain)]
            prompt = "".join(parts) + f"User:{item.text}\nAssistant:"
        else:
            prompt = item.prefix + item.text
        body = {"model": args.model, "prompt": prompt}
    body.update({
        "max_tokens": out,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    })
    if args.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = out
    if args.request_seed is not None:
        body["seed"] = args.request_seed + item.idx
    return body


# ---------------------------------------------------------------- one request


def run_one(server, args, item, t_bench):
    rec = {
        "index": item.idx,
        "group": item.group,
        "turn": item.turn,
        "input_len": item.in_len,
        "output_len": item.out_len,
        "prompt_tokens": None,
        "cached_tokens": None,
        "output_tokens": None,
        "usage": False,
        "start_s": None,
        "ttft_ms": None,
        "tpot_ms": None,
        "e2e_ms": None,
        "itl_ms": [],
        "success": False,
        "error_kind": None,
        "error": None,
    }
    path = server.base + ("/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions")
    body = request_body(args, item)
    data = json.dumps(body).encode()
    if args.record_text:
        rec["body"] = body
    chat = args.endpoint == "chat"
    pieces = []
    chunks = 0
    conn = None
    t0 = time.perf_counter()
    rec["start_s"] = t0 - t_bench
    t_first = t_last = None
    deadline = t0 + args.timeout

    def fail(kind, msg):
        rec["error_kind"], rec["error"] = kind, str(msg)[:500]

    try:
        conn = server.connect()
        conn.request("POST", path, body=data, headers=server.headers())
        resp = conn.getresponse()
        if resp.status != 200:
            raw = resp.read(65536)
            msg = raw.decode("utf-8", "replace")
            try:
                err = json.loads(raw)
                if isinstance(err, dict):
                    e = err.get("error", err)
                    msg = e.get("message", msg) if isinstance(e, dict) else str(e)
            except ValueError:
                pass
            fail(f"http_{resp.status}", msg)
            return rec
        finished = False
        for raw in resp:
            now = time.perf_counter()
            if now > deadline:
                fail("timeout", f"no end of stream after {args.timeout:g} s")
                break
            line = raw.strip()
            if not line or line.startswith(b":") or not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                finished = True
                break
            try:
                obj = json.loads(payload)
            except ValueError:
                fail("bad_response", f"not JSON: {payload[:200]!r}")
                break
            if not isinstance(obj, dict):
                fail("bad_response", f"not an object: {payload[:200]!r}")
                break
            if obj.get("error") is not None:
                e = obj["error"]
                fail("stream_error", e.get("message", e) if isinstance(e, dict) else e)
                break
            if rec.get("id") is None and isinstance(obj.get("id"), str):
                rec["id"] = obj["id"]  # lets a caller pair it with the server's log
            usage = obj.get("usage")
            if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                rec["output_tokens"] = int(usage["completion_tokens"])
                if usage.get("prompt_tokens") is not None:
                    rec["prompt_tokens"] = int(usage["prompt_tokens"])
                details = usage.get("prompt_tokens_details")
                if isinstance(details, dict) and details.get("cached_tokens") is not None:
                    rec["cached_tokens"] = int(details["cached_tokens"])
                rec["usage"] = True
            text = ""
            for ch in obj.get("choices") or []:
                if chat:
                    d = ch.get("delta") or {}
                    text += (d.get("content") or "") + (d.get("reasoning_content") or "")
                else:
                    text += ch.get("text") or ""
            if text:
                chunks += 1
                pieces.append(text)
                if t_first is None:
                    t_first = now
                else:
                    rec["itl_ms"].append((now - t_last) * 1e3)
                t_last = now
        else:
            if rec["error_kind"] is None:
                fail("incomplete_stream", "the stream ended without data: [DONE]")
        if finished and rec["error_kind"] is None:
            t_end = time.perf_counter()
            rec["success"] = True
            rec["e2e_ms"] = (t_end - t0) * 1e3
            if t_first is None:  # no text at all: the first token is the end
                t_first = t_end
            rec["ttft_ms"] = (t_first - t0) * 1e3
            if not rec["usage"]:
                rec["output_tokens"] = chunks
            n = rec["output_tokens"]
            if n > 1:
                rec["tpot_ms"] = (rec["e2e_ms"] - rec["ttft_ms"]) / (n - 1)
    except (socket.timeout, TimeoutError):
        fail("timeout", f"silent for {args.timeout:g} s")
    except (ConnectionError, OSError) as e:
        fail("connection", e.strerror or e)
    except http.client.IncompleteRead as e:
        fail("incomplete_stream", repr(e))
    except http.client.HTTPException as e:
        fail("bad_response", repr(e))
    finally:
        if conn is not None:
            conn.close()
        item.answer = "".join(pieces)
        if args.record_text:
            rec["text"] = item.answer
    return rec


# ---------------------------------------------------------------- load


class Progress:
    def __init__(self, total, enabled):
        self.total, self.done, self.failed, self.tokens = total, 0, 0, 0
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.t0 = time.perf_counter()
        self.last_decile = -1
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def start(self):
        self.t0 = time.perf_counter()
        if self.enabled:
            self.thread.start()

    def add(self, rec):
        with self.lock:
            self.done += 1
            self.failed += 0 if rec["success"] else 1
            self.tokens += (rec["output_tokens"] or 0) if rec["success"] else 0

    def line(self):
        el = time.perf_counter() - self.t0
        width = 30
        fill = int(width * self.done / max(1, self.total))
        bar = "#" * fill + "." * (width - fill)
        rate = self.tokens / el if el > 0 else 0.0
        return (f"[{bar}] {self.done}/{self.total} requests, {self.failed} failed, "
                f"{el:.1f} s, {rate:.1f} output tok/s")

    def loop(self):
        while not self.stop.wait(0.25):
            self.show()
        self.show(final=True)

    def show(self, final=False):
        with self.lock:
            if self.tty:
                sys.stderr.write("\r" + self.line() + ("\n" if final else ""))
                sys.stderr.flush()
                return
            decile = 10 * self.done // max(1, self.total)
            if decile > self.last_decile or final and self.last_decile < 10:
                self.last_decile = decile
                sys.stderr.write(self.line() + "\n")
                sys.stderr.flush()

    def finish(self):
        if self.enabled:
            self.stop.set()
            self.thread.join()


def run_load(server, args, items, progress):
    records = [None] * len(items)
    t_bench = time.perf_counter()
    progress.start()

    def execute(item):
        if item.prev is not None:
            item.prev.done.wait()
        rec = run_one(server, args, item, t_bench)
        records[item.idx] = rec
        item.done.set()
        progress.add(rec)

    if args.concurrency is not None:
        # Workers take the lowest-numbered request whose previous turn is done.
        cond = threading.Condition()
        pending = list(items)

        def worker():
            while True:
                with cond:
                    while True:
                        if not pending:
                            return
                        pick = next((it for it in pending
                                     if it.prev is None or it.prev.done.is_set()), None)
                        if pick is not None:
                            pending.remove(pick)
                            break
                        cond.wait()
                execute(pick)
                with cond:
                    cond.notify_all()

        threads = [threading.Thread(target=worker, daemon=True)
                   for _ in range(min(args.concurrency, len(items)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        rate = args.rate
        rng = random.Random(args.seed ^ 0x5EED)
        threads = []
        t_next = 0.0
        for it in items:
            if it.arrival is not None:  # a trace's own timing
                delay = t_bench + it.arrival - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            elif rate != math.inf:
                delay = t_bench + t_next - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                t_next += rng.expovariate(rate)
            t = threading.Thread(target=execute, args=(it,), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
    duration = time.perf_counter() - t_bench
    progress.finish()
    return records, duration


# ---------------------------------------------------------------- report


def percentile(sorted_vals, p):
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_vals:
        return None
    k = (len(sorted_vals) - 1) * p / 100.0
    f = int(math.floor(k))
    c = min(f + 1, len(sorted_vals) - 1)
    return sorted_vals[f] + (sorted_vals[c] - sorted_vals[f]) * (k - f)


def summary(vals):
    v = sorted(vals)
    if not v:
        return {"count": 0, "mean": None, "min": None, "p50": None, "p90": None,
                "p95": None, "p99": None, "max": None}
    return {"count": len(v), "mean": sum(v) / len(v), "min": v[0],
            "p50": percentile(v, 50), "p90": percentile(v, 90), "p95": percentile(v, 95),
            "p99": percentile(v, 99), "max": v[-1]}


def is_good(rec, slo):
    if not rec["success"]:
        return False
    if "ttft" in slo and rec["ttft_ms"] > slo["ttft"]:
        return False
    if "tpot" in slo and rec["tpot_ms"] is not None and rec["tpot_ms"] > slo["tpot"]:
        return False
    if "e2e" in slo and rec["e2e_ms"] > slo["e2e"]:
        return False
    return True


def make_report(args, server, records, duration, notes, calibrated):
    ok = [r for r in records if r["success"]]
    errors = {}
    for r in records:
        if not r["success"]:
            errors[r["error_kind"]] = errors.get(r["error_kind"], 0) + 1
    in_tok = sum(r["prompt_tokens"] or 0 for r in ok)
    with_cached = [r for r in ok if r["cached_tokens"] is not None and r["prompt_tokens"]]
    cached_in = sum(r["prompt_tokens"] for r in with_cached)
    out_tok = sum(r["output_tokens"] or 0 for r in ok)
    good = sum(1 for r in ok if is_good(r, args.slo)) if args.slo else None
    itl = [x for r in ok for x in r["itl_ms"]]
    mode = ({"concurrency": args.concurrency} if args.concurrency is not None
            else {"trace_arrivals": True} if args.trace
            else {"request_rate": None if args.rate == math.inf else args.rate})
    return {
        "url": server.display,
        "endpoint": args.endpoint,
        "model": args.model,
        "dataset": f"trace:{args.trace_format_used}" if args.trace else args.dataset,
        "trace": ({"file": args.trace, "format": args.trace_format_used,
                   "speed": args.trace_speed, "length_scale": args.trace_length_scale}
                  if args.trace else None),
        "num_prompts": len(records),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prefix_len": args.prefix_len if args.dataset == "shared-prefix" else None,
        "num_groups": args.num_groups if args.dataset in ("shared-prefix", "multi-turn") else None,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        "mode": mode,
        "slo_ms": args.slo or None,
        "prompt_lengths_calibrated": calibrated,
        "notes": sorted(notes),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": errors,
        "requests_without_usage": sum(1 for r in ok if not r["usage"]),
        "duration_s": duration,
        "total_input_tokens": in_tok,
        "prefix_cache_hit_rate": (sum(r["cached_tokens"] for r in with_cached) / cached_in
                                  if cached_in else None),
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tok / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration if duration > 0 else 0.0,
        "good_requests": good,
        "goodput": (good / duration if duration > 0 else 0.0) if good is not None else None,
        "ttft_ms": summary(r["ttft_ms"] for r in ok),
        "tpot_ms": summary(r["tpot_ms"] for r in ok if r["tpot_ms"] is not None),
        "itl_ms": summary(itl),
        "e2e_ms": summary(r["e2e_ms"] for r in ok),
        "requests": records,
    }


def fmt(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}"


def print_table(rep, out):
    w = 36

    def row(label, val):
        out.write(f"{label:<{w}}{val}\n")

    out.write("=" * 20 + " tandem bench " + "=" * 20 + "\n")
    row("Endpoint:", f"{rep['url']} ({rep['endpoint']})")
    row("Model:", rep["model"])
    ds = rep["dataset"]
    if ds == "shared-prefix":
        ds += f" ({rep['num_groups']} groups, prefix {rep['prefix_len']})"
    elif ds == "multi-turn":
        ds += f" ({rep['num_groups']} conversations)"
    if rep["trace"]:
        tr = rep["trace"]
        row("Dataset:", f"{ds} {tr['file']} (lengths x{tr['length_scale']:g})")
    else:
        row("Dataset:", f"{ds}, input {rep['input_len']}, output {rep['output_len']}")
    m = rep["mode"]
    if "concurrency" in m:
        row("Load:", f"concurrency {m['concurrency']}")
    elif "trace_arrivals" in m:
        row("Load:", f"the trace's arrivals, x{rep['trace']['speed']:g} speed")
    else:
        row("Load:", "all at once" if m["request_rate"] is None
            else f"Poisson, {m['request_rate']:g} req/s")
    row("Successful requests:", rep["completed"])
    row("Failed requests:", rep["failed"])
    row("Benchmark duration (s):", fmt(rep["duration_s"]))
    row("Total input tokens:", rep["total_input_tokens"])
    row("Total output tokens:", rep["total_output_tokens"])
    if rep["prefix_cache_hit_rate"] is not None:
        row("Prefix-cache hit rate:", fmt(rep["prefix_cache_hit_rate"], 3))
    row("Request throughput (req/s):", fmt(rep["request_throughput"], 3))
    row("Output token throughput (tok/s):", fmt(rep["output_throughput"]))
    row("Total token throughput (tok/s):", fmt(rep["total_token_throughput"]))
    if rep["slo_ms"]:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in rep["slo_ms"].items())
        row("Goodput (req/s):", f"{fmt(rep['goodput'], 3)}  ({rep['good_requests']} good; {slo})")
    out.write("-" * 54 + "\n")
    out.write(f"{'(ms)':<10}" + "".join(f"{h:>9}" for h in ("mean", "P50", "P90", "P95", "P99"))
              + "\n")
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        s = rep[key]
        out.write(f"{name:<10}" + "".join(f"{fmt(s[k]):>9}" for k in ("mean", "p50", "p90", "p95", "p99"))
                  + "\n")
    if rep["errors"]:
        out.write("-" * 54 + "\n")
        out.write("Errors: " + ", ".join(f"{k} {v}" for k, v in sorted(rep["errors"].items())) + "\n")
        first = next((r for r in rep["requests"] if not r["success"]), None)
        if first is not None:
            out.write(f"  first: {first['error_kind']}: {first['error']}\n")
    if rep["requests_without_usage"]:
        out.write(f"Note: {rep['requests_without_usage']} responses had no usage chunk; their "
                  "output tokens were counted as text chunks\n")
    for n in rep["notes"]:
        out.write(f"Note: {n}\n")
    out.write("=" * 54 + "\n")
    out.flush()


# ---------------------------------------------------------------- main


def main(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.input_len_range = parse_range(args.input_len, "--input-len")
        args.output_len_range = parse_range(args.output_len, "--output-len")
        args.slo = parse_slo(args.slo) if args.slo else {}
        args.rate = parse_rate(args.request_rate) if args.request_rate is not None else math.inf
        if args.concurrency is not None and args.concurrency < 1:
            raise UsageError("--concurrency must be >= 1")
        if args.num_prompts is not None and args.num_prompts < 1:
            raise UsageError("--num-prompts must be >= 1")
        if args.prefix_len < 1:
            raise UsageError("--prefix-len must be >= 1")
        if args.num_groups < 1:
            raise UsageError("--num-groups must be >= 1")
        if not args.timeout > 0:
            raise UsageError("--timeout must be > 0")
        synthetic = args.dataset in ("random", "shared-prefix", "multi-turn")
        if args.trace:
            if args.request_rate is not None or args.concurrency is not None:
                raise UsageError("--trace brings its own arrivals: no --request-rate or "
                                 "--concurrency")
            if args.dataset != "random":
                raise UsageError("--trace replaces --dataset")
            if not (math.isfinite(args.trace_speed) and args.trace_speed > 0):
                raise UsageError("--trace-speed must be > 0")
            if not (math.isfinite(args.trace_length_scale) and args.trace_length_scale > 0):
                raise UsageError("--trace-length-scale must be > 0")
        args.trace_format_used = None
        if args.ignore_eos is None:
            args.ignore_eos = synthetic or bool(args.trace)
        server = Server(args.url, args.api_key, args.timeout)
        if not args.trace and not synthetic and not os.path.isfile(args.dataset):
            raise UsageError(f"--dataset: {args.dataset!r} is neither random, shared-prefix, "
                             "multi-turn nor a file")
    except UsageError as e:
        parser.print_usage(sys.stderr)
        sys.stderr.write(f"tandem bench: {e}\n")
        return 2

    notes = set()
    if args.model is None:
        try:
            status, obj = server.call("GET", "/v1/models", timeout=min(10.0, args.timeout))
            args.model = obj["data"][0]["id"]
        except (OSError, http.client.HTTPException, KeyError, IndexError, TypeError) as e:
            sys.stderr.write(f"tandem bench: cannot list the models at {server.display} "
                             f"({e}); pass --model\n")
            return 1

    rng = random.Random(args.seed)
    counter = None
    if args.trace or args.dataset in ("random", "shared-prefix", "multi-turn"):
        counter = TokenCounter(server, args.model)
        if counter.style is None:
            notes.add("the server has no usable /tokenize: prompt lengths assume 1 token per word")
    try:
        items = build_dataset(args, rng, counter, notes)
    except UsageError as e:
        sys.stderr.write(f"tandem bench: {e}\n")
        return 2
    calibrated = counter is not None and counter.style is not None and not any(
        "calibration" in n for n in notes)

    # Rate mode runs one thread per request in flight: small stacks keep
    # thousands of them cheap (http.client and json need little).
    threading.stack_size(512 * 1024)
    progress = Progress(len(items), not args.no_progress)
    records, duration = run_load(server, args, items, progress)
    rep = make_report(args, server, records, duration, notes, calibrated)
    print_table(rep, sys.stdout)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rep, f, indent=1)
            f.write("\n")
    return 0 if rep["completed"] > 0 else 1


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.stderr.write("\ntandem bench: interrupted\n")
        sys.exit(130)
