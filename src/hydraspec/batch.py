"""Batched speculative decoding of a list of prompts on the engine (engine.py): B prompts share every
target forward, each accepts on its own, and a row freed by a finished prompt is taken by the next waiting
one (continuous batching). This module adds what a whole batch needs around the engine: memory checks
before anything is allocated (hydraspec.memory), the order of admission and the results in input order.
One prompt is a batch of one (hydraspec.generator).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from .accept import ACCEPTORS
from .adaptive import make_policy
from .cache import text_config
from .drafters.base import Drafter, NoDrafter
from .prefix_pool import PrefixPool
from .engine import Engine, Request
from .errors import HydraspecError
from .frame_room import call_with_room
from .inputs import check_length, check_sampling, eos_ids, prompt_ids
from .memory import cache_bytes, check_memory, gib
from .policy import DraftPolicy
from .results import GenerationResult
from .sampling import Sampling
from .verify import check_supported

log = logging.getLogger("hydraspec.batch")


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


class BatchGenerator:
    """Speculative decoding of many prompts at once; every row's output equals its batch-1 output
    (greedy: token for token; sampling: the same distribution).

    drafter: the Drafter every row drafts with (None = plain decoding).
    trees: optional {batch_size: tree paths} for Medusa/Hydra drafters; at every step the tree of the
    largest listed batch size not above the number of active rows is used (the drafter's own tree when
    none is).
    verify_budget: optional cap on the tokens one verify forward holds over the whole batch; each row's
    draft is cut to max(1, verify_budget // active rows - 1) nodes (its first nodes, so still a tree).
    adaptive: greedy decoding on the CPU cuts each proposal to what the measured verify cost and the row's
    acceptance pay for (hydraspec.adaptive.make_policy). Cutting a draft never changes the output.
    """

    def __init__(self, model, tokenizer, drafter: Drafter | None = None, acceptor: str | None = None,
                 typical_epsilon: float = 0.09, typical_alpha: float = 0.3,
                 trees: dict[int, list[list[int]]] | None = None, verify_budget: int | None = None,
                 adaptive: bool = True):
        check_supported(model)
        if verify_budget is not None and verify_budget < 2:
            raise HydraspecError(f"verify_budget must be at least 2 tokens, got {verify_budget}")
        if acceptor is not None and acceptor not in ACCEPTORS:
            raise HydraspecError(f"unknown acceptor '{acceptor}'; known: {', '.join(ACCEPTORS)}")
        self.model, self.tokenizer = model, tokenizer
        self.drafter = with_trees(drafter or NoDrafter(), trees)
        self.acceptor, self.verify_budget, self.adaptive = acceptor, verify_budget, adaptive
        self.typical = {"epsilon": typical_epsilon, "alpha": typical_alpha}
        self.eos = eos_ids(model, tokenizer)
        self.policies: dict[tuple, DraftPolicy] = {}
        self.prefix_pool: PrefixPool | None = None  # set to keep prompts' keys and values across calls
        self.prefill_chunk = 0  # prompt tokens a joining row reads per step while others decode (0: whole)
        self.max_step_cost = 0.0  # serving: a step costs at most this many plain steps (0: no bound)

    @property
    def max_nodes(self) -> int:
        return self.drafter.max_nodes

    def policy(self, temperature: float = 0.0, serving: bool = False) -> DraftPolicy:
        """The draft policy of this generator's engines (built once per kind, so acceptance carries over
        from one call to the next): see hydraspec.adaptive.make_policy."""
        key = (temperature > 0, serving)
        if key not in self.policies:
            self.policies[key] = make_policy(self.model, self.drafter, greedy=temperature <= 0,
                                             acceptor=self.acceptor, budget=self.verify_budget,
                                             adaptive=self.adaptive, serving=serving,
                                             max_step_cost=self.max_step_cost)
        return self.policies[key]

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
        check_memory(self.model, need, rows, memory_limit, logits)

    # -- decoding -------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts=None, *, input_ids: list[list[int]] | None = None, max_new_tokens: int = 128,
                 batch_size: int | None = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop: list[str] | None = None, chat: bool = True,
                 memory_limit: int | None = None, keep_hidden: bool = False, on_result=None,
                 on_tokens=None, policy: DraftPolicy | None = None,
                 predictions: list[list[int] | None] | None = None) -> BatchResult:
        """prompts: strings, message lists or token-id lists (or input_ids=). batch_size: most rows decoded
        together (default: all); longest prompts first, and a row freed by a finished prompt is taken by the
        next waiting one. Sampling: input row i uses seed + i. memory_limit: bytes the caches may use
        (default: the free memory). keep_hidden: each result also carries the target's last hidden states
        over its prompt and answer (GenerationResult.hidden_states), taken from the forwards that decode
        anyway. on_result(i, result): called as soon as input row i is finished (e.g. to write it out).
        on_tokens(i, ids): called after every step with the tokens input row i kept in it (streaming).
        policy: how much of each proposal is verified (default: :meth:`policy`); the output is unchanged.
        predictions: per prompt, token ids its answer is expected to mostly repeat (OpenAI's predicted
        outputs), a draft source for the auto method."""
        if max_new_tokens <= 0:
            raise HydraspecError(f"max_new_tokens must be positive, got {max_new_tokens}")
        check_sampling(temperature, top_p, top_k)
        all_ids = prompt_ids(self.tokenizer, prompts, input_ids, chat)
        if not all_ids:
            raise HydraspecError("no prompts given")
        for i, ids in enumerate(all_ids):
            check_length(self.model, len(ids), max_new_tokens, f"prompt {i}" if len(all_ids) > 1 else "prompt")
        bs = batch_size or len(all_ids)
        if bs < 1:
            raise HydraspecError(f"batch size must be at least 1, got {bs}")
        # longest prompts first (less padding among the rows decoded together); results in input order
        order = sorted(range(len(all_ids)), key=lambda i: -len(all_ids[i]))
        rows = min(bs, len(order))
        need = self.estimate_bytes([len(all_ids[i]) for i in order[:rows]], max_new_tokens)
        self.check_memory(need, rows, memory_limit, self.logits_bytes(rows))
        log.info("batched decoding: %d prompts, up to %d rows at a time; KV cache %s", len(all_ids), rows, gib(need))
        t0 = time.perf_counter()
        capacity = max(len(x) for x in all_ids) + max_new_tokens + self.max_nodes + 1
        engine = self.engine(rows, capacity, keep_hidden, policy or self.policy(temperature))
        sampling, stops = Sampling(temperature, top_k, top_p), [s for s in (stop or []) if s]
        hook = None if on_tokens is None else (lambda req, ids: on_tokens(req.tag, ids))
        for i in order:  # sampling: input row i uses seed + i
            engine.add(Request(list(all_ids[i]), max_new_tokens, sampling, None if seed is None else seed + i,
                               stops, on_tokens=hook, tag=i, prediction=predictions[i] if predictions else None))
        results = run(engine, len(all_ids), on_result)
        return BatchResult(results=results, batch_size=bs, cache_bytes=need, wall_s=time.perf_counter() - t0,
                           target_forwards=engine.forwards, batches=engine.admissions)

    def engine(self, rows: int, capacity: int, keep_hidden: bool = False, policy: DraftPolicy | None = None) -> Engine:
        """An Engine of ``rows`` rows of ``capacity`` cache slots with this generator's drafter and settings."""
        return Engine(self.model, self.tokenizer, self.drafter, self.eos, rows=rows, capacity=capacity,
                      acceptor=self.acceptor, typical=self.typical, policy=policy, keep_hidden=keep_hidden,
                      prefix_pool=self.prefix_pool, prefill_chunk=self.prefill_chunk)


def run(engine: Engine, n: int, on_result=None) -> list[GenerationResult]:
    """Step ``engine`` until its requests (tagged 0 .. n - 1) are done; their results by tag. The loop runs with
    room on the frame stack (hydraspec.frame_room)."""
    return call_with_room(_steps, engine, n, on_result)


def _steps(engine: Engine, n: int, on_result) -> list[GenerationResult]:
    results: list[GenerationResult | None] = [None] * n
    while engine.busy:
        for req in engine.step():
            results[req.tag] = req.result
            if on_result is not None:
                on_result(req.tag, req.result)
    return results


def with_trees(drafter: Drafter, trees: dict | None) -> Drafter:
    """The drafter with a static tree per batch size (Medusa/Hydra heads only)."""
    if not trees:
        return drafter
    if not hasattr(drafter, "with_trees"):
        raise HydraspecError("a tree per batch size needs a Medusa/Hydra (head) drafter")
    for bs in trees:
        try:
            ok = int(bs) >= 1
        except (TypeError, ValueError):
            raise HydraspecError(f"tree batch sizes must be integers, got {bs!r}") from None
        if not ok:
            raise HydraspecError(f"tree batch sizes must be positive, got {bs}")
    return drafter.with_trees(trees)
