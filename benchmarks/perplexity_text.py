#!/usr/bin/env python3
"""Write a perplexity text from a Spec-Bench-format prompt file: the turns of its questions from --skip on,
joined by blank lines (for `hydraspec perplexity --text`; keep the questions apart from those you evaluate on).
    python benchmarks/perplexity_text.py PROMPTS.jsonl --skip 40 > text.txt"""
import argparse
import json
import sys

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("prompts")
ap.add_argument("--skip", type=int, default=40)
a = ap.parse_args()
with open(a.prompts, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
sys.stdout.write("\n\n".join(t for q in rows[a.skip:] for t in q["turns"]) + "\n")
