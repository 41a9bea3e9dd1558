"""Batched speculative decoding of a list of prompts on the engine (engine.py): B prompts share every
target forward, each accepts on its own, and a row freed by a finished prompt is taken by the next waiting
one (continuous batching). This module adds what a whole batch needs around the engine: memory checks
before anything is allocated, the order of admission and the results in input order.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import torch

from .accept import ACCEPTORS
from .adaptive import AdaptiveDraft
from .drafters.base import Drafter, NoDrafter
from .drafters.heads import HeadDrafter
from .cache import text_config
from .engine import Engine, Request
from .errors import HydraspecError
from .inputs import check_length, check_sampling, encode_prompt, eos_ids
from .results import GenerationResult
from .sampling import Sampling
from .verify import check_supported

log = logging.getLogger("hydraspec.batch")

MEMORY_HEADROOM = 0.9  # a batch may use at most this share of the free memory for its KV caches


# ---- memory ------------------------------------------------------------------------------------


def kv_bytes_per_slot(model) -> int:
    """Bytes one cache slot (one token position of one row) takes over all layers: keys and values."""
    cfg = text_config(model)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype_size = torch.empty((), dtype=model.dtype).element_size()
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * dtype_size


def cache_bytes(model, rows: int, capacity: int) -> int:
    """rows x capacity x layers x 2 (K, V) x kv_heads x head_dim x dtype size."""
    return rows * capacity * kv_bytes_per_slot(model)


def available_memory(device) -> int | None:
    """Free bytes where the cache will live: the GPU's free memory, or the host's available memory."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# ---- results -----------------------------------------------------------------------------------


@dataclass
class BatchResult:
    """Results in input order (indexable and iterable like a list) plus what the batch as a whole cost.

    cache_bytes: the KV caches (target + draft model) allocated once for the call. wall_s: the whole call.
    batches: admission rounds (the first rows, then each refill of rows freed by finished prompts).
    Per-row Stats: wall_s is the row's latency (from its admission to its last token), prefill_s its
    admission's prefill, verify_s the shared forwards it took part in, target_forwards counts them.
    """

    results: list[GenerationResult]
    batch_size: int
    cache_bytes: int
    wall_s: float
    target_forwards: int = 0  # batched verify forwards over the whole call
    batches: int = 0

    def __len__(self) -> int:
        return len(self.results)

    def __iter__(self):
        return iter(self.results)

    def __getitem__(self, i):
        return self.results[i]

    @property
    def new_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.results)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_latency_s(self) -> float:
        return sum(r.stats.wall_s for r in self.results) / len(self.results) if self.results else 0.0

    def to_dict(self) -> dict:
        return {"batch_size": self.batch_size, "prompts": len(self.results), "new_tokens": self.new_tokens,
                "wall_s": round(self.wall_s, 4), "tokens_per_s": round(self.tokens_per_s, 4),
                "mean_latency_s": round(self.mean_latency_s, 4), "cache_bytes": self.cache_bytes,
                "target_forwards": self.target_forwards, "batches": self.batches}


# ---- the engine --------------------------------------------------------------------------------


