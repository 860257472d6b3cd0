#!/usr/bin/env python3
"""Synthetic request traces in the public formats SREs already have, for
`tandem bench --trace` (no downloads). Standard library only.

    trace_gen.py --format azure|burstgpt|mooncake --out FILE [--num 40]
        [--rate 4] [--burst 1] [--input-median 200] [--input-sigma 0.6]
        [--output-median 32] [--output-sigma 0.5] [--prefix-share 0.5]
        [--prefix-groups 4] [--start "2023-11-16 18:15:46"] [--seed 0]

Arrivals: Poisson at --rate requests/s, or with --burst B > 1 bursty: the
gaps are drawn from a gamma distribution of the same mean and a squared
coefficient of variation of B (B times burstier than Poisson). Prompt and
output lengths: lognormal with the given medians and sigmas (of the log),
at least 1. Mooncake traces carry one hash id per 512 prompt tokens:
with probability --prefix-share a request starts with one of
--prefix-groups shared prefixes (half its blocks, the same ids for the
group), the rest of its ids are its own. The formats:
  azure     TIMESTAMP,ContextTokens,GeneratedTokens  (TIMESTAMP from --start)
  burstgpt  Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
  mooncake  {"timestamp": ms, "input_length", "output_length", "hash_ids"} per line
"""
import argparse
import datetime
import json
import math
import random
import sys

BLOCK = 512


def lengths(rng, median, sigma):
    return max(1, int(round(rng.lognormvariate(math.log(median), sigma))))


def arrivals(rng, n, rate, burst):
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        if burst > 1:  # gamma with mean 1/rate, squared CV = burst
            t += rng.gammavariate(1.0 / burst, burst / rate)
        else:
            t += rng.expovariate(rate)
    return out


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--format", required=True, choices=("azure", "burstgpt", "mooncake"))
    p.add_argument("--out", required=True)
    p.add_argument("--num", type=int, default=40)
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--burst", type=float, default=1.0)
    p.add_argument("--input-median", type=float, default=200.0)
    p.add_argument("--input-sigma", type=float, default=0.6)
    p.add_argument("--output-median", type=float, default=32.0)
    p.add_argument("--output-sigma", type=float, default=0.5)
    p.add_argument("--prefix-share", type=float, default=0.5)
    p.add_argument("--prefix-groups", type=int, default=4)
    p.add_argument("--start", default="2023-11-16 18:15:46")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.num < 1 or not a.rate > 0 or a.burst < 1 or not 0 <= a.prefix_share <= 1 \
            or a.prefix_groups < 1:
        p.error("--num >= 1, --rate > 0, --burst >= 1, --prefix-share in [0, 1], "
                "--prefix-groups >= 1")
    rng = random.Random(a.seed)
    ts = arrivals(rng, a.num, a.rate, a.burst)
    reqs = [(t, lengths(rng, a.input_median, a.input_sigma),
             lengths(rng, a.output_median, a.output_sigma)) for t in ts]
    start = datetime.datetime.strptime(a.start, "%Y-%m-%d %H:%M:%S")
    with open(a.out, "w", encoding="utf-8", newline="") as f:
        if a.format == "azure":
            f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
            for t, n_in, n_out in reqs:
                stamp = start + datetime.timedelta(seconds=t)
                # the published traces' 7 fractional digits
                f.write(f"{stamp.strftime('%Y-%m-%d %H:%M:%S')}.{stamp.microsecond:06d}0,"
                        f"{n_in},{n_out}\n")
        elif a.format == "burstgpt":
            f.write("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n")
            for t, n_in, n_out in reqs:
                f.write(f"{t:.3f},ChatGPT,{n_in},{n_out},{n_in + n_out},Conversation log\n")
        else:
            next_id = 0
            groups = []
            for _ in range(a.prefix_groups):
                groups.append(list(range(next_id, next_id + 64)))
                next_id += 64
            for t, n_in, n_out in reqs:
                n_blocks = (n_in + BLOCK - 1) // BLOCK
                ids = []
                if rng.random() < a.prefix_share and n_blocks > 1:
                    g = groups[rng.randrange(a.prefix_groups)]
                    ids = g[: n_blocks // 2]
                while len(ids) < n_blocks:
                    ids = ids + [next_id]
                    next_id += 1
                f.write(json.dumps({"timestamp": int(round(t * 1000)), "input_length": n_in,
                                    "output_length": n_out, "hash_ids": ids}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
