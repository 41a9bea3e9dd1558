"""`hydraspec bench-serve`: drive a running OpenAI-compatible server (hydraspec serve, llama-server, ...)
from N concurrent clients over a prompt file; report throughput, time to first token and inter-token
latency (p50 / p99) per concurrency, as JSON, a markdown table and a plot.

Each client sends streamed chat requests (greedy, ``max_tokens`` fixed) one after another, taking the
next conversation of a shared list; the run at concurrency N ends when every conversation has been
answered. With ``--turns N`` a conversation's turns go in order, each request re-sending the conversation
so far with the server's own answers, as chat clients do; the time to first token of later turns is
reported apart (what a prefix cache shortens). ``--reset`` starts each level cold on a server that can drop
its cache on request (hydraspec serve, vLLM: ``POST /reset_prefix_cache``). Tokens are counted from the final ``usage`` when the server
sends it (``stream_options.include_usage``), else one per content chunk.

Every request's timings are kept beside the results (``serve_samples.json``), so that with ``--pool`` a level run
again is pooled with the earlier runs of that label: throughput over their summed tokens and wall time, the
percentiles over all their requests. On a machine whose speed drifts over minutes, servers compared in rounds
of alternating order (A B, then B A) and pooled see the same drift on average.
"""
from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..errors import HydraspecError
from .prompts import load_questions


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]