class BatchGenerator:
    """Speculative decoding of many prompts at once; every row's output equals its batch-1 output
    (greedy: token for token; sampling: the same distribution).

    drafter: the prototype Drafter (None = plain decoding); each further row decodes with its own fork.
    trees: optional {batch_size: tree paths} for Medusa/Hydra drafters; at every step the tree of the
    largest listed batch size not above the number of active rows is used (the drafter's own tree when
    none is).
    verify_budget: optional cap on the tokens one verify forward holds over the whole batch; each row's
    draft is cut to max(1, verify_budget // active rows - 1) nodes (its first nodes, so still a tree).
    On hardware where a forward's cost grows with its rows (CPUs) this keeps drafts long at batch 1
    and short at batch 8; cutting a draft only drops candidates, the output is unchanged.
    """

    def __init__(self, model, tokenizer, drafter: Drafter | None = None, acceptor: str | None = None,
                 typical_epsilon: float = 0.09, typical_alpha: float = 0.3,
                 trees: dict[int, list[list[int]]] | None = None, verify_budget: int | None = None):
        check_supported(model)
        if verify_budget is not None and verify_budget < 2:
            raise HydraspecError(f"verify_budget must be at least 2 tokens, got {verify_budget}")
        self.verify_budget = verify_budget
        if acceptor is not None and acceptor not in ACCEPTORS:
            raise HydraspecError(f"unknown acceptor '{acceptor}'; known: {', '.join(ACCEPTORS)}")
        self.model, self.tokenizer = model, tokenizer
        self.drafter = drafter or NoDrafter()
        self.acceptor = acceptor
        self.typical = {"epsilon": typical_epsilon, "alpha": typical_alpha}
        self.eos = eos_ids(model, tokenizer)
        self.trees = self._tree_drafters(trees)

    def _tree_drafters(self, trees) -> list[tuple[int, Drafter]]:
        if not trees:
            return []
        if not isinstance(self.drafter, HeadDrafter):
            raise HydraspecError("a tree per batch size needs a Medusa/Hydra (head) drafter")
        out = []
        for bs, paths in trees.items():
            try:
                bs = int(bs)
            except (TypeError, ValueError):
                raise HydraspecError(f"tree batch sizes must be integers, got {bs!r}") from None
            if bs < 1:
                raise HydraspecError(f"tree batch sizes must be positive, got {bs}")
            out.append((bs, HeadDrafter(self.drafter.heads, self.drafter.embed, paths)))
        return sorted(out, key=lambda x: x[0])

    @property
    def max_nodes(self) -> int:
        return max([self.drafter.max_nodes] + [d.max_nodes for _, d in self.trees])

    # -- memory ---------------------------------------------------------------------------------
    def estimate_bytes(self, lengths: list[int], max_new_tokens: int) -> int:
        """KV-cache bytes one batch of prompts with these token counts allocates (target + draft model)."""
        capacity = max(lengths) + max_new_tokens + self.max_nodes + 1
        total = cache_bytes(self.model, len(lengths), capacity)
        dm = getattr(self.drafter, "model", None)
        if dm is not None:  # the draft model's cache: B rows of the same capacity (or one cache per row)
            total += cache_bytes(dm, len(lengths), capacity + self.max_nodes + 1)
        return total

    def logits_bytes(self, rows: int) -> int:
        """The verify forward's logits: rows x (largest tree + 1) x vocab, in the model dtype and as float32."""
        vocab = text_config(self.model).vocab_size
        size = torch.empty((), dtype=self.model.dtype).element_size() + 4
        return rows * (self.max_nodes + 1) * vocab * size

    def check_memory(self, need: int, rows: int, memory_limit: int | None = None, logits: int = 0) -> None:
        """Refuse (HydraspecError) a batch whose KV cache + verify logits exceed 90% of the free memory."""
        free = memory_limit if memory_limit is not None else available_memory(self.model.device)
        if free is None:
            log.warning("cannot tell how much memory is free; not checking the %s KV cache", gib(need))
            return
        if need + logits > MEMORY_HEADROOM * free:
            raise HydraspecError(
                f"a batch of {rows} needs {gib(need)} of KV cache ({rows} rows x capacity x "
                f"{text_config(self.model).num_hidden_layers} layers x K/V x kv heads x head dim x dtype) and "
                f"{gib(logits)} of verify logits, more than {int(MEMORY_HEADROOM * 100)}% of the {gib(free)} "
                f"free on {self.model.device}; use a smaller --batch-size or --max-new-tokens")

    # -- decoding -------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts=None, *, input_ids: list[list[int]] | None = None, max_new_tokens: int = 128,
                 batch_size: int | None = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop: list[str] | None = None, chat: bool = True,
                 memory_limit: int | None = None, keep_hidden: bool = False, on_result=None,
                 on_tokens=None, adaptive=None) -> BatchResult:
        """prompts: strings, message lists or token-id lists (or input_ids=). batch_size: most rows decoded
        together (default: all); longest prompts first, and a row freed by a finished prompt is taken by the
        next waiting one. Sampling: input row i uses seed + i. memory_limit: bytes the caches may use
        (default: the free memory). keep_hidden: each result also carries the target's last hidden states
        over its prompt and answer (GenerationResult.hidden_states), taken from the forwards that decode
        anyway. on_result(i, result): called as soon as input row i is finished (e.g. to write it out).
        on_tokens(i, ids): called after every step with the tokens input row i kept in it (streaming).
        adaptive: a hydraspec.adaptive.AdaptiveDraft rule choosing each step's draft length from the number
        of running rows (it counts this run's acceptance); the output is unchanged."""
        if max_new_tokens <= 0:
            raise HydraspecError(f"max_new_tokens must be positive, got {max_new_tokens}")
        check_sampling(temperature, top_p, top_k)
        if input_ids is not None:
            all_ids = [list(map(int, x)) for x in input_ids]
        else:
            if prompts is None or isinstance(prompts, str):
                raise HydraspecError("generate_batch takes a list of prompts")
            all_ids = [[int(t) for t in p] if _is_ids(p) else encode_prompt(self.tokenizer, p, chat) for p in prompts]
        if not all_ids:
            raise HydraspecError("no prompts given")
        for i, ids in enumerate(all_ids):
            check_length(self.model, len(ids), max_new_tokens, f"prompt {i}")
        bs = batch_size or len(all_ids)
        if bs < 1:
            raise HydraspecError(f"batch size must be at least 1, got {bs}")

        # longest prompts first (less padding among the rows decoded together); a finished row's place is
        # taken by the next waiting prompt; results go back in input order
        order = sorted(range(len(all_ids)), key=lambda i: -len(all_ids[i]))
        rows = min(bs, len(order))
        need = self.estimate_bytes([len(all_ids[i]) for i in order[:rows]], max_new_tokens)
        self.check_memory(need, rows, memory_limit, self.logits_bytes(rows))
        log.info("batched decoding: %d prompts, up to %d rows at a time; KV cache %s", len(all_ids), rows, gib(need))

        sampling = Sampling(temperature, top_k, top_p)
        results: list[GenerationResult | None] = [None] * len(all_ids)
        capacity = max(len(x) for x in all_ids) + max_new_tokens + self.max_nodes + 1
        t0 = time.perf_counter()
        engine = self.engine(rows, capacity, keep_hidden, draft_cap=adaptive)
        stops = [s for s in (stop or []) if s]
        hook = None if on_tokens is None else (lambda req, ids: on_tokens(req.tag, ids))
        for i in order:  # sampling: input row i uses seed + i
            engine.add(Request(list(all_ids[i]), max_new_tokens, sampling, None if seed is None else seed + i,
                               stops, on_tokens=hook, tag=i))
        while engine.busy:
            for req in engine.step():
                results[req.tag] = req.result
                if on_result is not None:
                    on_result(req.tag, req.result)
        wall = time.perf_counter() - t0
        return BatchResult(results=results, batch_size=bs, cache_bytes=need, wall_s=wall,
                           target_forwards=engine.forwards, batches=engine.admissions)

    def engine(self, rows: int, capacity: int, keep_hidden: bool = False, draft_cap=None) -> Engine:
        """An Engine of ``rows`` rows of ``capacity`` cache slots with this generator's drafter and settings;
        an AdaptiveDraft ``draft_cap`` is bound to it (it counts that engine's acceptance)."""
        engine = Engine(self.model, self.tokenizer, self.drafter, self.eos, rows=rows, capacity=capacity,
                        acceptor=self.acceptor, typical=self.typical, trees=self.trees,
                        verify_budget=self.verify_budget, draft_cap=draft_cap, keep_hidden=keep_hidden)
        if isinstance(draft_cap, AdaptiveDraft):
            draft_cap.engine = engine
        return engine


