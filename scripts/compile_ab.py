"""Plain decoding per token: eager steps, compiled steps (--compile) and llama.cpp's llama-server on the same
GGUF file and token ids, alternating in one process (the machine's speed drifts between minutes).

    python scripts/compile_ab.py qwen2.5-coder-1.5b-instruct --rounds 5
"""
import argparse
import json
import statistics
import subprocess
import time
import urllib.request

import torch

from hydraspec.bench.llamacpp import server_binary
from hydraspec.generator import SpeculativeGenerator
from hydraspec.models import gguf_file, load_model

PROMPTS = {"lua": "give me a line in lua that returns true if a string starts with 'data:'",
           "sort": "Write a Python function that sorts a list of integers with merge sort, and explain it."}


def start_server(model: str, port: int) -> subprocess.Popen:
    """llama-server on the model's GGUF file: 2 threads, one slot (scripts/build_llamacpp.sh builds it)."""
    return subprocess.Popen([str(server_binary()), "-m", str(gguf_file(model)), "-t", "2", "-tb", "2", "-c", "4096",
                             "-np", "1", "--port", str(port), "--no-warmup"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def llama_ms(port: int, ids: list[int], tokens: int) -> float:
    """llama-server's decode time per token for ``tokens`` new tokens after the prompt ``ids`` (prompt cache off)."""
    body = json.dumps({"prompt": ids, "n_predict": tokens, "temperature": 0, "cache_prompt": False,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req).read())["timings"]["predicted_per_token_ms"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--port", type=int, default=8937)
    args = ap.parse_args()
    torch.set_num_threads(2)
    srv = start_server(args.model, args.port)
    eager, tok = load_model(args.model, quant="gguf", progress=False)
    compiled, _ = load_model(args.model, quant="gguf", progress=False, compile=True)
    gens = {"eager": SpeculativeGenerator(eager, tok), "compiled": SpeculativeGenerator(compiled, tok)}
    ids = {k: gens["eager"].encode(p) for k, p in PROMPTS.items()}
    t0 = time.perf_counter()
    gens["compiled"].generate(input_ids=ids["lua"], max_new_tokens=4)
    print(f"compile: {time.perf_counter() - t0:.1f} s")

    def ours(name):
        def run(x):
            s = gens[name].generate(input_ids=x, max_new_tokens=args.tokens)
            return (s.stats.wall_s - s.stats.prefill_s) / s.stats.target_forwards * 1e3
        return run

    def llama(x):
        return llama_ms(args.port, x, args.tokens)

    time.sleep(5)
    sides = [("eager", ours("eager")), ("compiled", ours("compiled")), ("llama.cpp", llama)]
    ms = {}
    try:
        for r in range(args.rounds):
            for k, x in ids.items():
                row = {}
                for name, f in (sides if r % 2 == 0 else sides[::-1]):
                    row[name] = f(x)
                    ms.setdefault((name, k), []).append(row[name])
                print(r, k, {n: round(v, 1) for n, v in row.items()}, flush=True)
    finally:
        srv.terminate()
    for (name, k), v in ms.items():
        print(f"{name:10s} {k:5s} median ms/token {statistics.median(v[1:] or v):.2f}")


if __name__ == "__main__":
    main()
