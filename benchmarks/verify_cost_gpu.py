"""Cost of one verify forward on a GPU: a chain and a token tree of n = 1..128 new tokens after a 512-token prefix.

    python benchmarks/verify_cost_gpu.py --out results.json          # CUDA, bf16, Qwen2.5-Coder 1.5B and 0.5B shapes
    python benchmarks/verify_cost_gpu.py --tiny --out tiny.json      # 2 layers, float32, CPU: a smoke test
    python benchmarks/verify_cost_gpu.py --no-graphs --sizes 1,8,64 --out r.json   # eager only, three sizes

Standalone (needs only torch and transformers; hydraspec is not imported). The models are stock
`transformers.Qwen2ForCausalLM` with random weights in the shapes of Qwen2.5-Coder-1.5B and -0.5B,
`attn_implementation="sdpa"`; the chain_ms / tree_ms figures are eager (no CUDA graphs, no torch.compile).

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

--graphs (on by default on CUDA; --no-graphs turns it off; skipped with a printed line on the CPU) also times each
forward replayed as a CUDA graph, which removes the host's launch time: the prefix is prefilled (eager) into a
`StaticCache` of PREFIX + max(--sizes) slots; for each n the chain and the tree each get static inputs (ids,
position ids, and a 4D additive mask [1, 1, n, PREFIX + max n]: the chain's is causal, the tree's the tree mask
above) and one `torch.cuda.CUDAGraph` captured after 3 warm-ups on a side stream; every replay writes cache slots
PREFIX..PREFIX+n-1 again (the cache's write pointer is rewound outside the timed region). Timed like the eager
forwards (CUDA events around `replay()`, median of --graph-reps after --warmup): chain_graph_ms, tree_graph_ms.
A failed capture is recorded in the row (chain_graph_error / tree_graph_error) and the run goes on. Check, at the
largest n: the replayed tree's logits against an eager tree forward on the same static cache, and that eager
static-cache forward against the DynamicCache tree forward (max abs diff, argmax agreement). On the CPU (--tiny)
only the second comparison runs, which exercises the static-cache path without a graph.
"""
from __future__ import annotations

import argparse
import datetime
import heapq
import inspect
import json
import platform
import statistics
import time

import torch
import transformers
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM, StaticCache

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


def tree_mask(parents: list[int], prefix: int, dtype, device, kv_len: int | None = None) -> torch.Tensor:
    """[1, 1, n, kv_len] additive mask (kv_len defaults to prefix + n; columns past prefix + n are blocked)."""
    n = len(parents)
    kv_len = prefix + n if kv_len is None else kv_len
    assert kv_len >= prefix + n, (kv_len, prefix, n)
    allowed = torch.zeros(n, kv_len, dtype=torch.bool)
    allowed[:, :prefix] = True
    if parents == list(range(-1, n - 1)):  # a chain: plain causal (a fast path for the 512-token prefill's mask)
        allowed[:, prefix:prefix + n] = torch.ones(n, n, dtype=torch.bool).tril()
    else:
        for i in range(n):
            for j in path_to(parents, i):
                allowed[i, prefix + j] = True
    mask = torch.zeros(n, kv_len, dtype=dtype)
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


def chain_parents(n: int) -> list[int]:
    """Parents of a chain of n nodes: `tree_mask` of these is the plain causal mask."""
    return list(range(-1, n - 1))


def takes_cache_position(model) -> bool:
    """Older transformers write a StaticCache at the `cache_position` passed in; 5.17 and 5.24 take no such argument."""
    try:
        return "cache_position" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def rewind_static(cache, length: int) -> None:
    """Set a StaticCache's write pointer back to `length`. In transformers 5.17 and 5.24 a StaticLayer writes at
    `cumulative_length` (a device tensor) and advances it in place inside `update`, so a captured graph advances
    it on every replay too: it must be rewound before every forward or replay (else the writes run past the end).
    Versions that write at the `cache_position` passed in keep no such pointer: nothing to do."""
    for layer in getattr(cache, "layers", []):
        cl = getattr(layer, "cumulative_length", None)
        if isinstance(cl, torch.Tensor):
            cl.fill_(length)
        elif isinstance(cl, int):
            layer.cumulative_length = length