def one_request(url: str, model: str, messages: list[dict], max_tokens: int, api_key: str | None,
                timeout: float) -> dict:
    """One streamed chat request: {"tokens", "ttft_s", "itl_s": [...], "wall_s", "text"}."""
    body = json.dumps({"model": model, "messages": messages, "temperature": 0,
                       "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}})
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", data=body.encode(), headers=headers)
    t0 = time.perf_counter()
    times, usage, text = [], None, []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices") or []:
                    if (ch.get("delta") or {}).get("content"):
                        times.append(time.perf_counter())
                        text.append(ch["delta"]["content"])
    except urllib.error.HTTPError as e:
        raise HydraspecError(f"the server answered {e.code}: {e.read()[:300].decode('utf-8', 'replace')}") from None
    except urllib.error.URLError as e:
        raise HydraspecError(f"cannot reach {url}: {e.reason}") from None
    end = time.perf_counter()
    tokens = int(usage["completion_tokens"]) if usage and usage.get("completion_tokens") is not None else len(times)
    return {"tokens": tokens, "ttft_s": (times[0] - t0) if times else end - t0,
            "itl_s": [b - a for a, b in zip(times, times[1:])], "wall_s": end - t0, "text": "".join(text)}


def reset_cache(url: str, api_key: str | None, timeout: float = 60.0) -> None:
    """Ask the server to drop what earlier requests left (``POST /reset_prefix_cache``: hydraspec serve, vLLM),
    so that the next run's prompts are read cold."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    req = urllib.request.Request(url.rstrip("/") + "/reset_prefix_cache", data=b"", headers=headers, method="POST")
    try:
        urllib.request.urlopen(req, timeout=timeout).read()
    except urllib.error.HTTPError as e:
        raise HydraspecError(f"{url} cannot reset its cache (POST /reset_prefix_cache answered {e.code}); "
                             "restart it before each level instead") from None
    except urllib.error.URLError as e:
        raise HydraspecError(f"cannot reach {url}: {e.reason}") from None


def converse(url, model, turns: list[str], max_tokens, api_key, timeout) -> list[dict]:
    """A conversation's turns in order, each request carrying the conversation so far; one result a turn."""
    messages, out = [], []
    for t, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        r = one_request(url, model, messages, max_tokens, api_key, timeout)
        messages.append({"role": "assistant", "content": r["text"]})
        out.append({**r, "turn": t})
    return out


class Outcomes:
    """What the clients of one run collect: every turn's result, and the first errors."""

    def __init__(self):
        self.results, self.errors, self.lock = [], [], threading.Lock()

    def converse(self, url, model, turns, max_tokens, api_key, timeout) -> bool:
        """One conversation, its results kept; False (the error kept) when a request failed."""
        try:
            r = converse(url, model, turns, max_tokens, api_key, timeout)
        except HydraspecError as e:
            self.errors.append(str(e))
            return False
        with self.lock:
            self.results.extend(r)
        return True

    def summary(self, concurrency, wall: float) -> dict:
        """The run's summary row (:func:`summarize`), its requests' results under ``samples``."""
        if self.errors:
            raise HydraspecError(self.errors[0])
        return {**summarize(self.results, concurrency, wall), "samples": self.results}


def run_level(url, model, convs: list[list[str]], concurrency, max_tokens, api_key=None, timeout=600.0) -> dict:
    """Every conversation (its user turns) answered by ``concurrency`` clients; throughput and latency."""
    todo = list(convs)
    got = Outcomes()

    def client():
        while True:
            with got.lock:
                if not todo:
                    return
                turns = todo.pop(0)
            if not got.converse(url, model, turns, max_tokens, api_key, timeout):
                return
    t0 = time.perf_counter()
    ths = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return got.summary(concurrency, time.perf_counter() - t0)


def run_open(url, model, convs: list[list[str]], rate: float, max_tokens, api_key=None, timeout=600.0,
             seed: int = 0) -> dict:
    """Open loop: conversations arrive as a Poisson process of ``rate`` per second (exponential gaps, seeded),
    each on a client of its own, however many are still waiting; throughput and latency."""
    gaps, got, threads = random.Random(seed), Outcomes(), []
    t0 = time.perf_counter()
    for turns in convs:
        th = threading.Thread(target=got.converse, args=(url, model, turns, max_tokens, api_key, timeout))
        th.start()
        threads.append(th)
        time.sleep(gaps.expovariate(rate))
    for th in threads:
        th.join()
    return got.summary(f"{rate:g}/s", time.perf_counter() - t0)


def summarize(results: list[dict], concurrency, wall: float) -> dict:
    itl = [x for r in results for x in r["itl_s"]]
    ttft = [r["ttft_s"] for r in results]
    later = [r["ttft_s"] for r in results if r.get("turn", 0) > 0]
    tokens = sum(r["tokens"] for r in results)
    row = {"concurrency": concurrency, "requests": len(results), "tokens": tokens, "wall_s": round(wall, 3),
           "tokens_per_s": round(tokens / wall, 3) if wall > 0 else 0.0,
           "ttft_p50_s": round(_percentile(ttft, 50), 4), "ttft_p99_s": round(_percentile(ttft, 99), 4),
           "itl_p50_ms": round(_percentile(itl, 50) * 1e3, 2), "itl_p99_ms": round(_percentile(itl, 99) * 1e3, 2)}
    if later:
        row["later_ttft_p50_s"] = round(_percentile(later, 50), 4)
        row["later_ttft_p99_s"] = round(_percentile(later, 99), 4)
    return row


def pool(earlier: dict | None, row: dict) -> tuple[dict, dict]:
    """A level's run (a summary row with its ``samples``) pooled with ``earlier`` runs of it ({"results",
    "wall_s", "each"}, or None): the pooled summary row and what to keep for the next. The row also gives
    ``rounds`` and each round's own tokens per second and inter-token p99 / p50 (``round_tokens_per_s``,
    ``round_itl_p99_p50``): pooled, a round on a slower machine puts the p50 and the p99 in different rounds."""
    results = [{k: r[k] for k in ("tokens", "ttft_s", "itl_s", "turn") if k in r} for r in row["samples"]]
    wall, each = row["wall_s"], [[row["tokens_per_s"], round(row["itl_p99_ms"] / max(row["itl_p50_ms"], 1e-9), 3)]]
    if earlier:
        results, wall, each = earlier["results"] + results, earlier["wall_s"] + wall, earlier["each"] + each
    return ({**summarize(results, row["concurrency"], wall), "rounds": len(each),
             "round_tokens_per_s": [e[0] for e in each], "round_itl_p99_p50": [e[1] for e in each]},
            {"results": results, "wall_s": wall, "each": each})


def table(rows: list[dict], label: str) -> str:
    later = any("later_ttft_p50_s" in r for r in rows)
    out = [f"| {label} concurrency | requests | tokens | tokens/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) |"
           + (" later turns' TTFT p50 / p99 (s) |" if later else ""),
           "|---:|---:|---:|---:|---:|---:|" + ("---:|" if later else "")]
    for r in rows:
        line = (f"| {r['concurrency']} | {r['requests']} | {r['tokens']} | {r['tokens_per_s']:.2f} | "
                f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} |")
        if later:
            line += f" {r.get('later_ttft_p50_s', 0):.2f} / {r.get('later_ttft_p99_s', 0):.2f} |"
        out.append(line)
    return "\n".join(out)


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib  # heavy

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for label, rows in runs.items():
        rows = [r for r in rows if isinstance(r["concurrency"], int)]  # open-loop runs are in the table only
        c = [r["concurrency"] for r in rows]
        ax[0].plot(c, [r["tokens_per_s"] for r in rows], marker="o", label=label)
        line, = ax[1].plot(c, [r["itl_p50_ms"] for r in rows], marker="o", label=f"{label} p50")
        ax[1].plot(c, [r["itl_p99_ms"] for r in rows], marker="x", ls="--", color=line.get_color(),
                   label=f"{label} p99")
        key = "later_ttft_p50_s" if any("later_ttft_p50_s" in r for r in rows) else "ttft_p50_s"
        ax[2].plot(c, [r.get(key, 0) for r in rows], marker="o", label=label)
        ax[2].set_title("Time to first token, p50" + (" (later turns)" if key.startswith("later") else ""))
    ax[0].set(xlabel="concurrent clients", ylabel="tokens/s (all clients)", xscale="log", title="Throughput")
    ax[1].set(xlabel="concurrent clients", ylabel="inter-token latency (ms)", xscale="log", yscale="log",
              title="Inter-token latency")
    ax[2].set(xlabel="concurrent clients", ylabel="seconds", xscale="log")
    levels = sorted({r["concurrency"] for rows in runs.values() for r in rows if isinstance(r["concurrency"], int)})
    for a in ax:
        a.set_xticks(levels, [str(n) for n in levels])
        a.minorticks_off()
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge_levels(old: list[dict], new: list[dict]) -> list[dict]:
    """A server's rows, earlier runs' levels kept unless measured again (so each level can run on a freshly
    started server), closed-loop levels in client order, open-loop rates after them."""
    rows = {r["concurrency"]: r for r in old} | {r["concurrency"]: r for r in new}
    return sorted(rows.values(), key=lambda r: (isinstance(r["concurrency"], str), str(r["concurrency"]).zfill(8)))


def run_bench_serve(args) -> int:
    qs = load_questions(args.prompts, limit=args.limit, skip=args.skip)
    prompts = [list(q.turns[:max(1, args.turns)]) for q in qs]
    if not prompts:
        raise HydraspecError("no prompts selected")
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if not levels or any(n < 1 for n in levels):
        raise HydraspecError(f"--concurrency takes positive integers, got {args.concurrency!r}")
    if args.rate is not None and args.rate <= 0:
        raise HydraspecError(f"--rate takes a positive number of conversations per second, got {args.rate}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store, kept = out / "serve_results.json", out / "serve_samples.json"
    runs = json.loads(store.read_text()) if store.exists() else {}
    samples = json.loads(kept.read_text()) if kept.exists() else {}
    label = args.label or args.url
    rows, mine = [], samples.setdefault(label, {})
    for n in levels if args.rate is None else [args.rate]:
        if args.reset:
            reset_cache(args.url, args.api_key)
        r = run_level(args.url, args.model, prompts, n, args.max_tokens, args.api_key) if args.rate is None else \
            run_open(args.url, args.model, prompts, args.rate, args.max_tokens, args.api_key)
        r, mine[str(r["concurrency"])] = pool(mine.get(str(r["concurrency"])) if args.pool else None, r)
        kept.write_text(json.dumps(samples))
        rows.append(r)
        rounds = f" (pooled over {r['rounds']} rounds; this one {r['round_tokens_per_s'][-1]:.2f})" if r["rounds"] > 1 else ""
        print(f"[{label}] concurrency {r['concurrency']}: {r['tokens_per_s']:.2f} tokens/s{rounds}, TTFT p50 "
              f"{r['ttft_p50_s']:.2f} s, ITL p50 {r['itl_p50_ms']:.1f} ms", flush=True)
    runs[label] = merge_levels(runs.get(label, []), rows)
    store.write_text(json.dumps(runs, indent=1))
    (out / "serve_results.md").write_text("\n\n".join(table(v, k) for k, v in runs.items()) + "\n")
    plot(runs, out / "serve_throughput.png")
    print(table(rows, label))
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench-serve", help="load-test a running OpenAI-compatible server",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (without /v1)")
    p.add_argument("--model", required=True, help="the model name the server expects")
    p.add_argument("--prompts", nargs="+", required=True, metavar="FILE.jsonl", help="Spec-Bench-format files")
    p.add_argument("--limit", type=int, help="first N questions per category")
    p.add_argument("--skip", type=int, default=0, help="leave out the first N questions per category")
    p.add_argument("--concurrency", default="1,2,4,8", help="client counts, one run each (default 1,2,4,8)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rate", type=float, default=None, metavar="R",
                   help="open loop instead of --concurrency: conversations arrive at R per second (Poisson), "
                        "each on a client of its own")
    p.add_argument("--turns", type=int, default=1, help="turns of each conversation, in order, each request "
                                                         "re-sending the conversation so far (default 1)")
    p.add_argument("--reset", action="store_true",
                   help="before each level, ask the server to drop its prefix cache and memory of earlier answers "
                        "(POST /reset_prefix_cache), so prompts seen at an earlier level are read cold again")
    p.add_argument("--api-key", default=None)
    p.add_argument("--label", default=None, help="name of this server's runs in the results (default: the URL)")
    p.add_argument("--pool", action="store_true",
                   help="pool each level with the earlier runs of this label in --out (throughput over their summed "
                        "tokens and time, percentiles over all their requests): rounds of servers in alternating "
                        "order see a drifting machine alike")
    p.add_argument("--out", required=True, help="directory; runs of several servers accumulate there")
    p.set_defaults(func=run_bench_serve)
