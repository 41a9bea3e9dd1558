"""Weights on 4 KB pages against the same weights on 2 MB pages (hydraspec.cpu.pages), in one process: the large
GGUF matmuls of a model (more than 5 M weights each) called once each with a one-row input, and a bare C loop
that only reads the same buffers, on two copies of the model, one moved into huge pages; the four alternate
round by round, so a machine whose memory speed drifts hits them alike.

    python scripts/pages_probe.py qwen2.5-coder-1.5b-instruct [--rounds 20]

Needs a C compiler with AVX-512 (the read loop is read_loop.py's).
"""
import argparse
import os

os.environ["HYDRASPEC_HUGEPAGES"] = "0"  # both copies load on 4 KB pages; one is moved below

import torch  # noqa: E402

from hydraspec.cpu import pages  # noqa: E402
from hydraspec.models import load_model  # noqa: E402
from read_loop import ReadLoop, alternate, gguf_weights, print_table  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--rounds", type=int, default=20)
a = ap.parse_args()
torch.set_num_threads(2)
small, _ = load_model(a.model, quant="gguf", progress=False)
huge, _ = load_model(a.model, quant="gguf", progress=False)
os.environ["HYDRASPEC_HUGEPAGES"] = "1"
if not pages.available():
    raise SystemExit("transparent huge pages are off on this machine")
print(f"moved {pages.to_huge_pages(huge) / 1e6:.0f} MB into huge pages")
mods = {"4 KB": gguf_weights(small), "2 MB": gguf_weights(huge)}
xs = {m.in_features: torch.randn(1, m.in_features, dtype=torch.bfloat16) for m in mods["4 KB"]}


def kernels(ms):
    for m in ms:
        m(xs[m.in_features])


runs = {}
for k, ms in mods.items():
    runs[f"GGUF kernels, {k} pages"] = lambda ms=ms: kernels(ms)
    runs[f"C read loop, {k} pages"] = ReadLoop(ms)
nbytes = runs["C read loop, 4 KB pages"].nbytes
med = alternate(runs, a.rounds)
print(f"{a.model}: {len(mods['4 KB'])} large weights, {nbytes / 1e6:.0f} MB, median of {a.rounds} rounds")
print_table(med, nbytes)
