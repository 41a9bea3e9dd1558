"""Predicted outputs (OpenAI API) through the `openai` client against a running server.

Each question's first turn is sent once without and once with its ``prediction`` (the current code, for a
code-edit request), non-streamed, greedy, to the same server; the report gives tokens/s of each, the
speedup, ``usage.completion_tokens_details`` (accepted / rejected prediction tokens) and whether the two
answers are identical (they must be: a prediction changes only the speed). Run it once against a server
started with ``--method ar`` (``--label ar``) and once against ``--method auto`` to compare with plain
decoding; every run is kept in ``--out`` and the table covers all of them. The second request of a question
finds its prompt in the server's prefix cache (and, with suffix decoding, the first answer in its store);
``--predicted-first`` sends the predicted request first, so that it meets neither:

    hydraspec serve --model qwen2.5-coder-1.5b-instruct --method auto --port 8000 &
    python benchmarks/predicted_outputs.py --url http://127.0.0.1:8000/v1 --model qwen2.5-coder-1.5b-instruct \
        --prompts benchmarks/prompts/codeedit.jsonl --skip 3 --limit 12 --label auto --out /tmp/predicted \
        --predicted-first
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from openai import OpenAI

from hydraspec.bench.prompts import load_questions


def ask(client: OpenAI, model: str, prompt: str, max_tokens: int, prediction: str | None) -> dict:
    """One greedy chat completion; its text, tokens, seconds and prediction counts."""
    extra = {"prediction": {"type": "content", "content": prediction}} if prediction else {}
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                       temperature=0, max_tokens=max_tokens, **extra)
    seconds = time.perf_counter() - t0
    details = r.usage.completion_tokens_details
    return {"text": r.choices[0].message.content, "tokens": r.usage.completion_tokens, "seconds": seconds,
            "accepted": getattr(details, "accepted_prediction_tokens", None) or 0,
            "rejected": getattr(details, "rejected_prediction_tokens", None) or 0}


def run(args) -> dict:
    client = OpenAI(base_url=args.url, api_key=args.api_key)
    rows = []
    for q in load_questions(args.prompts, limit=args.limit, skip=args.skip):
        if not q.prediction:
            continue
        order = ("predicted", "plain") if args.predicted_first else ("plain", "predicted")
        got = {k: ask(client, args.model, q.turns[0], args.max_tokens, q.prediction if k == "predicted" else None)
               for k in order}  # sent in this order: the first meets no cache or store of its own question
        plain, predicted = got["plain"], got["predicted"]
        rows.append({"question_id": q.question_id, "plain": plain, "predicted": predicted})
        print(f"[{args.label}] {q.question_id}: {plain['tokens'] / plain['seconds']:.1f} -> "
              f"{predicted['tokens'] / predicted['seconds']:.1f} tokens/s, accepted {predicted['accepted']}, "
              f"rejected {predicted['rejected']}, identical {plain['text'] == predicted['text']}", flush=True)
    return {"label": args.label, "rows": rows, "first": "predicted" if args.predicted_first else "plain"}


def rate(rows: list[dict], key: str) -> float:
    return sum(r[key]["tokens"] for r in rows) / sum(r[key]["seconds"] for r in rows)


def table(runs: dict[str, dict]) -> str:
    """One line per (server, with or without prediction); speedups over the first server's first request of each
    question (its plain ones, or with --predicted-first its predicted ones: a server that ignores predictions,
    ``ar``, then reads each prompt cold there, as the other server's predicted requests do)."""
    first_run = next(iter(runs.values()))
    base = rate(first_run["rows"], first_run.get("first", "plain"))
    lines = ["| server | prediction | tokens/s | speedup | accepted | rejected | identical |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for label, run_ in runs.items():
        rows = run_["rows"]
        same = sum(r["plain"]["text"] == r["predicted"]["text"] for r in rows)
        for key in ("plain", "predicted"):
            acc = sum(r[key]["accepted"] for r in rows)
            rej = sum(r[key]["rejected"] for r in rows)
            lines.append(f"| {label} | {'yes' if key == 'predicted' else 'no'} | {rate(rows, key):.1f} | "
                         f"{rate(rows, key) / base:.2f}x | {acc} | {rej} | {same}/{len(rows)} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", nargs="+", required=True)
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--limit", type=int)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--api-key", default="none")
    p.add_argument("--predicted-first", action="store_true",
                   help="send each question's predicted request before its plain one (the plain one then finds the "
                        "prompt in the server's prefix cache and, with suffix decoding, the answer in its store)")
    p.add_argument("--label", required=True, help="this server's name in the table (e.g. its --method)")
    p.add_argument("--out", required=True, help="directory; runs of several servers accumulate there")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "predicted_outputs.json"
    runs = json.loads(store.read_text()) if store.exists() else {}
    runs[args.label] = run(args)
    store.write_text(json.dumps(runs, indent=1))
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
