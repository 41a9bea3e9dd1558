"""Start-up time of a model on this machine: loading the GGUF at the file's precision, then compiling the
decoding steps (hydraspec.cpu.graph), in this fresh process; run it twice to see the warm caches (the GGUF
layout index in the hydraspec home, torch's compile caches).

    python benchmarks/startup.py qwen2.5-coder-1.5b-instruct
    python benchmarks/startup.py smollm2-135m-instruct --no-compile
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from hydraspec import models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="offline name or .gguf file")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    model, _ = models.load_model(a.model, quant="gguf", device="cpu", progress=False)
    out = {"model": a.model, "cpu": platform.processor() or platform.machine(), "load_s": time.perf_counter() - t0}
    if a.compile:
        from torch._dynamo.utils import counters

        t1 = time.perf_counter()
        models.compile_models(model, how=True)
        out["compile_s"] = time.perf_counter() - t1
        out["counters"] = {k: dict(v) for k, v in counters.items() if k in ("aot_autograd", "inductor", "stats")}
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
