"""`hydraspec export-heads`: trained heads in the layout another engine loads: EAGLE-3 heads in the
speculators format (vLLM, SGLang), Medusa heads in FasterDecoding's."""
from __future__ import annotations

import sys

import torch

from ..errors import HydraspecError
from ..heads import load_heads
from ..heads.medusa_format import export_medusa
from ..heads.speculators_format import export_speculators
from ..options import add_model_args
from ..stack import load_models

__all__ = ["add_parser", "run"]


def run(args) -> int:
    model, _, _ = load_models(args)
    heads, _ = load_heads(args.heads, model, base_model=args.model)
    verifier = args.verifier or args.model
    if heads.kind == "eagle3":
        out = export_speculators(heads, model, args.out, base_model=verifier, dtype=getattr(torch, args.out_dtype))
        fmt = "speculators (EAGLE-3)"
    elif heads.kind == "medusa":
        out = export_medusa(heads, args.out, base_model=verifier)
        fmt = "FasterDecoding Medusa"
    else:
        raise HydraspecError(f"{heads.kind} heads have no format another engine loads; export eagle3 (speculators) "
                             f"or medusa heads")
    print(f"hydraspec export-heads: {fmt} checkpoint for {verifier} in {out}", file=sys.stderr)
    return 0


def add_parser(subparsers) -> None:
    """Register `export-heads` on an argparse subparsers object (``args.func`` runs it)."""
    e = subparsers.add_parser("export-heads", help="write trained heads in the layout vLLM / SGLang (EAGLE-3, "
                                                   "speculators format) or FasterDecoding (Medusa) load")
    add_model_args(e)
    e.add_argument("--heads", required=True, help="a train-heads output directory")
    e.add_argument("--out", required=True, help="the directory to write")
    e.add_argument("--verifier", help="the base model as the other engine names it (a hub id or a directory; "
                                      "default --model)")
    e.add_argument("--out-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    e.set_defaults(func=run, quant="none")  # the base's embeddings and lm_head rows are written at full precision
