"""The benchmark loop: every method answers every (question, turn) back to back, after one warm-up each."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from ..errors import HydraspecError
from ..options import thread_count
from . import report, stats
from .args import check_args, default_loader, split_list
from .methods import METHODS, BenchContext, method_settings, parse_methods
from .prompts import load_questions
from .store import RecordStore

WARMUP_TOKENS = 16


def settings_of(args) -> dict:
    return {
        "model": args.model, "draft_model": getattr(args, "draft_model", None), "heads": getattr(args, "heads", None),
        "tree": getattr(args, "tree", None),
        "dtype": args.dtype, "device": args.device, "max_new_tokens": args.max_new_tokens,
        "temperature": float(args.temperature), "seed": args.seed, "draft_k": args.draft_k,
        "draft_quant": getattr(args, "draft_quant", "none"), "draft_vocab": getattr(args, "draft_vocab", None),
        "pld_tokens": args.pld_tokens, "prompts": [str(p) for p in args.prompts], "limit": args.limit,
        "skip": getattr(args, "skip", 0), "turns": getattr(args, "turns", None),
        "categories": split_list(args.categories), "methods": parse_methods(args.methods),
    }


def run_bench(args, loader=None) -> int:
    """Run `hydraspec bench` (args as parsed by add_parser's sub-parser) and write its outputs to args.out.
    loader(name, dtype=, device=) -> (model, tokenizer) defaults to hydraspec.models.load_model.
    Returns 0; problems raise HydraspecError; KeyboardInterrupt propagates after saving what finished."""
    if getattr(args, "batch_sizes", None):
        from .batched import run_batch_bench

        return run_batch_bench(args, loader)
    import torch
    from tqdm import tqdm

    methods = parse_methods(args.methods)
    check_args(args, methods)
    questions = load_questions(args.prompts, limit=args.limit, categories=split_list(args.categories),
                               skip=getattr(args, "skip", 0))
    settings = settings_of(args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise HydraspecError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    store = RecordStore(out / "records.jsonl", settings)
    store.check_methods({m: method_settings(m, args) for m in methods})
    done = store.done()
    pending = [(q, [m for m in methods if (m, q.question_id) not in done]) for q in questions]
    pending = [(q, ms) for q, ms in pending if ms]
    n_units = sum(len(ms) for _, ms in pending)
    skipped = len(questions) * len(methods) - n_units
    if skipped:
        print(f"resuming: {skipped} of {len(questions) * len(methods)} (question, method) answers are already "
              f"in {store.path}", file=sys.stderr)

    device = args.device
    if pending:
        from ..models import compile_models, load_draft_model

        torch.set_num_threads(thread_count())
        load = loader or default_loader(args)
        model, tok = load(args.model, dtype=args.dtype, device=args.device)
        device = str(model.device)
        working = list(dict.fromkeys(m for _, ms in pending for m in ms))
        draft = None
        if any(METHODS[m].needs_draft or (METHODS[m].takes_draft and args.draft_model) for m in working):
            draft = load_draft_model(args.draft_model, args.dtype, args.device, getattr(args, "draft_quant", None),
                                     loader, vocab=getattr(args, "draft_vocab", None), tokenizer=tok)
        # compiled once both are loaded (peak memory: models.compile_models)
        compile_models(model, draft[0] if draft else None, how=getattr(args, "compile", False),
                       hidden=any(METHODS[m].needs_heads for m in working))
        from ..generator import SpeculativeGenerator
        from ..inputs import eos_ids

        ctx = BenchContext(model=model, tokenizer=tok, args=args, draft=draft, heads=getattr(args, "heads", None),
                           eos=sorted(eos_ids(model, tok)))
        runners = {m: METHODS[m].factory(ctx) for m in working}
        encoder = SpeculativeGenerator(model, tok)
        seed = args.seed if args.temperature > 0 else None

        def answer(m, q, t, messages, max_new):
            try:
                ids = encoder.encode(messages)
                if t == 0 and q.prediction and METHODS[m].predicts:
                    pred = tok(q.prediction, add_special_tokens=False)["input_ids"]
                    return runners[m].generate(ids, max_new, float(args.temperature), seed, prediction=pred)
                return runners[m].generate(ids, max_new, float(args.temperature), seed)
            except HydraspecError as e:
                raise HydraspecError(f"{m} on question {q.question_id!r} turn {t + 1}: {e}") from None

        first = pending[0][0]
        for m in working:  # warm-up: not recorded
            answer(m, first, 0, [{"role": "user", "content": first.turns[0]}], min(WARMUP_TOKENS, args.max_new_tokens))

        bar = tqdm(total=n_units, unit="answer", desc="bench", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
        try:
            for q, ms in pending:
                convs = {m: [] for m in ms}
                turns = {m: [] for m in ms}
                asked = q.turns[:args.turns] if getattr(args, "turns", None) else q.turns
                for t, user in enumerate(asked):
                    for m in ms:  # interleaved: every method on this turn back to back
                        convs[m].append({"role": "user", "content": user})
                        r = answer(m, q, t, convs[m], args.max_new_tokens)
                        convs[m].append({"role": "assistant", "content": r.text})  # its own answer
                        turns[m].append({"turn": t, **r.to_dict()})
                        if t == len(asked) - 1:
                            store.append({"method": m, "question_id": q.question_id, "category": q.category,
                                          "source": q.source, "settings": method_settings(m, args),
                                          "tstamp": time.time(), "turns": turns[m]})
                            bar.update(1)
        except KeyboardInterrupt:
            bar.close()
            print(f"\ninterrupted: {len(store.records)} finished answers are saved in {store.path}; "
                  "rerun the same command to resume", file=sys.stderr)
            raise
        bar.close()

    records = stats.dedupe(store.records)
    summary = stats.summarize(records, methods, temperature=float(args.temperature), seed=args.seed)
    annotated = stats.annotate(records, summary["reference"])
    machine = report.machine_info(args.dtype, device)
    paths = report.write_all(out, records, summary, machine, settings, annotated)
    md = paths["md"].read_text(encoding="utf-8")
    print(md.split("## Speedup over hf-ar")[0].rstrip())
    print(f"\nwrote {paths['json']}, {paths['md']}, {paths['png']} and {out / 'answers'}/", file=sys.stderr)
    return 0
