"""What reading a joining prompt beside a decoding row costs on this machine (the 1.5B at the file's precision,
compiled steps, 512 cached tokens per row, medians):

- ``one(k)``: one row's compiled forward over k new tokens (k <= 16 compiled, longer eager);
- ``split``: the decoding row's one-token forward, then the chunk's own forward (two calls);
- ``packed``: both in one packed forward (what the server runs: hydraspec.verify.verify_rows);
- ``prefill``: a chunk of k tokens read by hydraspec.cache.prefill_rows (eager), ms per token.

    python benchmarks/chunk_cost.py --reps 7
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hydraspec import models
from hydraspec.cache import allocate_rows, new_cache, prefill_rows, use_rows
from hydraspec.tree import chain, shape_of
from hydraspec.verify import verify_rows

PREFIX = 512


def median_ms(f, reps: int) -> float:
    f()
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sizes", default="1,2,4,8,12,16,32")
    ap.add_argument("--prefill-sizes", default="16,32,64,128,256")
    a = ap.parse_args()
    torch.set_num_threads(2)
    model, _ = models.load_model(a.model, quant="gguf", device="cpu", progress=False)
    models.compile_models(model, how=True)
    cache = new_cache(model, PREFIX + 320)
    allocate_rows(cache, model, 2)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(100, 20000, (PREFIX + 300,), generator=g).tolist() for _ in range(2)]
    prefill_rows(model, cache, 0, [x[:PREFIX] for x in ids])

    def one(k, row):
        use_rows(cache, row, row + 1)
        verify_rows(model, cache, [ids[row][PREFIX:PREFIX + k]], [shape_of(chain(k))], [PREFIX])

    def packed(k):
        use_rows(cache, 0, 2)
        verify_rows(model, cache, [ids[0][PREFIX:PREFIX + 1], ids[1][PREFIX:PREFIX + k]],
                    [shape_of(chain(1)), shape_of(chain(k))], [PREFIX, PREFIX])

    with torch.inference_mode():
        rows = []
        for k in [int(x) for x in a.sizes.split(",")]:
            row = {"k": k, "one_1_ms": median_ms(lambda: one(1, 0), a.reps), "one_k_ms": median_ms(lambda: one(k, 1), a.reps),
                   "split_ms": median_ms(lambda: (one(1, 0), one(k, 1)), a.reps), "packed_ms": median_ms(lambda: packed(k), a.reps)}
            rows.append(row)
            print(json.dumps({x: round(v, 1) for x, v in row.items()}), flush=True)
        for k in [int(x) for x in a.prefill_sizes.split(",")]:
            use_rows(cache, 1, 2)
            ms = median_ms(lambda: prefill_rows(model, cache, 1, [ids[1][PREFIX:PREFIX + k]], starts=[PREFIX]), a.reps)
            print(json.dumps({"prefill_k": k, "ms": round(ms, 1), "ms_per_token": round(ms / k, 2)}), flush=True)


if __name__ == "__main__":
    main()
