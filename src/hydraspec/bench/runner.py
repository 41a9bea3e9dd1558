"""The benchmark loop: every method answers every (question, turn) back to back, after one warm-up each."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import HydraspecError
from ..generator import SpeculativeGenerator
from ..heads import read_features
from ..inputs import eos_ids
from ..models import compile_models, load_draft_model
from ..options import thread_count
from . import report, stats
from .args import check_args, default_loader, split_list
from .methods import METHODS, BenchContext, method_settings, parse_methods
from .prompts import load_questions
from .store import RecordStore

WARMUP_TOKENS = 16
PEERS = ("llamacpp-", "ov-", "hf-")  # the methods of other engines (turn_order)


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
        from .batched import run_batch_bench  # optional: only for --batch-sizes

        return run_batch_bench(args, loader)
    methods = parse_methods(args.methods)
    check_args(args, methods)
    questions = load_questions(args.prompts, limit=args.limit, categories=split_list(args.categories),
                               skip=getattr(args, "skip", 0))
    out = Path(args.out)
    store, pending = open_store(args, out, methods, questions)
    device = args.device
    if pending:
        ctx, answer = load_answerer(args, loader, pending)
        device = str(ctx.model.device)
        answer_all(args, store, pending, answer)
    write_report(args, out, store, methods, device)
    return 0


def open_store(args, out: Path, methods: list[str], questions) -> tuple[RecordStore, list]:
    """The records file under `out` (resumed where it exists) and the (question, methods) still to answer."""
    if out.exists() and not out.is_dir():
        raise HydraspecError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    store = RecordStore(out / "records.jsonl", settings_of(args))
    store.check_methods({m: method_settings(m, args) for m in methods})
    done = store.done()
    pending = [(q, [m for m in methods if (m, q.question_id) not in done]) for q in questions]
    pending = [(q, ms) for q, ms in pending if ms]
    skipped = len(questions) * len(methods) - sum(len(ms) for _, ms in pending)
    if skipped:
        print(f"resuming: {skipped} of {len(questions) * len(methods)} (question, method) answers are already "
              f"in {store.path}", file=sys.stderr)
    return store, pending


def load_answerer(args, loader, pending):
    """Models loaded and compiled, one runner per method still to run, each warmed up once; returns the
    context and answer(method, question, turn, messages, max_new) -> the runner's result."""
    torch.set_num_threads(thread_count())
    load = loader or default_loader(args)
    model, tok = load(args.model, dtype=args.dtype, device=args.device)
    working = list(dict.fromkeys(m for _, ms in pending for m in ms))
    draft = None
    if any(METHODS[m].needs_draft or (METHODS[m].takes_draft and args.draft_model) for m in working):
        draft = load_draft_model(args.draft_model, args.dtype, args.device, getattr(args, "draft_quant", None),
                                 loader, vocab=getattr(args, "draft_vocab", None), tokenizer=tok)
    # compiled once both are loaded (peak memory: models.compile_models), for the features the heads read
    if getattr(args, "heads", None):
        read_features(args.heads, model)
    compile_models(model, draft[0] if draft else None, how=getattr(args, "compile", False),
                   hidden=any(METHODS[m].needs_heads or (METHODS[m].takes_heads and getattr(args, "heads", None))
                              for m in working))
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
    return ctx, answer


def turn_order(methods: list[str], i: int) -> list[str]:
    """The order the methods answer question ``i`` in: hydraspec's own first, then the peers' (other engines,
    run as servers or libraries), each group in the given order on even questions and reversed on odd ones, so
    that of two of our methods neither always goes first nor always follows a peer's run."""
    ours = [m for m in methods if not m.startswith(PEERS)]
    peers = [m for m in methods if m.startswith(PEERS)]
    return ours + peers if i % 2 == 0 else ours[::-1] + peers[::-1]


def answer_all(args, store: RecordStore, pending, answer) -> None:
    """Every pending question, turn by turn, every method on a turn back to back (each with its own earlier
    answers) in :func:`turn_order`; a question's record is stored when its last turn is answered."""
    bar = tqdm(total=sum(len(ms) for _, ms in pending), unit="answer", desc="bench", file=sys.stderr,
               dynamic_ncols=True, mininterval=0.5)
    try:
        for i, (q, ms) in enumerate(pending):
            ms = turn_order(ms, i)
            convs = {m: [] for m in ms}
            turns = {m: [] for m in ms}
            asked = q.turns[:args.turns] if getattr(args, "turns", None) else q.turns
            for t, user in enumerate(asked):
                for m in ms:
                    convs[m].append({"role": "user", "content": user})
                    r = answer(m, q, t, convs[m], args.max_new_tokens)
                    convs[m].append({"role": "assistant", "content": r.text})
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


def write_report(args, out: Path, store: RecordStore, methods: list[str], device: str) -> None:
    records = stats.dedupe(store.records)
    summary = stats.summarize(records, methods, temperature=float(args.temperature), seed=args.seed)
    annotated = stats.annotate(records, summary["reference"])
    machine = report.machine_info(args.dtype, device)
    paths = report.write_all(out, records, summary, machine, settings_of(args), annotated)
    md = paths["md"].read_text(encoding="utf-8")
    print(md.split("## Speedup over hf-ar")[0].rstrip())
    print(f"\nwrote {paths['json']}, {paths['md']}, {paths['png']} and {out / 'answers'}/", file=sys.stderr)
