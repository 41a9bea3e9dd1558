"""Learning curves of draft heads: held-out tokens per verify step against training tokens, per head kind and
data source, with the CPU time each point cost.

Each point trains fresh heads (`hydraspec.train.train_heads`, the code `train-heads` runs) on the first N
tokens of a source (rows in a fixed shuffled order), then replays greedy decoding of held-out prompts with the
heads' default tree (`hydraspec.trees`: the accepted length at each step along the base model's own greedy
answer, which is what greedy speculative decoding accepts) and records the mean tokens per step.

    python benchmarks/learning_curve.py --answers answers.jsonl --text-rows text.jsonl \\
        --points answers:medusa,hydra,hydra++:12500,25000,50000,100000 --out curve/
    python benchmarks/learning_curve.py --out curve/ --plot-only

Sources: `answers` (self-distilled answers: each token cost a decoding step, `--datagen-tok-s` tokens per
second measured apart), `draft` (answers a smaller model with the same tokenizer wrote, which the base reads
at prefill speed, e.g. `train-heads --answers-model`: `--draft-datagen-tok-s` for their cost) and `text` (rows
read at prefill speed, soft targets from the base: no data cost beyond the training's own base forward).
CPU-hours = wall time x `--cores` (the run uses every core).

A GGUF model (an offline name) runs at the file's precision by default (`--quant gguf`: one model trains and
replays); `--quant none` dequantizes it (bf16 to train, float32 to replay) as for SmolLM2.

    python benchmarks/learning_curve.py --model qwen2.5-coder-1.5b-instruct --answers target/answers.jsonl \
        --draft-answers draft/answers.jsonl --points answers:hydra++:6000,12000,25000 \
        draft:hydra++:6000,12000,25000 --eval-prompts benchmarks/prompts/everyday.jsonl --eval-skip 6 \
        --eval-limit 2 --out curve-qwen/
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from hydraspec.bench.prompts import load_questions
from hydraspec.errors import HydraspecError
from hydraspec.heads import DEFAULT_TREE, load_heads
from hydraspec.models import load_model
from hydraspec.train import train_heads
from hydraspec.train.data import load_answers
from hydraspec.trees.calibrate import greedy_sequences, head_ranks
from hydraspec.trees.grow import replay_steps


def subset(rows: list[dict], tokens: int, seed: int = 0) -> list[dict]:
    """The first rows of a fixed shuffle of ``rows`` holding at least ``tokens`` answer tokens."""
    order = list(rows)
    random.Random(seed).shuffle(order)
    out, n = [], 0
    for r in order:
        if n >= tokens:
            break
        out.append(r)
        n += len(r["answer_ids"])
    return out


def eval_sequences(model, tok, prompts: list[str], limit: int, max_new: int, path: Path, skip: int = 0):
    if path.exists():
        return [tuple(x) for x in json.loads(path.read_text())]
    qs = load_questions(prompts, limit=limit, skip=skip)
    from hydraspec.inputs import encode_prompt

    ids = [encode_prompt(tok, [{"role": "user", "content": q.turns[0]}]) for q in qs]
    seqs = greedy_sequences(model, tok, ids, max_new)
    path.write_text(json.dumps(seqs))
    return seqs


def models_for(name: str, quant: str | None):
    """(model to train on, model to replay with, tokenizer): one model at a GGUF file's precision, else the
    dequantized weights in bf16 and float32."""
    if quant != "none":
        try:
            model, tok = load_model(name, device="cpu", quant="gguf", progress=False)
            return model, model, tok
        except HydraspecError:
            if quant == "gguf":
                raise
    train_model, _ = load_model(name, dtype="bfloat16", device="cpu", quant="none", progress=False)
    eval_model, tok = load_model(name, dtype="float32", device="cpu", quant="none", progress=False)
    return train_model, eval_model, tok


def tokens_per_step(model, heads_dir: str, seqs, tree) -> tuple[float, float]:
    """Mean tokens per verify step replaying ``seqs`` with ``tree``, and head 0's top-1 rate on them."""
    heads, _ = load_heads(heads_dir, model)
    depth = max(len(p) for p in tree)
    ranks = head_ranks(model, heads, model.get_input_embeddings(), seqs, depth, max_rank=16)
    tree_set = {tuple(p) for p in tree}
    steps = toks = 0
    for r in ranks:
        acc = replay_steps(r, tree_set)
        steps += len(acc)
        toks += sum(acc) + len(acc)
    top1 = sum(int((r[:, 0] == 0).sum()) for r in ranks) / max(1, sum(r.shape[0] for r in ranks))
    return toks / max(1, steps), top1


