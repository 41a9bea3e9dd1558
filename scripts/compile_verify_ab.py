"""One forward over n new tokens after a 150-token prefix (a verify step), eager against compiled
(hydraspec.cpu.graph), alternating in one process; chains under the causal mask, as the engine verifies them.

    python scripts/compile_verify_ab.py qwen2.5-coder-1.5b-instruct --sizes 1,2,4,8,16 --reps 7
"""
import argparse
import statistics
import time

import torch

from hydraspec.cache import new_cache, set_length
from hydraspec.models import load_model
from hydraspec.verify import forward_nodes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--sizes", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--prefix", type=int, default=150)
    args = ap.parse_args()
    torch.set_num_threads(2)
    models = {"eager": load_model(args.model, quant="gguf", progress=False)[0],
              "compiled": load_model(args.model, quant="gguf", progress=False, compile=True)[0]}
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 10000, (args.prefix,), generator=gen)
    caches = {k: new_cache(m, args.prefix + 64) for k, m in models.items()}
    L = args.prefix
    with torch.inference_mode():
        for k, m in models.items():
            forward_nodes(m, caches[k], prefix, torch.arange(L), None, 0, last_only=True)
        ms = {}
        for rep in range(args.reps):
            for n in [int(x) for x in args.sizes.split(",")]:
                ids = torch.randint(100, 10000, (n,), generator=gen)
                order = list(models) if rep % 2 == 0 else list(models)[::-1]
                logits = {}
                for k in order:
                    set_length(caches[k], L)
                    t = time.perf_counter()
                    logits[k] = forward_nodes(models[k], caches[k], ids, L + torch.arange(n), None, 0)[0]
                    ms.setdefault((k, n), []).append((time.perf_counter() - t) * 1e3)
                assert torch.equal(logits["eager"], logits["compiled"]), n
    for n in [int(x) for x in args.sizes.split(",")]:
        e, c = statistics.median(ms[("eager", n)]), statistics.median(ms[("compiled", n)])
        print(f"n={n:2d}  eager {e:6.1f} ms  compiled {c:6.1f} ms  saved {e - c:5.1f} ms")


if __name__ == "__main__":
    main()
