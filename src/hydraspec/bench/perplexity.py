"""`hydraspec perplexity`: a model's perplexity on a text, computed the way llama.cpp's `llama-perplexity`
computes it, so that the two can be compared on the same GGUF file and text.

The protocol (llama.cpp tools/perplexity, its default mode): the whole text is tokenized once (a BOS first
where the vocabulary adds one); it is cut into chunks of ``ctx`` tokens (the tail that does not fill a chunk
is dropped); each chunk is one forward from an empty cache, its first token replaced by BOS where the
vocabulary adds one; only the second half of each chunk is scored: the logits at positions ctx/2 .. ctx-2
predict the tokens after them. Perplexity = exp(mean negative log-likelihood); its uncertainty is the
standard error of the mean, as llama.cpp prints it.
"""
from __future__ import annotations

import math
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import HydraspecError
from ..models import DEVICES, gguf_file, load_model, resolve_device, resolve_quant
from ..options import add_dtype_arg, add_quant_arg, thread_count
from .llamacpp import tool


@dataclass
class Perplexity:
    ppl: float
    stderr: float  # of the perplexity, llama.cpp's "+/-"
    tokens_scored: int
    chunks: int


def chunk_tokens(ids: list[int], ctx: int, chunks: int | None, bos: int | None) -> list[list[int]]:
    if ctx < 4:
        raise HydraspecError(f"--ctx must be at least 4, got {ctx}")
    n = len(ids) // ctx
    if len(ids) < 2 * ctx:
        raise HydraspecError(f"the text has {len(ids)} tokens; a context of {ctx} needs at least {2 * ctx}")
    n = n if chunks is None else min(n, chunks)
    out = [list(ids[i * ctx:(i + 1) * ctx]) for i in range(n)]
    if bos is not None:
        for c in out:
            c[0] = bos
    return out


def score(nlls: list[float], chunks: int) -> Perplexity:
    t = torch.tensor(nlls, dtype=torch.float64)
    mean = t.mean().item()
    var = (t.pow(2).mean() - t.mean().pow(2)).item()
    ppl = math.exp(mean)
    se = math.sqrt(var / (len(nlls) - 1)) * ppl if var > 0 and len(nlls) > 1 else 0.0
    return Perplexity(ppl, se, len(nlls), chunks)


def perplexity(model, tokenizer, text: str, ctx: int = 512, chunks: int | None = None, progress: bool = True) \
        -> Perplexity:
    """``model``'s perplexity on ``text`` by llama.cpp's protocol (module docstring)."""
    bos = tokenizer.bos_token_id if getattr(tokenizer, "add_bos_token", False) else None
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if bos is not None:
        ids = [bos] + ids
    parts = chunk_tokens(ids, ctx, chunks, bos)
    first = ctx // 2
    nlls: list[float] = []
    for c in tqdm(parts, desc="perplexity", unit="chunk", disable=not progress, file=sys.stderr):
        x = torch.tensor([c], device=model.device)
        with torch.inference_mode():
            logits = model(x, use_cache=False).logits[0, first:ctx - 1].float()
        lp = torch.log_softmax(logits, -1)
        target = x[0, first + 1:ctx]
        nlls += (-lp.gather(-1, target[:, None])[:, 0]).double().tolist()
    return score(nlls, len(parts))


FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def llamacpp_perplexity(binary: Path, gguf: Path, text_file: Path, ctx: int, chunks: int | None, threads: int) \
        -> Perplexity:
    """llama.cpp's own figure: runs `llama-perplexity` on the same file and text."""
    cmd = [str(binary), "-m", str(gguf), "-f", str(text_file), "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    if chunks is not None:
        cmd += ["--chunks", str(chunks)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    m = FINAL.search(proc.stdout + proc.stderr)
    if proc.returncode != 0 or m is None:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise HydraspecError(f"llama-perplexity failed (status {proc.returncode}): {' | '.join(tail)}")
    n = re.search(r"calculating perplexity over (\d+) chunks", proc.stdout + proc.stderr)
    k = int(n.group(1)) if n else 0
    return Perplexity(float(m.group(1)), float(m.group(2)), k * (ctx - 1 - ctx // 2), k)


def run(args) -> int:
    path = Path(args.text)
    if not path.is_file():
        raise HydraspecError(f"--text {path}: no such file")
    text = path.read_text(encoding="utf-8")
    threads = thread_count()
    torch.set_num_threads(threads)
    quant = resolve_quant(args.quant, args.model, resolve_device(args.device))
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device, quant=quant)
    ours = perplexity(model, tok, text, args.ctx, args.chunks)
    print(f"hydraspec (--quant {quant}, {args.dtype}): PPL = {ours.ppl:.4f} +/- {ours.stderr:.5f} over "
          f"{ours.tokens_scored} tokens in {ours.chunks} chunks of {args.ctx}")
    if args.llamacpp:
        theirs = llamacpp_perplexity(tool("llama-perplexity"), gguf_file(args.model), path, args.ctx, args.chunks, threads)
        print(f"llama.cpp llama-perplexity: PPL = {theirs.ppl:.4f} +/- {theirs.stderr:.5f} over {theirs.chunks} "
              f"chunks")
        print(f"ratio hydraspec / llama.cpp: {ours.ppl / theirs.ppl:.4f} ({100 * (ours.ppl / theirs.ppl - 1):+.2f} %)")
    return 0


def add_parser(subparsers):
    p = subparsers.add_parser("perplexity", help="a model's perplexity on a text (llama.cpp's protocol)",
                              description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--model", required=True, help="offline name, .gguf file or model directory")
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512, as llama-perplexity)")
    p.add_argument("--chunks", type=int, metavar="N", help="score only the first N chunks")
    add_dtype_arg(p)
    p.add_argument("--device", default="auto", choices=DEVICES)
    add_quant_arg(p)
    p.add_argument("--llamacpp", action="store_true",
                   help="also run llama.cpp's llama-perplexity on the same GGUF file and text, and compare")
    p.set_defaults(func=run)
    return p
