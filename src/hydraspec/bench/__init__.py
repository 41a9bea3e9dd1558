"""`hydraspec bench`: speed and agreement of decoding methods on Spec-Bench / MT-Bench style prompt files.

    from hydraspec.bench import add_parser, run_bench
    add_parser(subparsers)          # registers `bench`; its handler is args.func = run_bench
    rc = run_bench(args)            # 0, or raises HydraspecError / KeyboardInterrupt
"""
from __future__ import annotations

from . import llamacpp  # noqa: F401  (registers the llamacpp-* baselines)
from . import openvino  # noqa: F401  (registers the ov-* baselines; OpenVINO GenAI is optional)
from .methods import METHODS, BenchContext, MethodSpec, Runner, TurnResult, parse_methods, register
from .prompts import Question, load_prompt_file, load_questions
from .runner import run_bench
from .stats import summarize
from ..models import DEVICES
from ..options import add_compile_arg, add_draft_quant_arg, add_draft_vocab_arg, add_dtype_arg, add_quant_arg, \
    add_suffix_store_arg, add_verify_budget_arg

DEFAULT_METHODS = "ar,pld,hf-ar,hf-pld"


def _cmd(args) -> int:
    return run_bench(args)


def add_parser(subparsers):
    """Register `bench` on an argparse subparsers object; sets `func` so that `args.func(args)` runs it."""

    known = ", ".join(METHODS)
    p = subparsers.add_parser(
        "bench", help="benchmark decoding methods on prompt files",
        description="Answer every question (every turn, each method with its own earlier answers) with every "
                    "method back to back, then report tokens/s, speedups, tokens per target forward and "
                    "agreement with plain decoding. Resumable: rerun with the same --out to continue.")
    p.add_argument("--model", required=True, help="target model (offline name, HF directory, .gguf file or hub id)")
    p.add_argument("--draft-model", help="draft model sharing the target's tokenizer (methods draft, hf-assisted)")
    p.add_argument("--heads", metavar="DIR", nargs="+",
                   help="trained heads directories (methods auto, medusa, hydra, hydra++, eagle), or 'shipped' for those "
                        "shipped with an offline model; several may be given, each method takes the one of its kind "
                        "(hydra++ = Hydra heads with a prefix layer)")
    p.add_argument("--tree", help="token tree for medusa/hydra/draft: tree.json (hydraspec build-tree), JSON list of "
                                  "rank paths, or 'dynamic' (default: the heads' own default tree; a chain for draft)")
    p.add_argument("--min-prob", type=float, default=None, metavar="P",
                   help="eagle, greedy: leave out tree nodes whose path probability under the head is below P "
                        "(default: the heads' own, else 0)")
    p.add_argument("--tree-nodes", type=int, default=32, help="dynamic tree: nodes kept per step (default 32)")
    p.add_argument("--tree-depth", type=int, help="dynamic tree: depth (default: number of heads; 6 for draft)")
    p.add_argument("--tree-topk", type=int, default=8, help="dynamic tree: expanded nodes / children (default 8)")
    p.add_argument("--methods", default=DEFAULT_METHODS, metavar="M1,M2,...",
                   help=f"comma-separated, run in this order (default {DEFAULT_METHODS}); known: {known}")
    p.add_argument("--prompts", nargs="+", required=True, metavar="FILE.jsonl",
                   help="Spec-Bench/MT-Bench jsonl files: {question_id, category, turns}; with several files ids "
                        "are prefixed with the file name and a missing category is the file name")
    p.add_argument("--limit", type=int, metavar="N",
                   help="only the first N questions of each category (in file order)")
    p.add_argument("--skip", type=int, default=0, metavar="N",
                   help="leave out the first N questions of each category (e.g. the ones build-tree or "
                        "train-heads used: --skip there, --limit here, or the other way round)")
    p.add_argument("--categories", metavar="A,B", help="comma-separated categories to keep (default: all)")
    p.add_argument("--turns", type=int, default=None, metavar="N",
                   help="only the first N turns of each question (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per turn (default 128)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples (top-p/top-k off) and answers are not compared")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, set before every prompt (default 0)")
    add_dtype_arg(p)
    p.add_argument("--device", default="auto", choices=DEVICES)
    add_quant_arg(p)
    add_compile_arg(p, "auto")
    p.add_argument("--no-prepack", action="store_true",
                   help="keep plain nn.Linear kernels on CPU (default: prepacked weights, see hydraspec.cpu.kernels)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="output directory: records.jsonl, results.json, results.md, speedup.png, answers/")
    p.add_argument("--draft-k", type=int, default=None,
                   help="draft tokens per step to start with (default 5, or the tree shipped for the pair)")
    p.add_argument("--draft-confidence", type=float, default=None,
                   help="greedy drafting by the draft model stops when its top probability falls below this "
                        "(default 0.4 for the chain; off for a static tree unless given)")
    p.add_argument("--draft-leaves", type=int, default=None, metavar="N",
                   help="greedy draft chain: up to N of the draft model's runner-up tokens as extra leaves "
                        "(default 0); method variant draft@leaves=N sets it for one method")
    add_draft_quant_arg(p)  # for draft and hf-assisted alike
    add_draft_vocab_arg(p)
    add_suffix_store_arg(p)
    p.add_argument("--pld-tokens", type=int, default=10,
                   help="most tokens prompt lookup proposes, ours and transformers' (default 10)")
    p.add_argument("--batch-sizes", metavar="1,2,4,...",
                   help="batched mode: throughput and per-sequence latency of methods ar, pld, draft, medusa, hydra "
                        "and hf-ar (left-padded generate) at each batch size, first turns only; writes "
                        "batch_results.json/.md and batch_throughput.png")
    p.add_argument("--batch-trees", help="with --batch-sizes, for medusa/hydra: JSON file or object "
                                         "{batch_size: tree paths} (the tree of the largest size <= active rows)")
    p.add_argument("--llamacpp-args", metavar="'ARGS'",
                   help="extra llama-server arguments for the llamacpp-* methods, one shell-quoted string "
                        "(e.g. '--spec-draft-n-max 16 --spec-draft-p-min 0.8')")
    p.add_argument("--prefix-cache", type=int, default=0, metavar="TOKENS",
                   help="keep earlier turns' keys and values (up to TOKENS tokens per method), so a later turn "
                        "reads only its new tokens, as a chat server does: our engine's prefix cache, and "
                        "llama-server's prompt cache for the llamacpp-* methods (default 0: every turn read whole)")
    add_verify_budget_arg(p)
    p.set_defaults(func=_cmd)
    return p


__all__ = ["add_parser", "run_bench", "METHODS", "MethodSpec", "BenchContext", "Runner", "TurnResult", "register",
           "parse_methods", "Question", "load_prompt_file", "load_questions", "summarize"]
