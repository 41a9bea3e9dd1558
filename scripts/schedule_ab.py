"""Static against dynamic hand-out of weight blocks to threads in the native matmuls (hs_set_dynamic), plain
decoding per token, alternating in one process; with --hog, a busy process shares the cores (as another
program or a slowed virtual CPU would), and llama.cpp's llama-server (if built) runs the same tokens.

    python scripts/schedule_ab.py qwen2.5-coder-1.5b-instruct --rounds 4 [--hog] [--llamacpp]
"""
import argparse
import statistics
import subprocess
import sys
import time

import torch

from compile_ab import PROMPTS, llama_ms, start_server  # scripts/ beside this file
from hydraspec.cpu.kernels import native_lib
from hydraspec.generator import SpeculativeGenerator
from hydraspec.models import load_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--hog", action="store_true", help="a busy process beside the decoding")
    ap.add_argument("--llamacpp", action="store_true", help="llama-server on the same file and tokens")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--port", type=int, default=8938)
    args = ap.parse_args()
    torch.set_num_threads(2)
    lib = native_lib()
    srv = None
    if args.llamacpp:
        srv = start_server(args.model, args.port)
    model, tok = load_model(args.model, quant="gguf", progress=False, compile=args.compile)
    gen = SpeculativeGenerator(model, tok)
    ids = {k: gen.encode(p) for k, p in PROMPTS.items()}
    gen.generate(input_ids=ids["lua"], max_new_tokens=4)

    def ours(dynamic):
        def run(x):
            lib.hs_set_dynamic(dynamic)
            s = gen.generate(input_ids=x, max_new_tokens=args.tokens)
            return (s.stats.wall_s - s.stats.prefill_s) / s.stats.target_forwards * 1e3, s.token_ids
        return run

    def llama(x):
        return llama_ms(args.port, x, args.tokens), None

    sides = [("static", ours(0)), ("dynamic", ours(1))] + ([("llama.cpp", llama)] if srv else [])
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.hog else None
    if srv:
        time.sleep(5)
    ms, toks = {}, {}
    try:
        for r in range(args.rounds):
            for k, x in ids.items():
                row = {}
                for name, f in (sides if r % 2 == 0 else sides[::-1]):
                    row[name], t = f(x)
                    ms.setdefault(name, []).append(row[name])
                    if t is not None:
                        toks.setdefault(k, set()).add(tuple(t))
                print(r, k, {n: round(v, 1) for n, v in row.items()}, flush=True)
    finally:
        lib.hs_set_dynamic(1)
        for p in (hog, srv):
            if p:
                p.terminate()
    print("hog" if args.hog else "quiet", {n: round(statistics.median(v), 2) for n, v in ms.items()},
          "same tokens" if all(len(v) == 1 for v in toks.values()) else "TOKENS DIFFER")


if __name__ == "__main__":
    main()
