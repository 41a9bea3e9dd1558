#!/usr/bin/env python3
"""Replay requests one after another against a running `hydraspec serve` (e.g. with --learn), with an idle gap
between them, and record per request: the tokens emitted per target forward (from the server's /metrics
counters, exact because one request runs at a time), time to first token, decoding tokens per second, and the
learning state /health reports. With --plot, tokens per forward against the request number (a rolling mean),
one line per run given to --plot.

    hydraspec serve --model smollm2-135m-instruct --method hydra --learn learn-dir --port 8011 &
    python benchmarks/learn_replay.py --base http://127.0.0.1:8011 --prompts P1.jsonl P2.jsonl --limit 300 \\
        --gap 1.0 --out learn-on.jsonl
    python benchmarks/learn_replay.py --plot learn-on.jsonl learn-off.jsonl --png learn.png
    python benchmarks/learn_replay.py --compare learn-on.jsonl learn-off.jsonl

--compare prints a markdown table by blocks of requests (tokens per forward, time to first token, decoding
speed, the learning state) and the paired differences of the time to first token, request by request.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx

from hydraspec.bench.prompts import load_questions


def counters(client: httpx.Client, base: str) -> dict[str, float]:
    out = {}
    for line in client.get(base + "/metrics").text.splitlines():
        if line.startswith(("hydraspec_row_forwards ", "hydraspec_emitted_tokens ")):
            name, value = line.split()
            out[name] = float(value)
    return out


def one(client: httpx.Client, base: str, model: str, text: str, max_tokens: int) -> dict:
    """One streamed chat request: time to first token, decoding seconds, completion text."""
    t0 = time.perf_counter()
    first, parts = None, []
    body = {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True}
    with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            delta = (ch.get("choices") or [{}])[0].get("delta", {}).get("content")
            if delta:
                first = first or time.perf_counter()
                parts.append(delta)
    end = time.perf_counter()
    return {"ttft": (first or end) - t0, "decode_s": end - (first or end), "text": "".join(parts)}


def replay(args) -> None:
    qs = load_questions(args.prompts, skip=args.skip)
    random.Random(0).shuffle(qs)
    qs = qs[: args.limit]
    with httpx.Client(timeout=600) as client, open(args.out, "w") as f:
        model = client.get(args.base + "/v1/models").json()["data"][0]["id"]
        for i, q in enumerate(qs):
            before = counters(client, args.base)
            res = one(client, args.base, model, q.turns[0], args.max_tokens)
            after = counters(client, args.base)
            tokens = after["hydraspec_emitted_tokens"] - before["hydraspec_emitted_tokens"]
            forwards = after["hydraspec_row_forwards"] - before["hydraspec_row_forwards"]
            learning = client.get(args.base + "/health").json().get("learning")
            rec = {"i": i, "id": f"{q.source}-{q.question_id}", "tokens": tokens, "forwards": forwards,
                   "per_forward": tokens / forwards if forwards else 0.0, "ttft": round(res["ttft"], 4),
                   "decode_tok_s": round((tokens - 1) / res["decode_s"], 2) if res["decode_s"] > 0 else None,
                   "learning": learning, "text": res["text"]}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            print(f"{i:4d} {rec['id']:24s} {rec['per_forward']:.2f} tokens/forward, ttft {rec['ttft']:.2f} s"
                  + (f", swaps {learning['swaps']} score {learning['score']}" if learning else ""), flush=True)
            time.sleep(args.gap)


def plot(paths: list[str], png: str, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for p in paths:
        recs = [json.loads(line) for line in open(p)]
        ys = [r["per_forward"] for r in recs]
        roll = [sum(ys[max(0, i - window + 1): i + 1]) / len(ys[max(0, i - window + 1): i + 1]) for i in range(len(ys))]
        ax.plot(range(len(ys)), roll, label=p.rsplit("/", 1)[-1].removesuffix(".jsonl"))
    ax.set_xlabel("request")
    ax.set_ylabel(f"tokens per target forward (mean of the last {window})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def compare(on_path: str, off_path: str, block: int) -> None:
    """The two replays side by side (the same requests in the same order)."""
    on, off = ([json.loads(line) for line in open(p)] for p in (on_path, off_path))
    n = min(len(on), len(off))
    print("| requests | tokens per forward, learning / not | TTFT p50 s, learning / not | TTFT p90 | TTFT max | "
          "decoding tokens/s (median), learning / not | held-out score | swaps |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for a in range(0, n, block):
        x, y = on[a:a + block], off[a:a + block]
        tpf = [sum(r["tokens"] for r in c) / max(1, sum(r["forwards"] for r in c)) for c in (x, y)]
        t = [[r["ttft"] for r in c] for c in (x, y)]
        dec = [statistics.median(r["decode_tok_s"] for r in c if r["decode_tok_s"]) for c in (x, y)]
        lrn = x[-1].get("learning") or {}
        print(f"| {a + 1}-{a + len(x)} | {tpf[0]:.2f} / {tpf[1]:.2f} | {quantile(t[0], .5):.3f} / {quantile(t[1], .5):.3f} "
              f"| {quantile(t[0], .9):.3f} / {quantile(t[1], .9):.3f} | {max(t[0]):.3f} / {max(t[1]):.3f} "
              f"| {dec[0]:.1f} / {dec[1]:.1f} | {lrn.get('score', 0):.3f} | {lrn.get('swaps', 0)} |")
    t_on, t_off = [r["ttft"] for r in on[:n]], [r["ttft"] for r in off[:n]]
    diff = [a - b for a, b in zip(t_on, t_off)]
    same = sum(a["text"] == b["text"] for a, b in zip(on, off))
    print(f"\n{n} requests, {same} answers identical")
    for name, xs in (("learning", t_on), ("not", t_off)):
        print(f"TTFT {name}: p50 {quantile(xs, .5):.3f} p90 {quantile(xs, .9):.3f} p99 {quantile(xs, .99):.3f} "
              f"max {max(xs):.3f} mean {statistics.mean(xs):.3f} s")
    print(f"paired TTFT difference (learning - not): p1 {quantile(diff, .01):+.3f} p10 {quantile(diff, .1):+.3f} "
          f"p50 {quantile(diff, .5):+.3f} p90 {quantile(diff, .9):+.3f} p99 {quantile(diff, .99):+.3f} "
          f"max {max(diff):+.3f} s; slower in {sum(d > 0 for d in diff)} of {n}, by more than 0.1 s in "
          f"{sum(d > 0.1 for d in diff)}, faster by more than 0.1 s in {sum(d < -0.1 for d in diff)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="http://127.0.0.1:8011")
    p.add_argument("--prompts", nargs="+")
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--limit", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--gap", type=float, default=1.0, help="idle seconds between requests")
    p.add_argument("--out", default="replay.jsonl")
    p.add_argument("--plot", nargs="+", help="replay files to plot (no requests sent)")
    p.add_argument("--png", default="replay.png")
    p.add_argument("--window", type=int, default=30)
    p.add_argument("--compare", nargs=2, metavar=("LEARNING", "NOT"), help="two replay files to compare")
    p.add_argument("--block", type=int, default=50, help="requests per row of --compare's table")
    args = p.parse_args()
    if args.compare:
        compare(*args.compare, args.block)
    elif args.plot:
        plot(args.plot, args.png, args.window)
    else:
        replay(args)


if __name__ == "__main__":
    main()
