"""Plain decoding's ms per token and the weight bytes per second it reads, ours against llama.cpp's on the
same GGUF file, interleaved round by round in one run (a machine whose memory speed drifts hits both alike).

For a GGUF model at the file's precision, on one prompt:
* ours: ms per token of hydraspec's plain decoding (the engine's `ar`, 128 new tokens);
* llama.cpp: ms per token of `llama-server` on the same file and prompt ids (its own decode timing).
Prints the weight bytes of one token (every GGUF matmul's buffers), ms per token and GB/s over them.

    python benchmarks/roofline.py qwen2.5-coder-1.5b-instruct [--rounds 4] [--tokens 128]
"""
import argparse
import json
import statistics
import subprocess
import time
import urllib.request

import torch

from hydraspec.bench.llamacpp import server_binary
from hydraspec.cpu.gguf import GGUFLinear
from hydraspec.generator import SpeculativeGenerator
from hydraspec.models import gguf_file, load_model

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--rounds", type=int, default=4)
ap.add_argument("--tokens", type=int, default=128)
ap.add_argument("--port", type=int, default=8931)
ap.add_argument("--prompt", default="Write a Python function that sorts a list of integers with merge sort, and explain it.")
a = ap.parse_args()
torch.set_num_threads(2)
path = str(gguf_file(a.model))
server = subprocess.Popen([str(server_binary()), "-m", path, "-t", "2", "-tb", "2", "-c", "4096", "-np", "1",
                           "--port", str(a.port), "--no-warmup"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    model, tok = load_model(a.model, quant="gguf", progress=False)
    gen = SpeculativeGenerator(model, tok)
    ids = gen.encode(a.prompt)
    # the weights one token reads: every GGUF matmul's buffers (the token table is read one row at a time)
    nbytes = sum(b.numel() * b.element_size() for n, m in model.named_modules()
                 if isinstance(m, GGUFLinear) and not n.endswith("table") for b in m._buffers.values() if b is not None)
    def ours() -> float:
        s = gen.generate(input_ids=ids, max_new_tokens=a.tokens)
        return (s.stats.wall_s - s.stats.prefill_s) / s.stats.target_forwards * 1e3

    url = f"http://127.0.0.1:{a.port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            time.sleep(1)

    def llama() -> float:
        body = json.dumps({"prompt": ids, "n_predict": a.tokens, "temperature": 0, "cache_prompt": False,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req).read())["timings"]["predicted_per_token_ms"]

    runs = {"hydraspec ar": ours, "llama.cpp": llama}
    for f in runs.values():  # warm-up
        f()
    ms = {k: [] for k in runs}
    with torch.inference_mode():
        for _ in range(a.rounds):
            for k, f in runs.items():
                ms[k].append(f())
finally:
    server.terminate()
print(f"{a.model}: {nbytes / 1e6:.0f} MB of GGUF weights per token (ours; llama.cpp reads the file's blocks)")
print("| | ms per token (median) | GB/s over these bytes |\n|---|---:|---:|")
for k, v in ms.items():
    m = statistics.median(v)
    print(f"| {k} | {m:.2f} | {nbytes / m / 1e6:.1f} |")
print("rounds:", {k: [round(x, 1) for x in v] for k, v in ms.items()})
