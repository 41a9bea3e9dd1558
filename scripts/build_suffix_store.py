"""Write a store of answers for suffix decoding to draft from in every process (hydraspec.drafters.suffix.load_store),
from the answers files that `hydraspec train-heads --data-only` writes.

    python scripts/build_suffix_store.py OUT.npz ANSWERS.jsonl [ANSWERS.jsonl ...] [--max-tokens N] [--note TEXT]

The file holds every answer's token ids (``tokens``, one answer after another), where each ends (``ends``), and a
JSON note of where they came from (``meta``). The ids are the answering model's: a store serves models that share
its tokenizer.
"""
import argparse
import json
import os
import sys

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("answers", nargs="+")
    ap.add_argument("--max-tokens", type=int, default=0, help="stop after this many answer tokens (0: all)")
    ap.add_argument("--note", default="", help="how the answers were made (the command), kept in the file")
    a = ap.parse_args()
    seqs = []
    for path in a.answers:
        with open(path) as f:
            seqs += [r["answer_ids"] for r in map(json.loads, f) if r.get("answer_ids")]
    kept, total = [], 0
    for s in seqs:
        if a.max_tokens and total + len(s) > a.max_tokens:
            break
        kept.append(s)
        total += len(s)
    tokens = np.array([t for s in kept for t in s], dtype=np.uint32)
    ends = np.cumsum([len(s) for s in kept]).astype(np.int64)
    meta = {"answers": len(kept), "tokens": total, "sources": [os.path.basename(p) for p in a.answers], "note": a.note}
    np.savez_compressed(a.out, tokens=tokens, ends=ends, meta=np.array(json.dumps(meta)))
    print(f"{a.out}: {len(kept)} answers, {total} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
