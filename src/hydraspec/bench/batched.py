"""`hydraspec bench --batch-sizes 1,2,4,...`: throughput and per-sequence latency of batched decoding.

Every method answers the first turn of every question at every batch size: our methods with at most
that many rows at a time (longest prompts first, finished rows refilled with waiting prompts), hf-ar
with static left-padded batches of that size (longest prompts first). Reported per (method, batch
size): tokens/s over the whole run (all rows' new tokens / wall time), mean per-sequence latency (from
the row's admission to its last token; for hf-ar, whose rows all return together, its batch's wall
time), tokens per target forward and the share of answers identical to `ar` at the smallest batch size
(greedy only).
Outputs: batch_results.json, batch_results.md, batch_throughput.png in --out.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from ..batch import BatchGenerator
from ..errors import HydraspecError
from ..generator import SpeculativeGenerator
from ..inputs import eos_ids, load_batch_trees
from ..models import load_draft_model
from .args import check_args, default_loader, split_list
from .methods import METHODS, BenchContext, parse_methods, sync
from .prompts import load_questions
from .report import machine_info, machine_line

BATCH_METHODS = ("ar", "pld", "draft", "medusa", "hydra", "hf-ar")
WARMUP_TOKENS = 8


def parse_batch_sizes(text) -> list[int]:
    try:
        sizes = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise HydraspecError(f"--batch-sizes takes comma-separated integers, got '{text}'") from None
    if not sizes or any(s < 1 for s in sizes):
        raise HydraspecError(f"--batch-sizes takes positive integers, got '{text}'")
    return list(dict.fromkeys(sizes))


def _groups(lengths: list[int], bs: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i:i + bs] for i in range(0, len(order), bs)]


def hf_batch(model, eos: list[int], pad: int, prompts: list[list[int]], max_new_tokens: int, temperature: float,
             seed: int | None) -> list[list[int]]:
    """transformers generate() over one left-padded batch; each row cut after its first EOS."""
    dev = model.device
    n = max(map(len, prompts))
    x = torch.full((len(prompts), n), pad, dtype=torch.long)
    mask = torch.zeros_like(x)
    for b, p in enumerate(prompts):
        x[b, n - len(p):] = torch.tensor(p)
        mask[b, n - len(p):] = 1
    kw = dict(attention_mask=mask.to(dev), max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=eos or None,
              pad_token_id=pad, num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0)
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, typical_p=1.0)
        if seed is not None:
            torch.manual_seed(seed)
    else:
        kw["do_sample"] = False
    with torch.inference_mode():
        out = model.generate(x.to(dev), **kw)
    rows = []
    for b in range(len(prompts)):
        new = out[b, n:].tolist()
        for i, t in enumerate(new):
            if t in eos:
                new = new[: i + 1]
                break
        rows.append(new)
    return rows


def run_batch_bench(args, loader=None) -> int:
    methods = parse_methods(args.methods)
    bad = [m for m in methods if m not in BATCH_METHODS]
    if bad:
        raise HydraspecError(f"--batch-sizes supports methods {', '.join(BATCH_METHODS)}; not {', '.join(bad)}")
    check_args(args, methods)
    sizes = parse_batch_sizes(args.batch_sizes)
    if getattr(args, "batch_trees", None) and not any(METHODS[m].needs_heads for m in methods):
        raise HydraspecError("--batch-trees is only used by the medusa/hydra methods")
    questions = load_questions(args.prompts, limit=args.limit, categories=split_list(args.categories),
                               skip=getattr(args, "skip", 0))
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise HydraspecError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    load = loader or default_loader(args)
    model, tok = load(args.model, dtype=args.dtype, device=args.device)
    draft = None
    if any(METHODS[m].needs_draft for m in methods):
        draft = load_draft_model(args.draft_model, args.dtype, args.device, getattr(args, "draft_quant", None), loader,
                                 vocab=getattr(args, "draft_vocab", None), tokenizer=tok)
    eos = sorted(eos_ids(model, tok))
    ctx = BenchContext(model=model, tokenizer=tok, args=args, draft=draft, heads=getattr(args, "heads", None), eos=eos)
    encoder = SpeculativeGenerator(model, tok)
    prompts = [encoder.encode([{"role": "user", "content": q.turns[0]}]) for q in questions]
    rows = []
    answers: dict[tuple[str, int], list[list[int]]] = {}
    for m in methods:
        _bench_method(ctx, m, prompts, sizes, rows, answers)
    _compare_to_ar(rows, answers, methods, sizes, float(args.temperature))
    _write(args, out, rows, answers, methods, sizes, model, len(prompts))
    return 0


def _bench_method(ctx: BenchContext, m: str, prompts: list[list[int]], sizes: list[int], rows: list,
                  answers: dict) -> None:
    """Method ``m`` over every prompt at every batch size (after a short warm-up): a row of results each, and
    its answers."""
    args, model, tok, eos = ctx.args, ctx.model, ctx.tokenizer, ctx.eos
    temperature = float(args.temperature)
    seed = args.seed if temperature > 0 else None
    pad = getattr(tok, "pad_token_id", None)
    pad = pad if pad is not None else (eos[0] if eos else 0)
    gen = None
    if m != "hf-ar":
        drafter = METHODS[m].factory(ctx).gen.drafter  # the bench's own drafter settings for this method
        trees = load_batch_trees(getattr(args, "batch_trees", None)) if METHODS[m].needs_heads else None
        gen = BatchGenerator(model, tok, drafter, trees=trees, verify_budget=getattr(args, "verify_budget", None))
        gen.generate(input_ids=prompts[:2], max_new_tokens=min(WARMUP_TOKENS, args.max_new_tokens))
    else:
        hf_batch(model, eos, pad, prompts[:2], min(WARMUP_TOKENS, args.max_new_tokens), 0.0, None)
    for bs in sizes:
        sync(model.device)
        t0 = time.perf_counter()
        if gen is not None:
            res = gen.generate(input_ids=prompts, max_new_tokens=args.max_new_tokens, batch_size=bs,
                               temperature=temperature, seed=seed)
            sync(model.device)
            wall = time.perf_counter() - t0
            toks = [r.token_ids for r in res]
            latency = [r.stats.wall_s for r in res]
            forwards = sum(r.stats.target_forwards for r in res)
            extra = {"cache_bytes": res.cache_bytes, "batched_forwards": res.target_forwards,
                     "mean_accepted": round(sum(map(len, toks)) / forwards, 4) if forwards else None}
        else:
            toks, latency = _hf_batches(model, eos, pad, prompts, bs, args.max_new_tokens, temperature, seed)
            wall = time.perf_counter() - t0
            extra = {"cache_bytes": None, "batched_forwards": None, "mean_accepted": None}
        answers[(m, bs)] = toks
        new = sum(map(len, toks))
        rows.append({"method": m, "batch_size": bs, "prompts": len(prompts), "new_tokens": new,
                     "wall_s": round(wall, 4), "tokens_per_s": round(new / wall, 4) if wall > 0 else 0.0,
                     "mean_latency_s": round(sum(latency) / len(latency), 4), **extra})
        print(f"{m:8s} batch {bs:3d}: {new} tokens in {wall:.2f} s = {rows[-1]['tokens_per_s']:.2f} tokens/s, "
              f"mean latency {rows[-1]['mean_latency_s']:.2f} s", file=sys.stderr)


def _hf_batches(model, eos, pad, prompts, bs: int, max_new_tokens: int, temperature: float, seed):
    """hf-ar: static batches of ``bs`` (longest prompts first); each row's tokens and its batch's wall time."""
    toks, latency = [None] * len(prompts), [0.0] * len(prompts)
    for g in _groups([len(p) for p in prompts], bs):
        tb = time.perf_counter()
        outs = hf_batch(model, eos, pad, [prompts[i] for i in g], max_new_tokens, temperature, seed)
        sync(model.device)
        for i, o in zip(g, outs):
            toks[i], latency[i] = o, time.perf_counter() - tb
    return toks, latency


def _compare_to_ar(rows: list, answers: dict, methods, sizes, temperature: float) -> None:
    """Each row's share of answers identical to ar's at the smallest batch size (greedy only)."""
    ref_key = ("ar", sizes[0]) if "ar" in methods else None
    for r in rows:
        if temperature == 0 and ref_key in answers:
            ref = answers[ref_key]
            same = sum(a == b for a, b in zip(answers[(r["method"], r["batch_size"])], ref))
            r["identical_to_ar"] = round(same / len(ref), 4)
        else:
            r["identical_to_ar"] = None


def _write(args, out: Path, rows: list, answers: dict, methods, sizes, model, n_prompts: int) -> None:
    """batch_results.json, batch_results.md and batch_throughput.png in ``out``; the table printed."""
    machine = machine_info(args.dtype, str(model.device))
    data = {"settings": {"model": args.model, "draft_model": getattr(args, "draft_model", None),
                         "heads": getattr(args, "heads", None), "methods": methods, "batch_sizes": sizes,
                         "max_new_tokens": args.max_new_tokens, "temperature": float(args.temperature),
                         "dtype": args.dtype, "prompts": [str(p) for p in args.prompts], "limit": args.limit,
                         "skip": getattr(args, "skip", 0), "verify_budget": getattr(args, "verify_budget", None),
                         "draft_quant": getattr(args, "draft_quant", "none")},
            "machine": machine, "rows": rows,
            "answers": {f"{m}@{bs}": a for (m, bs), a in answers.items()}}
    (out / "batch_results.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    md = batch_markdown(rows, machine, n_prompts, args.max_new_tokens)
    (out / "batch_results.md").write_text(md, encoding="utf-8")
    plot_batches(rows, methods, sizes, out / "batch_throughput.png")
    print(md.rstrip())
    print(f"\nwrote {out / 'batch_results.json'}, {out / 'batch_results.md'}, {out / 'batch_throughput.png'}",
          file=sys.stderr)


def batch_markdown(rows, machine, n_prompts: int, max_new: int) -> str:
    def f(v, d=2):
        return "-" if v is None else f"{v:.{d}f}"

    lines = [f"# hydraspec batched bench ({n_prompts} prompts, up to {max_new} new tokens each)", "",
             machine_line(machine), "",
             "| method | batch | tokens/s | vs ar at this batch | mean latency (s) | tokens/forward | identical to ar "
             "| KV cache (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    ar_tps = {r["batch_size"]: r["tokens_per_s"] for r in rows if r["method"] == "ar"}
    for r in rows:
        kv = None if r["cache_bytes"] is None else r["cache_bytes"] / 2**20
        ident = None if r["identical_to_ar"] is None else 100 * r["identical_to_ar"]
        base = ar_tps.get(r["batch_size"])
        rel = f"{r['tokens_per_s'] / base:.2f}x" if base and r["tokens_per_s"] else "-"
        lines.append(f"| {r['method']} | {r['batch_size']} | {f(r['tokens_per_s'])} | {rel} | {f(r['mean_latency_s'])} | "
                     f"{f(r['mean_accepted'])} | {'-' if ident is None else f'{ident:.0f} %'} | {f(kv, 1)} |")
    return "\n".join(lines) + "\n"


def plot_batches(rows, methods, sizes, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy
    from matplotlib.figure import Figure  # heavy

    fig = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(fig)
    for k, (key, label) in enumerate((("tokens_per_s", "tokens/s over the batch"),
                                      ("mean_latency_s", "mean per-sequence latency (s)"))):
        ax = fig.add_subplot(1, 2, k + 1)
        for m in methods:
            pts = sorted((r["batch_size"], r[key]) for r in rows if r["method"] == m)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(s) for s in sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.axes[0].legend(fontsize="small")
    fig.suptitle("hydraspec bench: batched decoding")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
