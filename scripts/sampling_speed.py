"""Drawing one token from a full-vocabulary distribution: hydraspec.sampling.sample (cumulative sum and binary
search) against torch.multinomial, and batched sampled decoding with the engine (what self-written prompts and
a sampling server do), tokens per second.

    python scripts/sampling_speed.py [--model qwen2.5-coder-0.5b-instruct] [--rows 16] [--tokens 48]
"""
import argparse
import time

import torch

from hydraspec.sampling import sample


def per_call_ms(fn, n: int = 50) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(args.vocab, generator=g) * 3, -1)
    print(f"one draw from {args.vocab} probabilities: torch.multinomial "
          f"{per_call_ms(lambda: torch.multinomial(p, 1, generator=g)):.3f} ms, "
          f"hydraspec.sampling.sample {per_call_ms(lambda: sample(p, g)):.3f} ms")

    from hydraspec.batch import BatchGenerator
    from hydraspec.models import load_model
    from hydraspec.train.selfprompts import OPENERS, user_turn_prefix

    model, tok = load_model(args.model)
    prefix = user_turn_prefix(tok)
    ids = [tok(prefix + OPENERS[i % len(OPENERS)], add_special_tokens=False)["input_ids"] for i in range(args.rows)]
    gen = BatchGenerator(model, tok)
    gen.generate(input_ids=ids[:2], max_new_tokens=4, temperature=1.0, top_k=50, top_p=0.95, seed=1)  # warm-up
    t = time.perf_counter()
    res = gen.generate(input_ids=ids, max_new_tokens=args.tokens, batch_size=args.rows, temperature=1.0, top_k=50,
                       top_p=0.95, seed=1)
    secs = time.perf_counter() - t
    n = sum(len(r.token_ids) for r in res)
    print(f"{args.model}, {args.rows} rows sampled (T 1, top-k 50, top-p 0.95): {n} tokens in "
          f"{secs:.1f} s = {n / secs:.1f} tokens/s")


if __name__ == "__main__":
    main()
