"""Are the GGUF matmuls at the memory's speed? The large weights of a model at the file's precision (more
than 5 M weights each: gate/up, down, the output layer) called once each with a one-row input, against a
plain C loop that only reads the same buffers (64-byte loads, 2 OpenMP threads, each buffer split in two
halves as the kernel splits its weight blocks), alternating round by round in one process.

    python scripts/stream_probe.py qwen2.5-coder-1.5b-instruct [--rounds 15]

Needs a C compiler with AVX-512 (the loop is read_loop.py's, compiled into a temporary directory).
"""
import argparse

import torch

from hydraspec.models import load_model
from read_loop import ReadLoop, alternate, gguf_weights, print_table

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--rounds", type=int, default=15)
a = ap.parse_args()
torch.set_num_threads(2)
model, _ = load_model(a.model, quant="gguf", progress=False)
big = gguf_weights(model)
xs = {m.in_features: torch.randn(1, m.in_features, dtype=torch.bfloat16) for m in big}
loop = ReadLoop(big)


def kernels():
    for m in big:
        m(xs[m.in_features])


med = alternate({"GGUF kernels": kernels, "C read loop": loop}, a.rounds)
print(f"{a.model}: {len(big)} large weights, {loop.nbytes / 1e6:.0f} MB")
print_table(med, loop.nbytes)
print(f"kernels / read loop: {med['GGUF kernels'] / med['C read loop']:.3f}")
