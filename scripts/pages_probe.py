"""Weights on 4 KB pages against the same weights on 2 MB pages (hydraspec.cpu.pages), in one process: the large
GGUF matmuls of a model (more than 5 M weights each) called once each with a one-row input, and a bare C loop
that only reads the same buffers, on two copies of the model, one moved into huge pages; the four alternate
round by round, so a machine whose memory speed drifts hits them alike.

    python scripts/pages_probe.py qwen2.5-coder-1.5b-instruct [--rounds 20]

Needs a C compiler with AVX-512 (the read loop is scripts/stream_probe.py's).
"""
import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

os.environ["HYDRASPEC_HUGEPAGES"] = "0"  # both copies load on 4 KB pages; one is moved below

import torch  # noqa: E402

from hydraspec.cpu import pages  # noqa: E402
from hydraspec.cpu.gguf import GGUFLinear  # noqa: E402
from hydraspec.models import load_model  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--rounds", type=int, default=20)
a = ap.parse_args()
torch.set_num_threads(2)
loop_src = (Path(__file__).parent / "stream_probe.py").read_text().split('C_LOOP = r"""')[1].split('"""')[0]
with tempfile.TemporaryDirectory() as tmp:
    (Path(tmp) / "s.c").write_text(loop_src)
    subprocess.run(["cc", "-O3", "-mavx512f", "-fopenmp", "-shared", "-fPIC", f"{tmp}/s.c", "-o", f"{tmp}/s.so"],
                   check=True)
    lib = ctypes.CDLL(f"{tmp}/s.so")
lib.stream.restype = ctypes.c_int64

small, _ = load_model(a.model, quant="gguf", progress=False)
huge, _ = load_model(a.model, quant="gguf", progress=False)
os.environ["HYDRASPEC_HUGEPAGES"] = "1"
if not pages.available():
    raise SystemExit("transparent huge pages are off on this machine")
print(f"moved {pages.to_huge_pages(huge) / 1e6:.0f} MB into huge pages")


def big(model):
    return [m for n, m in model.named_modules()
            if isinstance(m, GGUFLinear) and not n.endswith("table") and m.out_features * m.in_features > 5e6]


def loop_args(mods):
    bufs = [b for m in mods for b in m._buffers.values() if b is not None]
    return ((ctypes.c_void_p * len(bufs))(*[b.data_ptr() for b in bufs]),
            (ctypes.c_int64 * len(bufs))(*[b.numel() * b.element_size() for b in bufs]), len(bufs))


mods = {"4 KB": big(small), "2 MB": big(huge)}
xs = {m.in_features: torch.randn(1, m.in_features, dtype=torch.bfloat16) for m in mods["4 KB"]}
loops = {k: loop_args(v) for k, v in mods.items()}
nbytes = sum(loops["4 KB"][1])


def kernels(ms):
    for m in ms:
        m(xs[m.in_features])


runs = {}
for k in mods:
    runs[f"GGUF kernels, {k} pages"] = lambda ms=mods[k]: kernels(ms)
    runs[f"C read loop, {k} pages"] = lambda la=loops[k]: lib.stream(*la, 2)
ms = {k: [] for k in runs}
with torch.inference_mode():
    for r in range(a.rounds + 2):
        for k, f in runs.items():
            t = time.perf_counter()
            f()
            if r >= 2:  # two warm-up rounds
                ms[k].append((time.perf_counter() - t) * 1e3)
print(f"{a.model}: {len(mods['4 KB'])} large weights, {nbytes / 1e6:.0f} MB, median of {a.rounds} rounds")
print("| | ms | GB/s |\n|---|---:|---:|")
for k, v in ms.items():
    print(f"| {k} | {statistics.median(v):.1f} | {nbytes / statistics.median(v) / 1e6:.1f} |")
