"""`hydraspec build-tree` on the command line: its options, the target and the drafter loaded
(:mod:`hydraspec.stack`), the tree built (:func:`~hydraspec.trees.build.build_tree`), saved and plotted."""
from __future__ import annotations

import os
import sys

from ..bench.batched import parse_batch_sizes
from ..bench.prompts import load_questions
from ..drafters import check_vocab
from ..errors import HydraspecError
from ..generator import SpeculativeGenerator
from ..heads import load_heads
from ..options import add_draft_quant_arg, add_draft_vocab_arg, add_model_args
from ..stack import load_models
from .build import build_tree, plot_tree, save_tree, stop_candidates

__all__ = ["add_parser", "run"]


def _check(args) -> None:
    if (args.heads is None) == (args.draft_model is None):
        raise HydraspecError("build-tree needs exactly one of --heads DIR and --draft-model")
    if args.heads and args.draft_confidence is not None:
        raise HydraspecError("--draft-confidence applies to a --draft-model only")
    if args.max_nodes < 1 or args.max_new_tokens < 1:
        raise HydraspecError("--max-nodes and --max-new-tokens must be at least 1")
    if args.draft_model:
        stop_candidates(args.draft_confidence or "auto")  # a bad value fails before any loading


def run(args) -> int:
    _check(args)
    questions = load_questions(args.prompts, limit=args.limit, skip=args.skip)
    if not questions:
        raise HydraspecError("no calibration prompts in " + ", ".join(args.prompts))
    model, tok, pair = load_models(args, draft=bool(args.draft_model))
    heads = draft = heads_cfg = None
    if args.heads:
        heads, heads_cfg = load_heads(args.heads, model, base_model=args.model)
    else:
        draft, dtok = pair
        check_vocab(tok, dtok)
    gen = SpeculativeGenerator(model, tok)
    names = [f"{q.source}:{q.question_id}" for q in questions]
    prompt_ids = [gen.encode(q.turns[0]) for q in questions]
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    log(f"calibration prompts ({len(names)}, first turns) from {', '.join(args.prompts)}: {', '.join(names)}")
    result = build_tree(model, tok, prompt_ids=prompt_ids, prompt_names=names, max_nodes=args.max_nodes,
                        method=args.method, select=args.select, heads=heads, draft_model=draft,
                        depth=args.max_depth, max_rank=args.max_rank, max_new_tokens=args.max_new_tokens,
                        confirm=args.confirm, reps=args.reps, log=log,
                        default_paths=(heads_cfg or {}).get("default_tree"),
                        draft_confidence=(args.draft_confidence or "auto") if args.draft_model else None,
                        batch_sizes=parse_batch_sizes(args.batch_sizes) if args.batch_sizes else None)
    result["model"] = args.model
    result["drafter"]["source"] = args.heads or args.draft_model
    result["calibration"]["files"] = [str(p) for p in args.prompts]
    save_tree(result, args.out)
    print(f"tree of {result['nodes']} nodes ({result['method']}, select {result['select']}) saved in {args.out}; "
          f"use it with --tree {args.out}")
    if args.plot:
        png = os.path.splitext(args.out)[0] + ".png"
        plot_tree(result, png)
        print(f"plot saved in {png}")
    return 0


def add_parser(subparsers) -> None:
    """Register `build-tree` on an argparse subparsers object (``args.func`` runs it)."""
    b = subparsers.add_parser("build-tree", help="grow a token tree for heads or a draft model from calibration data",
                       description="Measure how often the drafter's ranked proposals are the target's greedy "
                                   "tokens on calibration prompts, grow nested trees T1..TN, optionally time them "
                                   "on this device and keep the fastest; writes tree.json for --tree.")
    add_model_args(b)
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--heads", help="trained Medusa/Hydra heads directory")
    src.add_argument("--draft-model", help="draft model sharing the target's tokenizer (its top-k tree)")
    add_draft_quant_arg(b)
    add_draft_vocab_arg(b)
    b.add_argument("--draft-confidence", default=None, metavar="P[,P...]|auto",
                   help="with --draft-model: the early stop (the draft's top probability below P ends a branch) "
                        "to grow, time and confirm the trees with; several, or 'auto' (0, 0.4, 0.6, 0.8, 0.9; "
                        "the default with --draft-model): choose the stop with the tree. The tree.json records "
                        "it and generate/bench use it with the tree unless given --draft-confidence")
    b.add_argument("--prompts", nargs="+", required=True, metavar="FILE.jsonl",
                   help="calibration prompts (Spec-Bench jsonl, first turns); keep them apart from evaluation prompts")
    b.add_argument("--limit", type=int, help="at most N prompts of each category (after --skip)")
    b.add_argument("--skip", type=int, default=0,
                   help="leave out the first N prompts of each category (e.g. the ones bench --limit N evaluates on)")
    b.add_argument("--max-nodes", type=int, default=100, help="largest tree (default 100)")
    b.add_argument("--method", default="simulate", choices=("medusa", "simulate"),
                   help="medusa: independent per-depth accuracies; simulate: replay decoding (default)")
    b.add_argument("--select", default="measure", choices=("measure", "none"),
                   help="measure: time trees on this device and keep the fastest; none: keep the largest")
    b.add_argument("--plot", action="store_true", help="also write OUT.png")
    b.add_argument("--out", required=True, help="tree.json to write")
    b.add_argument("--max-new-tokens", type=int, default=128, help="greedy tokens per calibration prompt")
    b.add_argument("--max-depth", type=int, help="deepest tree level (default: number of heads; 6 for a draft model)")
    b.add_argument("--max-rank", type=int, default=10, help="most children per node considered (default 10)")
    b.add_argument("--confirm", type=int, default=3, help="trees confirmed by end-to-end generation (default 3)")
    b.add_argument("--reps", type=int, default=5, help="timed repetitions per sampled tree size (default 5)")
    b.add_argument("--batch-sizes", metavar="1,2,4,...",
                   help="with --select measure: also time verify steps of B rows and choose a tree per batch "
                        "size (tree.json by_batch; pass the file to --batch-trees)")
    b.set_defaults(func=run)