def plot(results: list[dict], path: Path, model: str = "SmolLM2-135M-Instruct") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["kind"], r["source"]), []).append(r)
    for (kind, source), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["train_tokens"])
        style = {"answers": "-o", "draft": "-.^"}.get(source, "--s")
        label = f"{kind}, {source}"
        ax[0].plot([r["train_tokens"] for r in rs], [r["tokens_per_step"] for r in rs], style, label=label)
        ax[1].plot([r["cpu_hours"] for r in rs], [r["tokens_per_step"] for r in rs], style, label=label)
    ax[0].set_xlabel("training tokens (data tokens x epochs, log)")
    ax[1].set_xlabel("CPU-hours (data + training, log)")
    from matplotlib.ticker import NullFormatter

    for a in ax:
        a.set_xscale("log")
        a.xaxis.set_minor_formatter(NullFormatter())
        a.set_ylabel("held-out tokens per verify step")
        a.grid(alpha=0.3)
    ticks = {f"{r['train_tokens'] / 1000:.0f}k": r["train_tokens"] for r in results}  # one a size
    ax[0].set_xticks(list(ticks.values()), list(ticks), fontsize=8)
    ax[0].legend(fontsize=8)
    fig.suptitle(f"Draft heads of {model}: learning curves (greedy replay, default 7-node tree)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: list[dict]) -> str:
    """The results as a markdown table, by source, kind and size."""
    lines = ["| source | kind | data tokens | training tokens | CPU-hours (data + training) | held-out tokens per step "
             "| head 0 top-1 |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in sorted(results, key=lambda r: (r["source"], r["kind"], r["data_tokens"])):
        lines.append(f"| {r['source']} | {r['kind']} | {r['data_tokens']:,} | {r['train_tokens']:,} | "
                     f"{r['cpu_hours']:.3f} | {r['tokens_per_step']:.3f} | {r['head0_top1']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--answers", help="self-distilled answers (jsonl)")
    ap.add_argument("--draft-answers", help="answers a smaller model wrote (jsonl, train-heads --answers-model)")
    ap.add_argument("--text-rows", help="text rows (jsonl, hydraspec.train.text_data)")
    ap.add_argument("--quant", choices=("gguf", "none"), default=None,
                    help="gguf: the file's precision (default for offline GGUF names); none: dequantized")
    ap.add_argument("--points", nargs="*", default=[], metavar="SOURCE:KINDS:TOKENS",
                    help="e.g. answers:medusa,hydra:25000,50000 (kinds: medusa, hydra, hydra++, eagle, eagle3)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, help="peak learning rate (default: each kind's own, train-heads')")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--eagle-intermediate", type=int, default=0, help="eagle, eagle3: the layer's MLP width")
    ap.add_argument("--eagle-steps", type=int, default=2, help="eagle, eagle3: training-time-test depth")
    ap.add_argument("--eval-prompts", nargs="+", default=[f"../shared/data/prompts/{n}.jsonl"
                                                          for n in ("humaneval", "alpaca", "sharegpt")])
    ap.add_argument("--eval-limit", type=int, default=5, help="held-out questions of each category, after --eval-skip")
    ap.add_argument("--eval-skip", type=int, default=0, help="leave out each category's first N questions")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--datagen-tok-s", type=float, default=0.0,
                    help="measured self-distillation answer tokens per second (for the answers' data cost)")
    ap.add_argument("--draft-datagen-tok-s", type=float, default=0.0,
                    help="measured tokens per second of the draft source's answers, base read included")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot and print the table, train nothing")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.jsonl"
    results = [json.loads(line) for line in res_path.read_text().splitlines()] if res_path.exists() else []
    if args.plot_only:
        plot(results, out / "learning_curve.png", args.model)
        print(table(results))
        return 0
    torch.set_num_threads(args.cores)
    train_model, eval_model, tok = models_for(args.model, args.quant)
    seqs = eval_sequences(eval_model, tok, args.eval_prompts, args.eval_limit, args.max_new_tokens,
                          out / "eval_sequences.json", args.eval_skip)
    sources = {"answers": args.answers, "draft": args.draft_answers, "text": args.text_rows}
    gen_tok_s = {"answers": args.datagen_tok_s, "draft": args.draft_datagen_tok_s}
    done = {(r["source"], r["kind"], r["data_tokens_asked"]) for r in results}
    for spec in args.points:
        source, kinds, budgets = spec.split(":")
        rows = [r for r in load_answers(sources[source]) if r["answer_ids"]]
        cache = Path(sources[source]).resolve().with_name(Path(sources[source]).stem + ".base_cache")
        for budget in map(int, budgets.split(",")):
            part = subset(rows, budget)
            n_tok = sum(len(r["answer_ids"]) for r in part)
            d = out / f"{source}-{budget}"
            d.mkdir(exist_ok=True)
            data = d / "data.jsonl"
            data.write_text("".join(json.dumps(r) + "\n" for r in part))
            link = d / "data.base_cache"
            if not link.is_symlink():
                os.symlink(cache, link)  # the base's states, shared with the full source
            for kind in kinds.split(","):
                if (source, kind, budget) in done:
                    continue
                heads_dir = d / kind
                eagle = kind in ("eagle", "eagle3")
                distill = kind == "hydra++" or source == "text" or eagle
                own = data
                if kind == "eagle3":  # its cached base states are other layers: a cache of their own
                    own = d / "data-eagle3.jsonl"
                    own.write_text(data.read_text())
                    link3 = d / "data-eagle3.base_cache"
                    if not link3.is_symlink():
                        os.symlink(cache.with_name(cache.name.replace(".base_cache", ".eagle3.base_cache")), link3)
                t0 = time.perf_counter()
                train_heads(train_model, own, heads_dir, kind="hydra" if kind == "hydra++" else kind,
                            base_name=args.model, num_layers=4 if kind == "hydra++" else 1, epochs=args.epochs,
                            lr=args.lr, distill=distill, heldout=0.0, prefix_layer=kind == "hydra++", progress=False,
                            draft_vocab=args.draft_vocab, cache_bytes=8 << 30, accum=4,
                            head_options={"intermediate_size": args.eagle_intermediate}
                            if eagle and args.eagle_intermediate else None,
                            eagle={"steps": args.eagle_steps} if eagle else None)
                train_s = time.perf_counter() - t0
                tps, top1 = tokens_per_step(eval_model, str(heads_dir), seqs, DEFAULT_TREE)
                data_s = n_tok / gen_tok_s[source] if gen_tok_s.get(source) else 0.0
                rec = {"source": source, "kind": kind, "data_tokens_asked": budget, "data_tokens": n_tok,
                       "rows": len(part), "epochs": args.epochs, "train_tokens": n_tok * args.epochs,
                       "train_s": round(train_s, 1), "data_s": round(data_s, 1),
                       "cpu_hours": round((train_s + data_s) * args.cores / 3600, 4),
                       "tokens_per_step": round(tps, 4), "head0_top1": round(top1, 4)}
                print(json.dumps(rec), flush=True)
                with res_path.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
                results.append(rec)
                plot(results, out / "learning_curve.png", args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
