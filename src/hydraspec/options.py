"""Command-line options shared by several commands (generate, bench, build-tree, serve): defined once here,
so that the tools under the command line need not import it."""
from __future__ import annotations

import argparse
import os

from .errors import HydraspecError
from .models import QUANTS


def thread_count() -> int:
    """Threads the commands compute with: $OMP_NUM_THREADS if set, else every core."""
    return int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, os.cpu_count() or 1)


def add_quant_arg(p) -> None:
    p.add_argument("--quant", choices=QUANTS, default="auto",
                   help="gguf: keep a GGUF model's weights at the file's own precision (CPU; --dtype is then the "
                        "activations' dtype); none: dequantize them to --dtype; auto (default): gguf for offline "
                        "names and .gguf files on the CPU")


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
    import sys

    from .models import shipped_draft_tree

    if not default_draft_shape(args) or not getattr(args, "draft_model", None):
        return None
    path = shipped_draft_tree(args.model, args.draft_model, getattr(args, "device", "auto"),
                              getattr(args, "quant", "auto"), getattr(args, "draft_quant", "auto"))
    if path is not None:
        print(f"hydraspec: drafting with the tree chosen for this pair on a CPU ({path.name}); "
              "--draft-k, --tree or --draft-confidence choose another", file=sys.stderr)
    return None if path is None else str(path)
