"""Plain decoding per GGUF type, ours against llama.cpp's on the same file: one model quantized to each type
by llama.cpp's `llama-quantize`, then for each file hydraspec's plain decoding at the file's precision and
`llama-server`'s, interleaved round by round on one prompt (ms per new token after the prompt, best round).

    python benchmarks/gguf_types.py qwen2.5-coder-0.5b-instruct --types Q2_K,Q3_K_M,IQ4_XS,Q4_K_M \
        --dir gguf-types [--rounds 3] [--tokens 128] [--compile]

The source file is re-quantized (`--allow-requantize`) where it is not 16- or 32-bit: the weights are then
not the best that type can hold, which does not change its speed. Prints a markdown table; a type that
hydraspec cannot hold at its precision is listed with the refusal.
"""
import argparse
import json
import subprocess
from pathlib import Path

import torch

from hydraspec.bench.llamacpp import LlamaServer, request_body, server_binary, server_command, tool
from hydraspec.errors import HydraspecError
from hydraspec.generator import SpeculativeGenerator
from hydraspec.models import compile_models, gguf_file, load_model


def quantize(source: Path, kind: str, out: Path) -> Path:
    path = out / f"{source.stem}-{kind}.gguf"
    if not path.exists():
        subprocess.run([str(tool("llama-quantize")), "--allow-requantize", str(source), str(path), kind, "2"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


def llama_ms(server: LlamaServer, ids: list[int], tokens: int) -> float:
    body = {**request_body(ids, tokens, 0.0, None), "ignore_eos": True}
    return server.complete(body)["timings"]["predicted_per_token_ms"]


def ours_ms(gen: SpeculativeGenerator, ids: list[int], tokens: int) -> float:
    s = gen.generate(input_ids=ids, max_new_tokens=tokens).stats
    return (s.wall_s - s.prefill_s) / s.target_forwards * 1e3


def measure(path: Path, a) -> dict:
    row = {"file": path.name, "MB": round(path.stat().st_size / 2**20)}
    try:
        model, tok = load_model(str(path), quant="gguf", progress=False)
    except HydraspecError as e:
        return {**row, "refused": str(e)}
    compile_models(model, how=a.compile)
    gen = SpeculativeGenerator(model, tok)
    ids = gen.encode(a.prompt)
    server = LlamaServer(server_command(server_binary(), str(path), 2, 0, "ar"), Path(a.dir) / "llama-server.log")
    try:
        ours, llama = [], []
        for _ in range(a.rounds):
            ours.append(ours_ms(gen, ids, a.tokens))
            llama.append(llama_ms(server, ids, a.tokens))
    finally:
        server.close()
    return {**row, "ours_ms": min(ours), "llama_ms": min(llama)}


def table(rows: list[dict]) -> str:
    out = ["| type | file MB | hydraspec ms/token | llama.cpp ms/token | hydraspec tokens/s | llama.cpp tokens/s "
           "| ours over llama.cpp |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "refused" in r:
            out.append(f"| {r['type']} | {r['MB']} | refused: {r['refused']} | | | | |")
            continue
        o, l = r["ours_ms"], r["llama_ms"]
        out.append(f"| {r['type']} | {r['MB']} | {o:.1f} | {l:.1f} | {1e3 / o:.1f} | {1e3 / l:.1f} | {l / o:.2f}x |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="a registry name or a .gguf file: the source of every type")
    ap.add_argument("--types", default="Q2_K,Q3_K_M,IQ4_XS,IQ4_NL,Q4_0,Q4_K_M,Q5_K_M,Q6_K,Q8_0")
    ap.add_argument("--dir", default="gguf-types", help="where the quantized files go (kept for a rerun)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--compile", action="store_true", help="compile our decoding steps (as bench and serve do)")
    ap.add_argument("--prompt", default="Write a Python function that sorts a list of integers with merge sort, "
                                        "and explain it.")
    a = ap.parse_args()
    torch.set_num_threads(2)
    out = Path(a.dir)
    out.mkdir(parents=True, exist_ok=True)
    source = gguf_file(a.model)
    rows = []
    for kind in a.types.split(","):
        rows.append({"type": kind, **measure(quantize(source, kind, out), a)})
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
