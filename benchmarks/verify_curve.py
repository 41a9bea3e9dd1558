#!/usr/bin/env python3
"""The verify-cost curve of a GGUF model at the file's precision: one forward over n new tokens after a
prefix (512 tokens by default), as the engine calls it (eager), the median of several rounds in one process,
each round taking every size in turn; optionally an older version's native kernels timed in the same
process, round by round alternating with this one's (--against REV), and llama.cpp's cost for the same
batch sizes after the same prefix on the same file and threads (--llama-bench: llama-bench -p ... -d).

    python benchmarks/verify_curve.py qwen2.5-coder-1.5b-instruct [--against 8b39aae] [--llama-bench]
        [--sizes 1,2,...] [--prefix 512] [--rounds 7] [--json out.json] [--compile] [--prefetch 1024,4096]

--compile times the compiled steps that decoding uses (forwards of up to 16 tokens; longer ones run eagerly);
they hold this build's kernels, so --against is eager only. --prefetch times this build at several distances of its
weights' prefetch, alternating as --against does (compiled steps too: the distance is read at every call).
"""
import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from hydraspec.bench.llamacpp import tool
from hydraspec.cpu import build, kernels
from hydraspec.models import load_model
from hydraspec.models.registry import gguf_file
from hydraspec.verify_cost import forward_seconds, prefilled

SIZES = ",".join(str(n) for n in list(range(1, 17)) + [20, 24, 32])


def older_kernels(rev: str, out: Path):
    """The native library of revision ``rev`` (its csrc/ compiled with today's flags), loaded."""
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True).stdout.strip())
    archive = subprocess.run(["git", "archive", rev, "src/hydraspec/cpu/csrc"], cwd=root, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    isa = kernels.native_isa()
    so, why = build.compile_library(isa, out / "build", csrc=out / "src/hydraspec/cpu/csrc")
    if so is None:
        sys.exit(f"could not compile {rev}'s kernels: {why}")
    return kernels.load_library(so, isa)


def our_curves(model, libs: dict, sizes: list[int], prefix: int, rounds: int) -> dict:
    """{version: {n: median ms}}: every round times each size once with each version, in turn. ``libs``: version ->
    (library, its prefetch distance in bytes, or None for its own)."""
    cache, vocab, g = prefilled(model, prefix, max(sizes))
    times = {name: {n: [] for n in sizes} for name in libs}
    for r in range(rounds + 1):  # the first round warms up and is not counted
        for n in sizes:
            for name, (lib, ahead) in libs.items():
                with kernels.chosen_library(lib):
                    kernels.set_prefetch(lib, ahead)  # each version sets its own distance before it is timed
                    ms = forward_seconds(model, cache, prefix, n, vocab, g) * 1e3
                if r:
                    times[name][n].append(ms)
        print(f"round {r}/{rounds}", file=sys.stderr, flush=True)
    return {name: {n: statistics.median(v) for n, v in per.items()} for name, per in times.items()}


def llama_curve(path: Path, sizes: list[int], prefix: int, threads: int, reps: int) -> dict[int, float]:
    """llama.cpp's ms per forward of n tokens after ``prefix`` tokens of context (llama-bench's -d)."""
    out = subprocess.run([str(tool("llama-bench")), "-m", str(path), "-p", ",".join(map(str, sizes)), "-n", "0",
                          "-d", str(prefix), "-t", str(threads), "-r", str(reps), "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    return {row["n_prompt"]: row["avg_ns"] / 1e6 for row in json.loads(out)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--sizes", default=SIZES)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", help="a git revision whose native kernels are timed beside these")
    ap.add_argument("--llama-bench", action="store_true", help="also time llama.cpp on the same file")
    ap.add_argument("--json", help="write the curves here")
    ap.add_argument("--compile", action="store_true", help="the compiled steps (not with --against)")
    ap.add_argument("--prefetch", help="this build at each of these prefetch distances in bytes (e.g. 1024,4096)")
    a = ap.parse_args()
    if a.compile and a.against:
        sys.exit("--against times eager forwards only: the compiled steps hold this build's kernels")
    torch.set_num_threads(a.threads)
    sizes = [int(s) for s in a.sizes.split(",")]
    model, _ = load_model(a.model, quant="gguf", progress=False, compile=a.compile)
    this = kernels.native_lib()
    libs = {f"prefetch {d}": (this, int(d)) for d in a.prefetch.split(",")} if a.prefetch else {"this": (this, None)}
    tmp = Path(tempfile.mkdtemp())
    try:
        if a.against:
            libs[a.against] = (older_kernels(a.against, tmp), None)
        with torch.inference_mode():
            curves = our_curves(model, libs, sizes, a.prefix, a.rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.llama_bench:
        curves["llama.cpp"] = llama_curve(gguf_file(a.model), sizes, a.prefix, a.threads, a.rounds)
    print(f"| n | " + " | ".join(f"{k} ms | x one" for k in curves) + " |")
    print("|---:|" + "---:|---:|" * len(curves))
    for n in sizes:
        cells = [f"{c[n]:.1f} | {c[n] / c[sizes[0]]:.2f}" for c in curves.values()]
        print(f"| {n} | " + " | ".join(cells) + " |")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "prefix": a.prefix, "threads": a.threads,
                                            "compiled": a.compile, "curves": curves}, indent=1))


if __name__ == "__main__":
    main()
