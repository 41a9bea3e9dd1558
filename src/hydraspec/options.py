"""Command-line options shared by several commands (generate, serve, bench, build-tree, train-heads): defined
once here, so that the tools under the command line need not import it."""
from __future__ import annotations

import argparse
import functools
import os
import sys

from .drafters.suffix import load_store
from .errors import HydraspecError
from .models import DEVICES, DTYPES, QUANTS, resolve_precision, shipped_draft_tree, shipped_heads, \
    shipped_suffix_store



def thread_count() -> int:
    """Threads the commands compute with: $OMP_NUM_THREADS if set, else every core."""
    return int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, os.cpu_count() or 1)


class _Given(argparse.Action):
    """Stores the value and records that it was given (``args.<dest>_given``): an explicit --dtype means
    something a default one does not (see :func:`resolve_precision_args`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, self.dest + "_given", True)


def add_dtype_arg(p) -> None:
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, action=_Given,
                   help="the weights' and activations' dtype (default bfloat16). An explicit --dtype on an "
                        "offline name or a .gguf file means its weights dequantized to that dtype (--quant none); "
                        "without it such a model keeps the file's precision on the CPU")


def add_quant_arg(p) -> None:
    p.add_argument("--quant", choices=QUANTS, default="auto",
                   help="gguf: keep a GGUF model's weights at the file's own precision (CPU; computes in bfloat16, "
                        "so --dtype float32/float16 is refused with it); none: dequantize them to --dtype; auto "
                        "(default): gguf for offline names and .gguf files on the CPU when no --dtype is given, "
                        "else none")


def resolve_precision_args(args) -> None:
    """Make ``args.dtype`` and ``args.quant`` what they mean together (hydraspec.models.resolve_precision:
    an explicit --dtype on a GGUF input dequantizes it; --quant gguf computes in bfloat16), in place, before a
    command loads anything; a draft model follows: with an explicit --dtype float32 or float16, --draft-quant
    auto is none (the quantized draft kernels compute in bfloat16) and a quantized --draft-quant is refused.
    Commands without --model, --dtype and --quant are left alone."""
    if not all(hasattr(args, a) for a in ("model", "dtype", "quant")) or not args.model:
        return
    given = getattr(args, "dtype_given", False)
    args.dtype, args.quant = resolve_precision(args.model, args.dtype if given else None, args.quant,
                                               getattr(args, "device", "auto"))
    dq = getattr(args, "draft_quant", None)
    if given and args.dtype != "bfloat16" and getattr(args, "draft_model", None) and dq is not None:
        if dq == "auto":
            args.draft_quant = "none"
        elif dq != "none":
            raise HydraspecError(f"--draft-quant {dq} computes in bfloat16, not --dtype {args.dtype}; use "
                                 f"--draft-quant none (or leave out --dtype)")


def add_compile_arg(p, default: bool | str = False) -> None:
    """--compile / --no-compile; ``default`` False (generate: one answer does not repay the compile) or "auto"
    (bench, serve: compiled wherever that can be done, quietly eager elsewhere)."""
    auto = default == "auto"
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=default,
                   help="run the target's and the draft model's decoding steps and verify forwards under torch.compile "
                        "with the native kernels inside the graph (--quant gguf on the CPU; same numbers, less Python "
                        "per step; compiling takes one to two minutes a model on two cores once per process; needs a "
                        "C++ compiler). Default: " + ("on where it can be done" if auto else "off"))


def add_draft_quant_arg(p) -> None:
    p.add_argument("--draft-quant", choices=["auto", "gguf", "none", "int8", "w8a8", "w4a8"], default="auto",
                   help="auto (default): w4a8 from the file's own values for a GGUF draft on the CPU (gguf without the "
                        "native kernel), else none; gguf: the draft GGUF's own precision; "
                        "int8: hold the draft model's weights as int8 (CPU; halves the bytes a draft token reads); w8a8: "
                        "int8 weights and activations, multiplied as integers (AVX512_VNNI, or AVX2; less "
                        "arithmetic); w4a8: 4-bit weights (groups of 64 inputs) and int8 activations (half the "
                        "bytes of int8); the output stays the target's")


def add_draft_vocab_arg(p) -> None:
    p.add_argument("--draft-vocab", type=int, metavar="N",
                   help="the draft model proposes only the first N token ids and the special tokens (its output "
                        "layer shrinks to those rows; the output stays the target's); 0: the whole vocabulary; default: 32768 "
                        "for vocabularies above 65536 ids (Qwen2.5's 151936), else the whole")


def add_verify_budget_arg(p) -> None:
    p.add_argument("--verify-budget", type=int, metavar="N",
                   help="with batching: at most N tokens per verify forward over the whole batch; each row's draft is "
                        "cut to N // rows - 1 nodes (long drafts at batch 1, short at batch 8; output unchanged)")


def leaves_option(args, widths=None) -> dict:
    """--draft-leaves as a make_drafter option (the chain's only; refused with a draft tree)."""
    n = getattr(args, "draft_leaves", None)
    if n is None:
        return {}
    if n < 0:
        raise HydraspecError("--draft-leaves must be >= 0")
    if n and (widths or getattr(args, "tree", None)):
        raise HydraspecError("--draft-leaves applies to the draft chain, not to --draft-tree or --tree")
    return {"leaves": n}


def draft_k_option(args) -> dict:
    """--draft-k as a make_drafter option; not given: the drafter's own default length."""
    k = getattr(args, "draft_k", None)
    return {} if k is None else {"k": k}


def default_draft_shape(args) -> bool:
    """Whether no draft shape was asked for (no --tree, --draft-tree, --draft-k, --no-dynamic,
    --draft-confidence or --draft-leaves): then a shipped tree for the pair may be used."""
    return (getattr(args, "tree", None) is None and getattr(args, "draft_tree", None) is None
            and getattr(args, "draft_k", None) is None and not getattr(args, "no_dynamic", False)
            and getattr(args, "draft_confidence", None) is None and getattr(args, "draft_leaves", None) is None)


def shipped_tree_for(args) -> str | None:
    """The shipped draft tree (hydraspec.models.shipped_draft_tree) for ``args``' target and draft model when
    no draft shape was asked for, else None; says on stderr which file it drafts with."""
    if not default_draft_shape(args) or not getattr(args, "draft_model", None):
        return None
    path = shipped_draft_tree(args.model, args.draft_model, getattr(args, "device", "auto"),
                              getattr(args, "quant", "auto"), getattr(args, "draft_quant", "auto"))
    if path is not None:
        print(f"hydraspec: drafting with the tree chosen for this pair on a CPU ({path.name}); "
              "--draft-k, --tree or --draft-confidence choose another", file=sys.stderr)
    return None if path is None else str(path)


ACCEPTOR_CHOICES = ("auto", "greedy", "lossless", "typical")


def add_suffix_store_arg(p) -> None:
    p.add_argument("--suffix-store", metavar="FILE",
                   help="answers suffix decoding (suffix, auto) also drafts from in every process: an .npz from "
                        "scripts/build_suffix_store.py, 'shipped' for the store shipped with an offline model, or "
                        "'none' (default: the shipped store where the model has one, BENCHMARKS.md)")


def resolve_heads_arg(args) -> None:
    """What --heads means: 'none', no heads; 'shipped', the heads shipped for an offline model
    (models.shipped_heads); unset, for `generate --method auto` without a draft model, the shipped heads if any.
    `serve` and `bench` take them only when asked (a following head's proposal is paid for every row of a batch),
    and beside a draft model they add no tokens a step (BENCHMARKS.md)."""
    given = getattr(args, "heads", None)
    dirs = [given] if isinstance(given, str) else list(given or [])
    if dirs == ["none"]:
        args.heads = None
    elif "shipped" in dirs:
        found = shipped_heads(args.model)
        if found is None:
            raise HydraspecError(f"no heads ship for '{args.model}'; give a directory of trained heads")
        dirs = [str(found) if d == "shipped" else d for d in dirs]
        args.heads = dirs if isinstance(given, list) else dirs[0]
    elif given is None and getattr(args, "cmd", None) == "generate" and getattr(args, "method", None) == "auto" \
            and not getattr(args, "draft_model", None):
        found = shipped_heads(args.model)
        args.heads = None if found is None else str(found)


def suffix_store_for(args) -> list[list[int]] | None:
    """The answers of --suffix-store (hydraspec.drafters.suffix.load_store): a file, 'shipped' (the store shipped
    for ``args``' offline model, if any; also when unset), or None ('none')."""
    path = getattr(args, "suffix_store", None)
    if path == "none":
        return None
    if path in (None, "shipped"):
        path = shipped_suffix_store(getattr(args, "model", ""))
    return None if path is None else read_store(str(path))


@functools.lru_cache(maxsize=2)
def read_store(path: str) -> list[list[int]]:
    try:
        return load_store(path)
    except (OSError, KeyError, ValueError) as exc:
        raise HydraspecError(f"cannot read suffix store {path}: {exc}") from None


def add_model_args(p, compile_default: bool | str = False) -> None:
    p.add_argument("--model", required=True, help="offline name (see `hydraspec models list`), HF directory, .gguf file or hub id")
    add_dtype_arg(p)
    p.add_argument("--device", default="auto", choices=DEVICES)
    add_quant_arg(p)
    add_compile_arg(p, compile_default)
    p.add_argument("--no-prepack", action="store_true",
                   help="keep plain nn.Linear kernels on CPU (default: prepacked weights, see hydraspec.cpu.kernels)")


def add_method_args(p) -> None:
    p.add_argument("--draft-model", help="smaller model with the same tokenizer (method 'draft')")
    p.add_argument("--draft-k", type=int, default=None,
                   help="draft tokens per step to start with (default 5, or the tree shipped for the pair)")
    add_draft_quant_arg(p)
    add_draft_vocab_arg(p)
    p.add_argument("--no-dynamic", action="store_true", help="keep the draft length fixed at --draft-k")
    p.add_argument("--draft-tree", help="draft a tree instead of a chain: children per depth, e.g. 2,2,1")
    p.add_argument("--draft-confidence", type=float, default=None,
                   help="greedy drafting by the draft model stops when its top probability falls below this "
                        "(default 0.4 for the chain; off for a static --tree unless given, then the tree is "
                        "cut at the first level where every parent is below it; 0 turns it off)")
    p.add_argument("--draft-leaves", type=int, default=None, metavar="N",
                   help="greedy draft chain: hang up to N of the draft model's runner-up tokens on the chain as "
                        "extra leaves (one verify row each, no draft forward; default 0)")
    p.add_argument("--heads", help="directory of trained draft heads (methods medusa, hydra, hydra++, eagle, auto); "
                                   "'shipped' for those shipped with an offline model, which generate --method auto "
                                   "takes without a draft model unless given 'none'")
    p.add_argument("--min-prob", type=float, default=None, metavar="P",
                   help="eagle, greedy: leave out tree nodes whose path probability under the head is below P "
                        "(default: the heads' own, from their config.json, else 0 = the whole tree)")
    p.add_argument("--tree", help="token tree for medusa/hydra/draft: a tree.json from `hydraspec build-tree`, a "
                                  "JSON list of rank paths, or 'dynamic' (--tree-nodes, --tree-depth, --tree-topk)")
    p.add_argument("--tree-nodes", type=int, default=32, help="dynamic tree: nodes kept per step (default 32)")
    p.add_argument("--tree-depth", type=int, help="dynamic tree: depth (default: the number of heads; 6 for a "
                                                   "draft model)")
    p.add_argument("--tree-topk", type=int, default=8,
                   help="dynamic tree: nodes expanded per depth and children per node (default 8)")
    add_suffix_store_arg(p)
    p.add_argument("--pld-tokens", type=int, default=10, help="most tokens prompt lookup proposes (default 10)")
    p.add_argument("--pld-ngram", type=int, default=3, help="longest n-gram prompt lookup matches (default 3)")
    p.add_argument("--pld-min-ngram", type=int, default=2, help="shortest n-gram it matches (default 2)")


METHOD_HELP = ("auto (default: per request and step, whichever drafter is expected to pay most, or none: prompt "
               "lookup, suffix decoding, predictions, and --draft-model / --heads where given) | ar | draft | pld | "
               "suffix | medusa | hydra | hydra++ | eagle | pld+draft | pld+medusa | pld+hydra | pld+hydra++ | "
               "pld+eagle")


def add_sampling_args(p) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--acceptor", default="auto", choices=ACCEPTOR_CHOICES,
                   help="auto: greedy at temperature 0, else lossless speculative sampling; "
                        "typical is faster but does not preserve the distribution")
