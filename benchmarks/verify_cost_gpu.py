"""Cost of one verify forward on a GPU: a chain and a token tree of n = 1..128 new tokens after a 512-token prefix.

    python benchmarks/verify_cost_gpu.py --out results.json          # CUDA, bf16, Qwen2.5-Coder 1.5B and 0.5B shapes
    python benchmarks/verify_cost_gpu.py --tiny --out tiny.json      # 2 layers, float32, CPU: a smoke test

Standalone (needs only torch and transformers; hydraspec is not imported). The models are stock
`transformers.Qwen2ForCausalLM` with random weights in the shapes of Qwen2.5-Coder-1.5B and -0.5B,
`attn_implementation="sdpa"`, eager (no CUDA graphs, no torch.compile).

For each model a 512-token prefix is prefilled into a `DynamicCache`. Then for each n, one forward over n new
tokens after the prefix is timed
  (a) as a chain: plain causal, no mask passed (the model builds its own causal mask), positions 512..512+n-1;
  (b) as a tree: a fixed tree of n nodes (best-first top-k expansion, see `tree_parents`), a 4D additive mask
      [1, 1, n, 512 + n] in the model's dtype (0 = attend, finfo.min = blocked) in which each node sees the
      prefix and its own ancestors (itself included), position ids 512 + depth.
The cache is cut back to the prefix after every forward (outside the timed region). The mask is built once per
n, outside the timed region. Chain and tree forwards alternate; median of --reps after --warmup.

Correctness: the tree forward's logits at every node of the largest tree are compared with a plain causal
forward over that node's root-to-node path after the same prefix (max abs diff, argmax agreement), in the
benchmark dtype and again in float32. As a control, the same comparison against the chain forward over the
same tokens (no tree mask) must show a large difference wherever the tree branches.

Optionally (on by default on CUDA) the GPU kernel time of each forward is summed with torch.profiler, which
shows how much of the eager wall time is the GPU working rather than the host launching kernels.
"""
from __future__ import annotations

import argparse
import datetime
import heapq
import json
import platform
import statistics
import time

import torch
import transformers
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
PREFIX = 512