def static_inputs(model, parents: list[int], start: int, kv_len: int, device, cache_position: bool) -> dict:
    """position_ids (start + depth), a [1, 1, n, kv_len] additive mask (tokens before `start` and the node's own
    ancestors, itself included) and, if the model takes it, cache_position start..start+n-1."""
    kw = {"position_ids": (start + torch.tensor(depths_of(parents), device=device))[None],
          "attention_mask": tree_mask(parents, start, model.dtype, device, kv_len=kv_len)}
    if cache_position:
        kw["cache_position"] = start + torch.arange(len(parents), device=device)
    return kw


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    return {"max_abs_diff": (a - b).abs().max().item(),
            "argmax_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}


def capture_graph(forward, run, before):
    """``forward()`` three times on a side stream (as CUDA graph capture needs), ``before()``, then ``run()``
    captured as one graph; returns (graph, what run returned: its static output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(s)
    before()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


def time_replays(graph, rewind, timer, warmup: int, reps: int) -> list[float]:
    """ms of each of ``reps`` replays after ``warmup``, ``rewind()`` (outside the timed region) before each."""
    times = []
    for r in range(warmup + reps):
        rewind()
        ms = timer(graph.replay)
        if r >= warmup:
            times.append(ms)
    return times


@torch.inference_mode()
def bench_graphs(name, model, prefix_ids, rows, ids_by_n, reps, warmup, device, use_graphs: bool) -> dict:
    """Adds chain_graph_ms / tree_graph_ms (or chain_graph_error / tree_graph_error) to each row, timing
    `CUDAGraph.replay()` of the forward over a StaticCache (see the module docstring). Returns the check at the
    largest n. With use_graphs False (the CPU) only the eager static-cache vs DynamicCache comparison runs."""
    timer = Timer(device)
    max_n = max(row["n"] for row in rows)
    kv_len = PREFIX + max_n
    with_cp = takes_cache_position(model)
    check: dict = {"n": max_n, "dtype": str(model.dtype).replace("torch.", ""), "cache_position_passed": with_cp}
    try:
        cache = StaticCache(config=model.config, max_cache_len=kv_len)
        model(prefix_ids, past_key_values=cache, use_cache=True,
              **static_inputs(model, chain_parents(PREFIX), 0, kv_len, device, with_cp))
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        check["error"] = f"StaticCache prefill failed: {type(exc).__name__}: {exc}"[:1000]
        for row in rows:
            for kind in ("chain", "tree") if use_graphs else ():
                row[f"{kind}_graph_error"] = check["error"]
        print(f"  {name}: {check['error']}", flush=True)
        return check
    broken = None  # set when the device may be unusable after a failure: later captures are not tried
    for row in rows:
        n = row["n"]
        variants = {"chain": chain_parents(n), "tree": tree_parents(n)}
        static = {kind: dict(input_ids=ids_by_n[n].clone(),
                             **static_inputs(model, parents, PREFIX, kv_len, device, with_cp))
                  for kind, parents in variants.items()}

        def forward(kind):
            rewind_static(cache, PREFIX)
            return model(**static[kind], past_key_values=cache, use_cache=True)

        graphs, logits = {}, {}
        for kind in variants if use_graphs else ():
            if broken:
                row[f"{kind}_graph_error"] = f"not tried: {broken}"
                continue
            try:
                g, out = capture_graph(lambda: forward(kind),
                                       lambda: model(**static[kind], past_key_values=cache, use_cache=True),
                                       lambda: rewind_static(cache, PREFIX))
                graphs[kind], logits[kind] = g, out.logits
                del out
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                row[f"{kind}_graph_error"] = f"{type(exc).__name__}: {exc}"[:1000]
                print(f"  {name} n={n}: {kind} graph capture failed: {row[f'{kind}_graph_error']}", flush=True)
                try:
                    torch.cuda.synchronize()
                    rewind_static(cache, PREFIX)
                except Exception as exc2:  # noqa: BLE001
                    broken = f"device error after a failed capture: {type(exc2).__name__}: {exc2}"[:1000]
        if graphs:
            times: dict = {kind: [] for kind in graphs}
            try:
                for _ in range(warmup + reps):  # the kinds alternate, one replay each per round
                    for kind, g in graphs.items():
                        times[kind] += time_replays(g, lambda: rewind_static(cache, PREFIX), timer, 0, 1)
                for kind in times:
                    times[kind] = times[kind][warmup:]
                for kind, t in times.items():
                    row[f"{kind}_graph_ms"] = statistics.median(t)
                    row[f"{kind}_graph_ms_min"] = min(t)
                    row[f"{kind}_graph_ms_all"] = t
            except Exception as exc:  # noqa: BLE001
                broken = f"replay failed at n={n}: {type(exc).__name__}: {exc}"[:1000]
                for kind in graphs:
                    row[f"{kind}_graph_error"] = broken
                print(f"  {name}: {broken}", flush=True)
        if n == max_n and not broken:
            try:
                eager = forward("tree").logits[0].float().clone()
                if "tree" in graphs:
                    rewind_static(cache, PREFIX)
                    graphs["tree"].replay()
                    replay = logits["tree"][0].float().clone()
                    check["graph_vs_eager_static"] = _compare(replay, eager)
                dyn = DynamicCache(config=model.config)
                model(prefix_ids, past_key_values=dyn, use_cache=True)
                ref = model(ids_by_n[n], position_ids=static["tree"]["position_ids"],
                            attention_mask=tree_mask(variants["tree"], PREFIX, model.dtype, device),
                            past_key_values=dyn, use_cache=True).logits[0].float()
                check["eager_static_vs_dynamic"] = _compare(eager, ref)
                check["max_abs_logit"] = ref.abs().max().item()
                del dyn
            except Exception as exc:  # noqa: BLE001
                check["error"] = f"{type(exc).__name__}: {exc}"[:1000]
        if use_graphs:
            parts = []
            for kind in variants:
                ms = row.get(f"{kind}_graph_ms")
                parts.append(f"{kind} {ms:8.3f} ms" if ms is not None else f"{kind} failed")
            print(f"  {name} n={n:4d}: graphs: " + "  ".join(parts), flush=True)
        g = None
        del graphs, logits
    base = rows[0].get("chain_graph_ms") if rows[0]["n"] == 1 else None
    for row in rows:
        for kind in ("chain", "tree"):
            ms = row.get(f"{kind}_graph_ms")
            row[f"{kind}_graph_ratio"] = ms / base if base and ms is not None else None
    del cache
    print(f"  {name} static-cache check: {json.dumps(check)}", flush=True)
    return check


@torch.inference_mode()
def bench_model(name, model, sizes, reps, warmup, device, vocab, profile_k, graphs, graph_reps):
    timer = Timer(device)
    g = torch.Generator().manual_seed(0)
    prefix_ids = torch.randint(100, vocab, (1, PREFIX), generator=g).to(device)
    cache = DynamicCache(config=model.config)
    prefill_ms = timer(lambda: model(prefix_ids, past_key_values=cache, use_cache=True))
    assert cache.get_seq_length() == PREFIX
    rows = []
    ids_by_n = {}
    for n in sizes:
        ids = torch.randint(100, vocab, (1, n), generator=g).to(device)
        ids_by_n[n] = ids
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
    graph_check = bench_graphs(name, model, prefix_ids, rows, ids_by_n, graph_reps, warmup, device, graphs)
    checks = [check_tree(model, prefix_ids, tree_parents(max(sizes)), vocab, device)]
    print(f"  {name} check ({checks[0]['dtype']}): {json.dumps(checks[0])}", flush=True)
    return {"prefill_512_ms": prefill_ms, "rows": rows, "checks": checks, "graph_check": graph_check,
            "prefix_ids": prefix_ids}


@torch.inference_mode()
def bench_batched(name, model, sizes, batches, reps, warmup, device, vocab) -> list[dict]:
    """Verify forwards of B rows at once, each row a tree of n nodes after its own 512-token prefix (B * n new
    tokens), eager and replayed as a CUDA graph over a StaticCache of B rows (see the module docstring);
    rows {"batch", "n", "tokens", "tree_ms", "tree_graph_ms"}, ms of the whole forward (divide by B for a row)."""
    timer, out = Timer(device), []
    g = torch.Generator().manual_seed(7)
    kv_len = PREFIX + max(sizes)
    with_cp = takes_cache_position(model)
    for B in batches:
        prefix_ids = torch.randint(100, vocab, (B, PREFIX), generator=g).to(device)
        cache = StaticCache(config=model.config, max_cache_len=kv_len)
        pre = static_inputs(model, chain_parents(PREFIX), 0, kv_len, device, with_cp)
        pre["position_ids"] = pre["position_ids"].expand(B, -1)
        pre["attention_mask"] = pre["attention_mask"].expand(B, -1, -1, -1)
        model(prefix_ids, past_key_values=cache, use_cache=True, **pre)
        for n in sizes:
            kw = static_inputs(model, tree_parents(n), PREFIX, kv_len, device, with_cp)
            kw["position_ids"] = kw["position_ids"].expand(B, -1).contiguous()
            kw["attention_mask"] = kw["attention_mask"].expand(B, -1, -1, -1).contiguous()
            kw["input_ids"] = torch.randint(100, vocab, (B, n), generator=g).to(device)

            def forward():
                rewind_static(cache, PREFIX)
                return model(**kw, past_key_values=cache, use_cache=True)
            row = {"batch": B, "n": n, "tokens": B * n}
            eager = []
            for r in range(warmup + reps):
                ms = timer(forward)
                if r >= warmup:
                    eager.append(ms)
            row["tree_ms"] = statistics.median(eager)
            try:
                if device.type != "cuda":
                    raise RuntimeError("no CUDA device")
                graph, _ = capture_graph(forward, lambda: model(**kw, past_key_values=cache, use_cache=True),
                                         lambda: rewind_static(cache, PREFIX))
                row["tree_graph_ms"] = statistics.median(
                    time_replays(graph, lambda: rewind_static(cache, PREFIX), timer, warmup, reps))
                del graph
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                row["tree_graph_error"] = f"{type(exc).__name__}: {exc}"[:1000]
            out.append(row)
            gm = row.get("tree_graph_ms")
            print(f"  {name} batch {B:3d} n={n:4d}: tree {row['tree_ms']:8.2f} ms  graph "
                  f"{'failed' if gm is None else format(gm, '8.3f')} ms", flush=True)
        del cache
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="2-layer float32 model on the CPU (a smoke test)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated n (default: all of SIZES)")
    ap.add_argument("--reps", type=int, default=None, help="timed repeats per size (default 20; 3 with --tiny)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--models", default=None, help="comma-separated subset of: " + ", ".join(SHAPES))
    ap.add_argument("--profile", type=int, default=None,
                    help="forwards per size summed by torch.profiler for the GPU kernel time (0 = off; default 5 on CUDA)")
    ap.add_argument("--no-fp32-check", action="store_true")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="also time each forward replayed as a CUDA graph (default: on with CUDA; skipped on the CPU)")
    ap.add_argument("--graph-reps", type=int, default=None, help="timed replays per size and variant (default --reps)")
    ap.add_argument("--batches", default="", help="comma-separated batch sizes B: also time B rows' trees in one forward "
                    "(graphs on CUDA only; e.g. 1,4,8,16)")
    ap.add_argument("--only-batches", action="store_true", help="with --batches: skip the one-row tables and checks")
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
    graphs = (a.graphs if a.graphs is not None else True) and device.type == "cuda"
    if device.type != "cuda":
        print("CUDA graphs: skipped (no CUDA device); only the eager static-cache check runs", flush=True)
    graph_reps = a.graph_reps if a.graph_reps is not None else reps

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
           "cuda": torch.version.cuda, "dtype": str(dtype).replace("torch.", ""),
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "prefix": PREFIX, "reps": reps, "warmup": a.warmup, "timing": "median",
           "attn_implementation": "sdpa", "cuda_graphs": graphs, "graph_reps": graph_reps if graphs else None,
           "rank_p": RANK_P}
    print(json.dumps(env), flush=True)
    result = {"env": env, "models": {}}
    for name, shape in shapes.items():
        t = time.perf_counter()
        model = build(shape, vocab, dtype, device, seed=0)
        params = sum(p.numel() for p in model.parameters())
        print(f"{name}: {params / 1e6:.1f} M parameters, built in {time.perf_counter() - t:.1f} s", flush=True)
        batches = [int(x) for x in a.batches.split(",") if x]
        if a.only_batches and batches:
            result["models"][name] = {"batched": bench_batched(name, model, sizes, batches, reps, a.warmup, device, vocab)}
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)
            continue
        r = bench_model(name, model, sizes, reps, a.warmup, device, vocab, profile_k, graphs, graph_reps)
        prefix_ids = r.pop("prefix_ids")
        if batches:
            r["batched"] = bench_batched(name, model, sizes, batches, reps, a.warmup, device, vocab)
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
        with open(a.out, "w") as f:  # after every model, so a later failure keeps what was measured
            json.dump(result, f, indent=1)

    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print()
    for name, r in result["models"].items():
        if "rows" not in r:
            continue
        graph_note = f", graphs median of {graph_reps}" if graphs else ""
        print(f"{name} ({env['device']}, {env['dtype']}, prefix {PREFIX}, median of {reps}{graph_note}; "
              f"ratio = ms / chain n=1)")
        kern = profile_k and any(row.get("chain_kernel_ms") is not None for row in r["rows"])
        head = "|    n | depth | chain ms | tree ms | chain ratio | tree ratio |"
        if kern:
            head += " chain GPU-kernel ms | tree GPU-kernel ms |"
        if graphs:
            head += " chain graph ms | tree graph ms |"
        print(head)
        print("|" + "|".join("---:" for _ in range(head.count("|") - 1)) + "|")
        for row in r["rows"]:
            cr, tr = row["chain_ratio"], row["tree_ratio"]  # None when --sizes does not start at 1
            line = (f"| {row['n']:4d} | {row['tree_depth']:5d} | {row['chain_ms']:8.2f} | {row['tree_ms']:7.2f} | "
                    f"{'-' if cr is None else format(cr, '.2f'):>11} | {'-' if tr is None else format(tr, '.2f'):>10} |")
            if kern:
                ck, tk = row.get("chain_kernel_ms"), row.get("tree_kernel_ms")
                line += f" {ck if ck is None else format(ck, '.2f')} | {tk if tk is None else format(tk, '.2f')} |"
            if graphs:
                for kind in ("chain", "tree"):
                    ms = row.get(f"{kind}_graph_ms")
                    line += f" {ms:.3f} |" if ms is not None else " failed |"
            print(line)
        for c in r["checks"]:
            print(f"check {c['dtype']}, tree of {c['n']}: max |tree - path| = {c['max_abs_diff']:.3g} "
                  f"(max |logit| {c['max_abs_logit']:.3g}), argmax agree {c['argmax_agree']:.3f}; control "
                  f"max |chain - path| on the {c['off_path_nodes']} off-chain nodes = "
                  f"{c['control_chain_max_abs_diff_off_path_nodes']}")
        gc = r.get("graph_check") or {}
        for key, what in (("graph_vs_eager_static", "graph replay vs eager, same StaticCache"),
                          ("eager_static_vs_dynamic", "eager StaticCache vs DynamicCache")):
            if key in gc:
                print(f"check {gc['dtype']}, tree of {gc['n']}, {what}: max abs diff {gc[key]['max_abs_diff']:.3g}, "
                      f"argmax agree {gc[key]['argmax_agree']:.3f}")
        if "error" in gc:
            print(f"static-cache check failed: {gc['error']}")
        print()


if __name__ == "__main__":
    main()
