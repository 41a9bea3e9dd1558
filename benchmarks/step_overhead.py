"""The engine's own time per decoding step at batch 1, for two checkouts of hydraspec in one run.

    git worktree add /tmp/hs-old <commit>
    python benchmarks/step_overhead.py --src /tmp/hs-old/src --src src --model smollm2-135m-instruct

Each round runs plain decoding (ar) of the same prompt once per checkout, in a fresh process each, in
alternating order; a small model makes the engine's Python between forwards a large part of each step. Prints
every round and the median tokens/s and milliseconds per step of each checkout.
"""
import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
from hydraspec.models import load_model
from hydraspec.generator import SpeculativeGenerator
model, tok = load_model(sys.argv[1], quant="auto", progress=False)
gen = SpeculativeGenerator(model, tok)
ids = gen.encode("Write a short story about a lighthouse keeper and a storm.")
gen.generate(input_ids=ids, max_new_tokens=16)  # warm-up
best = None
for _ in range(3):
    r = gen.generate(input_ids=ids, max_new_tokens=int(sys.argv[2]))
    s = r.stats
    step = (s.wall_s - s.prefill_s) / max(1, s.target_forwards)
    best = step if best is None else min(best, step)
print(json.dumps({"ms_per_step": best * 1e3, "tokens_per_s": 1.0 / best}))
"""


def run(src: str, model: str, tokens: int, threads: int) -> dict:
    env_path = f"PYTHONPATH={src}"
    out = subprocess.run(["env", env_path, sys.executable, "-c", CHILD, model, str(tokens), str(threads)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--src", action="append", required=True, help="a checkout's src/ folder (give two)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    seen: dict[str, list[float]] = {s: [] for s in a.src}
    for r in range(a.rounds):
        order = a.src if r % 2 == 0 else a.src[::-1]
        for src in order:
            res = run(src, a.model, a.tokens, a.threads)
            seen[src].append(res["ms_per_step"])
            print(f"round {r + 1}: {src}: {res['ms_per_step']:.3f} ms a step", flush=True)
    base = statistics.median(seen[a.src[0]])
    for src, ms in seen.items():
        med = statistics.median(ms)
        print(f"{src}: median {med:.3f} ms a step ({1e3 / med:.1f} tokens/s), {med / base:.3f}x the first")


if __name__ == "__main__":
    main()
