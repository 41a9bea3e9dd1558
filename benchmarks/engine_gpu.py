"""hydraspec's own engine on a GPU: plain decoding against predicted outputs, random weights in Qwen2.5-Coder shapes.

    python benchmarks/engine_gpu.py --tokenizer DIR --out engine_gpu.json           # CUDA, float32, 1.5B and 0.5B shapes
    python benchmarks/engine_gpu.py --tokenizer DIR --tiny --out tiny.json          # 2 layers, float32, CPU: a smoke test

What it measures: the engine's whole decoding loop (SpeculativeGenerator: drafting, tree verify, acceptance,
cache bookkeeping) on a device where a verify forward over many tokens costs about what one token costs. Random
weights make the model's own drafts worthless, so the drafts come from a prediction (OpenAI's predicted outputs,
the ``auto`` method's ``prediction`` source) whose agreement with the answer is set: the answer itself (every
draft accepted), the answer with every k-th token replaced (the drafter re-aligns after each miss), and no
prediction at all (``auto`` with only the prompt and the answer so far to draft from). Float32 with TF32
off by default (in bf16 the tree verify's argmax differs from one token's at near-ties). The prompt is 512 random
token ids; 128 new tokens, greedy, after an untimed warm-up of each variant on another prompt; each variant gets
a fresh ``auto`` drafter, so suffix decoding's store of earlier answers starts empty.

Greedy answers are compared with plain decoding's. On random weights the logits are nearly flat, and a forward
over n tokens does not round like a forward over one on a GPU, so a near-tie can flip: the count of tokens equal
to plain decoding's before the first difference is reported, not asserted.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import transformers
from transformers import AutoTokenizer
from verify_cost_gpu import SHAPES, TINY, build  # the same random-weight models (benchmarks/ is on sys.path)

from hydraspec import SpeculativeGenerator
from hydraspec.drafters import make_auto


def timed(gen, ids, new, prediction=None) -> dict:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    r = gen.generate(input_ids=ids, max_new_tokens=new, prediction=prediction)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    s = r.stats
    return {"tokens": r.token_ids, "wall_s": wall, "new_tokens": s.new_tokens, "forwards": s.target_forwards,
            "prefill_s": s.prefill_s, "draft_s": s.draft_s, "verify_s": s.verify_s, "accept_s": s.accept_s}


def same_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens a and b share before their first difference."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def spoil(tokens: list[int], every: int) -> list[int]:
    """The answer with every ``every``-th token replaced by another id (a prediction that departs and returns)."""
    return [(t + 7) % 151000 if (i + 1) % every == 0 else t for i, t in enumerate(tokens)]


def run_shape(shape: str, tok, device: str, dtype, new: int, prompt_len: int) -> dict:
    model = build({**SHAPES, **TINY}[shape], 151936, dtype, torch.device(device), seed=0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, 1000, (prompt_len,), generator=g).tolist()
    ar = SpeculativeGenerator(model, tok, None)
    ar.generate(input_ids=ids, max_new_tokens=16)
    first = timed(ar, ids, new)
    t = time.perf_counter()
    make_auto(model)  # the verify cost, measured once per process
    cost_s = time.perf_counter() - t
    variants = {"auto, no prediction": None, "auto, prediction = answer": first["tokens"]}
    for k in (4, 8, 16):
        variants[f"auto, prediction with every {k}th token wrong"] = spoil(first["tokens"], k)
    rows = {"ar (first)": first}
    for name, pred in variants.items():  # a fresh drafter each time: suffix decoding's store starts empty
        SpeculativeGenerator(model, tok, make_auto(model)).generate(input_ids=ids[::-1], max_new_tokens=16)
        rows[name] = timed(SpeculativeGenerator(model, tok, make_auto(model)), ids, new, pred)
    rows["ar (last)"] = timed(ar, ids, new)
    report(shape, rows, min(first, rows["ar (last)"], key=lambda r: r["wall_s"]))  # the faster plain run
    return {"verify_cost_measure_s": cost_s, "rows": rows}


def report(shape: str, rows: dict, plain: dict) -> None:
    """Each row's speed over ``plain`` and its agreement with plain decoding, printed and kept in the row (its
    tokens dropped)."""
    answer = plain["tokens"]
    for name, r in rows.items():
        r["same_as_ar"] = same_prefix(r["tokens"], answer)
        r["tokens_per_s"] = r["new_tokens"] / r["wall_s"]
        r["over_ar"] = r["tokens_per_s"] / (plain["new_tokens"] / plain["wall_s"])
        r["ms_per_forward"] = 1000 * (r["wall_s"] - r["prefill_s"]) / max(1, r["forwards"])
        print(f"{shape:26s} {name:44s} {r['tokens_per_s']:7.1f} tok/s {r['over_ar']:5.2f}x ar  "
              f"{r['new_tokens'] / max(1, r['forwards']):5.2f} tok/forward  {r['ms_per_forward']:6.2f} ms/forward  "
              f"draft {1000 * r['draft_s']:6.1f} ms  same as ar for {r['same_as_ar']} tokens", flush=True)
    for r in rows.values():
        del r["tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="a folder with a Qwen2.5 tokenizer (tokenizer.json etc.)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="float32 (TF32 off) keeps a verify over n tokens rounding like one token's (default)")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    device = "cpu" if a.tiny else "cuda"
    dtype = torch.float32 if a.tiny else getattr(torch, a.dtype)
    shapes = ["tiny"] if a.tiny else ["qwen2.5-coder-1.5b-shape", "qwen2.5-coder-0.5b-shape"]
    out = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(), "dtype": str(dtype),
           "new_tokens": a.new, "prompt_tokens": a.prompt,
           "shapes": {s: run_shape(s, tok, device, dtype, a.new, a.prompt) for s in shapes}}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
