"""`hydraspec demo`: the embedded default model answers one prompt plainly and with speculation."""
from __future__ import annotations

import sys
from importlib.resources import files

from .drafters import make_drafter
from .generator import SpeculativeGenerator
from .heads import load_heads
from .models import DEFAULT_MODEL, load_model

DEMO_PROMPT = (
    "Add type hints and a docstring to this function, keep the code otherwise unchanged:\n\n"
    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError('window must be positive')\n"
    "    averages = []\n"
    "    for i in range(len(values) - window + 1):\n"
    "        chunk = values[i:i + window]\n"
    "        averages.append(sum(chunk) / window)\n"
    "    return averages\n"
)


def run_demo(args) -> int:
    name = args.model or DEFAULT_MODEL
    print(f"loading {name} ({args.dtype}) ...", file=sys.stderr)
    model, tok = load_model(name, dtype=args.dtype, device=args.device, auto_pull=True)
    prompt = args.prompt or DEMO_PROMPT
    runs = [("ar", make_drafter("ar")), ("pld", make_drafter("pld"))]
    if args.model is None or args.model == DEFAULT_MODEL:
        runs += bundled_head_drafters(model)
    results = {}
    for label, drafter in runs:
        gen = SpeculativeGenerator(model, tok, drafter)
        gen.generate(prompt, max_new_tokens=8)  # warm-up
        results[label] = gen.generate(prompt, max_new_tokens=args.max_new_tokens)
    ref = results["ar"]
    print(f"\nPrompt:\n{prompt}\nAnswer (ar):\n{ref.text}\n")
    print(f"{'method':8s} {'tokens':>6s} {'tokens/s':>9s} {'speedup':>8s} {'mean accepted':>14s}  same answer as ar")
    for label, r in results.items():
        s = r.stats
        same = "yes" if r.token_ids == ref.token_ids else f"NO (first difference at token {_first_diff(r.token_ids, ref.token_ids)})"
        print(f"{label:8s} {s.new_tokens:6d} {s.tokens_per_s:9.2f} {s.tokens_per_s / ref.stats.tokens_per_s:7.2f}x "
              f"{s.mean_accepted:14.2f}  {same}")
    print("\nmean accepted = new tokens / target forwards after prefill (plain decoding = 1.00)")
    return 0 if all(r.token_ids == ref.token_ids for r in results.values()) or args.dtype != "float32" else 1


def _first_diff(a, b) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def bundled_heads_dirs() -> list:
    """Heads trained by `hydraspec train-heads` for the default model and shipped with the package."""
    root = files("hydraspec") / "data" / "heads"
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and (p / "config.json").is_file())
    except (FileNotFoundError, NotADirectoryError):
        return []


def bundled_head_drafters(model) -> list:
    out = []
    for d in bundled_heads_dirs():
        heads, cfg = load_heads(d, model)
        method = "hydra++" if cfg["kind"] == "hydra" and cfg.get("prefix_layer") else cfg["kind"]
        out.append((method, make_drafter(method, heads=heads, embed=model.get_input_embeddings(),
                                         tree=cfg.get("default_tree"))))
    return out