def _is_ids(p) -> bool:
    """A prompt given as token ids (a non-empty list/tuple of ints or a 1D tensor) rather than text/messages."""
    if isinstance(p, torch.Tensor):
        return p.dim() == 1
    return isinstance(p, (list, tuple)) and bool(p) and all(isinstance(t, int) for t in p)


# ---- command line --------------------------------------------------------------------------------


def read_prompt_lines(path: str) -> list:
    """A prompt file for batched generation: one prompt per non-empty line, either plain text or JSON (a
    string, a message list, or an object with "prompt", "turns" (first turn used) or "messages")."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln.rstrip("\n") for ln in f]
    except OSError as e:
        raise HydraspecError(f"cannot read prompt file '{path}': {e.strerror}") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        p = line
        if line.lstrip()[:1] in "{[\"":
            try:
                p = json.loads(line)
            except json.JSONDecodeError:
                p = line
        if isinstance(p, dict):
            if "prompt" in p:
                p = p["prompt"]
            elif "turns" in p and p["turns"]:
                p = p["turns"][0]
            elif "messages" in p:
                p = p["messages"]
            else:
                raise HydraspecError(f"{path}:{n}: a JSON prompt needs 'prompt', 'turns' or 'messages'")
        if isinstance(p, str) and not p.strip():
            continue
        prompts.append(p)
    if not prompts:
        raise HydraspecError(f"prompt file '{path}' holds no prompts")
    return prompts


def load_batch_trees(text: str | None) -> dict[int, list[list[int]]] | None:
    """--batch-trees: a JSON file or JSON object {"1": paths, "8": paths, ...}."""
    if not text:
        return None
    from pathlib import Path

    try:
        data = json.loads(Path(text).read_text()) if Path(text).exists() else json.loads(text)
    except json.JSONDecodeError as e:
        raise HydraspecError(f"--batch-trees {text!r} is neither a JSON file nor JSON: {e}") from None
    if isinstance(data, dict) and isinstance(data.get("by_batch"), dict):  # a tree.json of build-tree --batch-sizes
        data = data["by_batch"]
    if not isinstance(data, dict) or not data:
        raise HydraspecError("--batch-trees takes a JSON object {batch_size: [[0], [0, 0], ...], ...} "
                             "or a tree.json written by build-tree --batch-sizes")
    try:
        return {int(k): v for k, v in data.items()}
    except ValueError:
        raise HydraspecError(f"--batch-trees keys must be batch sizes (integers), got {list(data)}") from None