SHAPES = {
    "qwen2.5-coder-1.5b-shape": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                     num_attention_heads=12, num_key_value_heads=2),
    "qwen2.5-coder-0.5b-shape": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                     num_attention_heads=14, num_key_value_heads=2),
}
TINY = {"tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)}

# Probability that a draft's k-th ranked guess is right (the same at every depth): a node's score is the product
# along its path, and the tree of n nodes is the n best-scored nodes (nested: the tree of n is a prefix of n + 1).
RANK_P = (0.6, 0.2, 0.1, 0.05)


def tree_parents(n: int) -> list[int]:
    """Parents (-1 = the root, node 0) of a best-first top-k tree of n nodes; parents come before children."""
    parents: list[int] = []
    heap = [(-1.0, 0, -1)]  # (-score, tie-break, parent)
    counter = 1
    while len(parents) < n:
        neg, _, parent = heapq.heappop(heap)
        node = len(parents)
        parents.append(parent)
        for p in RANK_P:
            heapq.heappush(heap, (neg * p, counter, node))
            counter += 1
    return parents


def depths_of(parents: list[int]) -> list[int]:
    d: list[int] = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def path_to(parents: list[int], i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def tree_mask(parents: list[int], prefix: int, dtype, device) -> torch.Tensor:
    n = len(parents)
    allowed = torch.zeros(n, prefix + n, dtype=torch.bool)
    allowed[:, :prefix] = True
    for i in range(n):
        for j in path_to(parents, i):
            allowed[i, prefix + j] = True
    mask = torch.zeros(n, prefix + n, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def cut(cache, length: int) -> None:
    """Cut the cache back to `length` tokens. A negative argument to crop() removes that many tokens in every
    transformers 5.x (a positive one meant "keep this many" until 5.17 and raises from 5.18)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
    assert cache.get_seq_length() == length


def build(shape: dict, vocab: int, dtype, device, seed: int):
    cfg = Qwen2Config(vocab_size=vocab, max_position_embeddings=32768, tie_word_embeddings=True, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}, use_sliding_window=False,
                      attn_implementation="sdpa", **shape)
    assert cfg.rope_parameters["rope_theta"] == 1e6, cfg.rope_parameters
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    model = model.to(dtype).eval()
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model


class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3


def kernel_ms(fn, k: int) -> float | None:
    """Mean GPU kernel time (ms) of fn over k calls, from torch.profiler; None if the profiler fails."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(k):
                fn()
            torch.cuda.synchronize()
        total = 0.0
        for e in prof.key_averages():
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
                total += getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        return total / k / 1e3 if total > 0 else None
    except Exception as exc:  # noqa: BLE001 - optional measurement
        print(f"  (kernel time not measured: {type(exc).__name__}: {exc})")
        return None


@torch.inference_mode()
def check_tree(model, prefix_ids: torch.Tensor, parents: list[int], vocab: int, device) -> dict:
    """Tree logits at each node against a causal forward over its root-to-node path; control: against the chain."""
    n = len(parents)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(100, vocab, (1, n), generator=g).to(device)
    depth = torch.tensor(depths_of(parents), device=device)
    cache = DynamicCache(config=model.config)
    model(prefix_ids, past_key_values=cache, use_cache=True)
    mask = tree_mask(parents, PREFIX, model.dtype, device)
    tree = model(ids, position_ids=(PREFIX + depth)[None], attention_mask=mask, past_key_values=cache,
                 use_cache=True).logits[0].float()
    cut(cache, PREFIX)
    chain = model(ids, past_key_values=cache, use_cache=True).logits[0].float()
    cut(cache, PREFIX)
    ref = torch.empty_like(tree)
    for i in range(n):
        path = path_to(parents, i)
        out = model(ids[:, path], past_key_values=cache, use_cache=True).logits[0, -1].float()
        cut(cache, PREFIX)
        ref[i] = out
    diff = (tree - ref).abs().amax(dim=-1)
    ctrl = (chain - ref).abs().amax(dim=-1)
    on_chain = torch.tensor([parents[i] == i - 1 for i in range(n)], device=device)
    # a node whose path is not the nodes 0..i in order sees other tokens in the chain forward
    off = torch.tensor([path_to(parents, i) != list(range(i + 1)) for i in range(n)], device=device)
    return {
        "n": n,
        "dtype": str(model.dtype).replace("torch.", ""),
        "max_abs_diff": diff.max().item(),
        "max_abs_logit": ref.abs().max().item(),
        "argmax_agree": (tree.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "control_chain_max_abs_diff_off_path_nodes": ctrl[off].max().item() if off.any() else None,
        "control_chain_min_of_max_abs_diff_off_path_nodes": ctrl[off].min().item() if off.any() else None,
        "off_path_nodes": int(off.sum().item()),
        "chain_prefix_nodes": int((~off).sum().item()),
        "on_chain_parent_nodes": int(on_chain.sum().item()),
    }


@torch.inference_mode()
def bench_model(name, model, sizes, reps, warmup, device, vocab, profile_k):
    timer = Timer(device)
    g = torch.Generator().manual_seed(0)
    prefix_ids = torch.randint(100, vocab, (1, PREFIX), generator=g).to(device)
    cache = DynamicCache(config=model.config)
    prefill_ms = timer(lambda: model(prefix_ids, past_key_values=cache, use_cache=True))
    assert cache.get_seq_length() == PREFIX
    rows = []
    for n in sizes:
        ids = torch.randint(100, vocab, (1, n), generator=g).to(device)
        chain_pos = (PREFIX + torch.arange(n, device=device))[None]
        parents = tree_parents(n)
        depth = depths_of(parents)
        tree_pos = (PREFIX + torch.tensor(depth, device=device))[None]
        mask = tree_mask(parents, PREFIX, model.dtype, device)

        def chain():
            model(ids, position_ids=chain_pos, past_key_values=cache, use_cache=True)

        def tree():
            model(ids, position_ids=tree_pos, attention_mask=mask, past_key_values=cache, use_cache=True)

        times = {"chain": [], "tree": []}
        for r in range(warmup + reps):
            for kind, fn in (("chain", chain), ("tree", tree)):
                ms = timer(fn)
                cut(cache, PREFIX)
                if r >= warmup:
                    times[kind].append(ms)
        row = {"n": n, "tree_depth": max(depth) + 1, "tree_leaves": n - len(set(p for p in parents if p >= 0)),
               "chain_ms": statistics.median(times["chain"]), "tree_ms": statistics.median(times["tree"]),
               "chain_ms_min": min(times["chain"]), "tree_ms_min": min(times["tree"]),
               "chain_ms_all": times["chain"], "tree_ms_all": times["tree"]}
        if profile_k:
            def run_cut(fn):
                def f():
                    fn()
                    cut(cache, PREFIX)
                return f
            row["chain_kernel_ms"] = kernel_ms(run_cut(chain), profile_k)
            row["tree_kernel_ms"] = kernel_ms(run_cut(tree), profile_k)
        rows.append(row)
        k = f"  kernels {row['chain_kernel_ms']:.2f} / {row['tree_kernel_ms']:.2f}" if profile_k and \
            row.get("chain_kernel_ms") is not None and row.get("tree_kernel_ms") is not None else ""
        print(f"  {name} n={n:4d}: chain {row['chain_ms']:8.2f} ms  tree {row['tree_ms']:8.2f} ms  "
              f"(depth {row['tree_depth']}){k}", flush=True)
    base = rows[0]["chain_ms"] if rows[0]["n"] == 1 else None
    for row in rows:
        row["chain_ratio"] = row["chain_ms"] / base if base else None
        row["tree_ratio"] = row["tree_ms"] / base if base else None
    del cache
    checks = [check_tree(model, prefix_ids, tree_parents(max(sizes)), vocab, device)]
    print(f"  {name} check ({checks[0]['dtype']}): {json.dumps(checks[0])}", flush=True)
    return {"prefill_512_ms": prefill_ms, "rows": rows, "checks": checks, "prefix_ids": prefix_ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="2-layer float32 model on the CPU (a smoke test)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--reps", type=int, default=None, help="timed repeats per size (default 20; 3 with --tiny)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--models", default=None, help="comma-separated subset of: " + ", ".join(SHAPES))
    ap.add_argument("--profile", type=int, default=None,
                    help="forwards per size summed by torch.profiler for the GPU kernel time (0 = off; default 5 on CUDA)")
    ap.add_argument("--no-fp32-check", action="store_true")
    a = ap.parse_args()

    sizes = [int(x) for x in a.sizes.split(",")]
    if a.tiny:
        device, dtype, vocab, shapes = torch.device("cpu"), torch.float32, 1000, TINY
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device (use --tiny for a CPU smoke test)")
        device, dtype, vocab, shapes = torch.device("cuda"), torch.bfloat16, 151936, SHAPES
        if a.models:
            shapes = {k: SHAPES[k] for k in a.models.split(",")}
    reps = a.reps if a.reps is not None else (3 if a.tiny else 20)
    profile_k = a.profile if a.profile is not None else (5 if device.type == "cuda" else 0)

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
           "cuda": torch.version.cuda, "dtype": str(dtype).replace("torch.", ""),
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "prefix": PREFIX, "reps": reps, "warmup": a.warmup, "timing": "median",
           "attn_implementation": "sdpa", "cuda_graphs": False, "rank_p": RANK_P}
    print(json.dumps(env), flush=True)
    result = {"env": env, "models": {}}
    for name, shape in shapes.items():
        t = time.perf_counter()
        model = build(shape, vocab, dtype, device, seed=0)
        params = sum(p.numel() for p in model.parameters())
        print(f"{name}: {params / 1e6:.1f} M parameters, built in {time.perf_counter() - t:.1f} s", flush=True)
        r = bench_model(name, model, sizes, reps, a.warmup, device, vocab, profile_k)
        prefix_ids = r.pop("prefix_ids")
        if not a.no_fp32_check and dtype != torch.float32:
            model = model.float()
            r["checks"].append(check_tree(model, prefix_ids, tree_parents(max(sizes)), vocab, device))
            print(f"  {name} check (float32): {json.dumps(r['checks'][-1])}", flush=True)
        r["shape"] = dict(shape, vocab_size=vocab, tie_word_embeddings=True, rope_theta=1e6)
        r["parameters"] = params
        r["tree_parents_at_max_n"] = tree_parents(max(sizes))
        result["models"][name] = r
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print()
    for name, r in result["models"].items():
        print(f"{name} ({env['device']}, {env['dtype']}, prefix {PREFIX}, median of {reps}; ratio = ms / chain n=1)")
        kern = profile_k and any(row.get("chain_kernel_ms") is not None for row in r["rows"])
        head = "|    n | depth | chain ms | tree ms | chain ratio | tree ratio |"
        if kern:
            head += " chain GPU-kernel ms | tree GPU-kernel ms |"
        print(head)
        print("|" + "|".join("---:" for _ in range(head.count("|") - 1)) + "|")
        for row in r["rows"]:
            line = (f"| {row['n']:4d} | {row['tree_depth']:5d} | {row['chain_ms']:8.2f} | {row['tree_ms']:7.2f} | "
                    f"{row['chain_ratio']:11.2f} | {row['tree_ratio']:10.2f} |")
            if kern:
                ck, tk = row.get("chain_kernel_ms"), row.get("tree_kernel_ms")
                line += f" {ck if ck is None else format(ck, '.2f')} | {tk if tk is None else format(tk, '.2f')} |"
            print(line)
        for c in r["checks"]:
            print(f"check {c['dtype']}, tree of {c['n']}: max |tree - path| = {c['max_abs_diff']:.3g} "
                  f"(max |logit| {c['max_abs_logit']:.3g}), argmax agree {c['argmax_agree']:.3f}; control "
                  f"max |chain - path| on the {c['off_path_nodes']} off-chain nodes = "
                  f"{c['control_chain_max_abs_diff_off_path_nodes']}")
        print()


if __name__ == "__main__":
    main()
