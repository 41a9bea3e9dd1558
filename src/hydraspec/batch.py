"""Batched speculative decoding: B prompts share every target forward, each row accepts on its own.

Layout. One SpecCache holds B rows. Row b's cache content lives at slots [0, L_b) (left-aligned, its
own length L_b); slots [L_b, W) of a shorter row are a masked gap, where W = max_b L_b is the shared
write pointer. One verify forward writes every row's verify tree (pending token + drafts, padded to
the largest tree in the batch with dummy nodes) at slots [W, W + N) and sees a 4D additive mask per
row: a node attends to its row's [0, L_b) and to its own tree ancestors; dummy nodes see only
themselves, nobody sees them, and they are never accepted. Position ids are per row: L_b + depth.
After acceptance each row moves its own accepted path from W + path to L_b + i (one gather/scatter
per layer for the whole batch) and L_b grows by the path length. Rows that finish (EOS, token budget,
stop string) are removed from the cache and from later forwards, and a waiting prompt (when there are
more prompts than rows) takes the free row: it is prefilled on its own and joins the next step
(continuous batching). The caches are allocated once, for the largest number of rows, and reused.

Drafters are per-sequence objects, so every row gets its own shallow copy of the drafter (models and
heads are shared, per-sequence state is not). Two drafters are batched across rows: draft-model chains
(_BatchDraft: one B-row draft cache in the same layout, one draft forward per depth) and Medusa/Hydra
heads (propose_heads_batched: one heads call per depth). A Medusa/Hydra drafter can use a different
static tree per number of active rows (`trees={batch_size: paths}`).
"""
from __future__ import annotations

import copy
import json
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from .accept import ACCEPTORS
from .cache import new_cache
from .drafters.base import DecodeState, Drafter, NoDrafter
from .errors import HydraspecError
from .generator import GenerationResult, SpeculativeGenerator, Stats, _fit_vocab, _stop_at, _trim_after_stop
from .sampling import Sampling
from .tree import shape_of
from .verify import check_supported

log = logging.getLogger("hydraspec.batch")

MEMORY_HEADROOM = 0.9  # a batch may use at most this share of the free memory for its KV caches


# ---- memory ------------------------------------------------------------------------------------


def _text_config(model):
    return model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config


def kv_bytes_per_slot(model) -> int:
    """Bytes one cache slot (one token position of one row) takes over all layers: keys and values."""
    cfg = _text_config(model)
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


@dataclass
class _Row:
    index: int  # position in the input
    ids: list[int]
    drafter: Drafter
    state: DecodeState
    gen: torch.Generator | None
    stats: Stats
    new: list[int] = field(default_factory=list)
    finish: str = "length"
    length: int = 0  # this row's cache length L_b
    done: bool = False
    # batched draft-model chain drafting (_BatchDraft): the row's draft-cache length, tokens of
    # state.tokens in the draft cache, draft tokens fed during the last proposal, current draft length
    d_len: int = 0
    d_cached: int = 0
    d_fed: int = 0
    d_k: int = 0
    t_start: float = 0.0  # when the row was admitted (its latency runs from here)
    hidden_log: list | None = None  # keep_hidden: the target's last hidden states, in position order


# ---- the engine --------------------------------------------------------------------------------


class BatchGenerator:
    """Speculative decoding of many prompts at once; every row's output equals its batch-1 output
    (greedy: token for token; sampling: the same distribution).

    drafter: the prototype Drafter (None = plain decoding); each row decodes with a shallow copy.
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
        self.base = SpeculativeGenerator(model, tokenizer, drafter, acceptor=acceptor,
                                         typical_epsilon=typical_epsilon, typical_alpha=typical_alpha)
        self.model, self.tokenizer = model, tokenizer
        self.drafter = drafter or NoDrafter()
        self.acceptor = acceptor
        self.typical = self.base.typical
        self.trees = self._tree_drafters(trees)

    def _tree_drafters(self, trees) -> list[tuple[int, Drafter]]:
        if not trees:
            return []
        from .drafters.heads import HeadDrafter

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

    def _drafter_for(self, row: _Row, active: int) -> Drafter:
        chosen = None
        for bs, d in self.trees:
            if bs <= active:
                chosen = d
        return chosen or row.drafter

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
        vocab = _text_config(self.model).vocab_size
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
                f"{_text_config(self.model).num_hidden_layers} layers x K/V x kv heads x head dim x dtype) and "
                f"{gib(logits)} of verify logits, more than {int(MEMORY_HEADROOM * 100)}% of the {gib(free)} "
                f"free on {self.model.device}; use a smaller --batch-size or --max-new-tokens")

    # -- decoding -------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts=None, *, input_ids: list[list[int]] | None = None, max_new_tokens: int = 128,
                 batch_size: int | None = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop: list[str] | None = None, chat: bool = True,
                 memory_limit: int | None = None, keep_hidden: bool = False, on_result=None) -> BatchResult:
        """prompts: strings, message lists or token-id lists (or input_ids=). batch_size: most rows decoded
        together (default: all); longest prompts first, and a row freed by a finished prompt is taken by the
        next waiting one. Sampling: input row i uses seed + i. memory_limit: bytes the caches may use
        (default: the free memory). keep_hidden: each result also carries the target's last hidden states
        over its prompt and answer (GenerationResult.hidden_states), taken from the forwards that decode
        anyway. on_result(i, result): called as soon as input row i is finished (e.g. to write it out)."""
        if max_new_tokens <= 0:
            raise HydraspecError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if temperature < 0 or not (0 < top_p <= 1) or top_k < 0:
            raise HydraspecError("need temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
        if input_ids is not None:
            all_ids = [list(map(int, x)) for x in input_ids]
        else:
            if prompts is None or isinstance(prompts, str):
                raise HydraspecError("generate_batch takes a list of prompts")
            all_ids = [[int(t) for t in p] if _is_ids(p) else self.base.encode(p, chat=chat) for p in prompts]
        if not all_ids:
            raise HydraspecError("no prompts given")
        for i, ids in enumerate(all_ids):
            if not ids:
                raise HydraspecError(f"prompt {i} is empty")
            self._check_length(i, len(ids), max_new_tokens)
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
        t0 = time.perf_counter()
        forwards, admissions = self._run(order, rows, all_ids, max_new_tokens, sampling, seed,
                                         [s for s in (stop or []) if s], results, keep_hidden, on_result)
        wall = time.perf_counter() - t0
        return BatchResult(results=results, batch_size=bs, cache_bytes=need, wall_s=wall,
                           target_forwards=forwards, batches=admissions)

    def _check_length(self, i: int, n: int, max_new_tokens: int) -> None:
        total = n + max_new_tokens
        ctx, window = self.base.ctx, self.base.window
        if ctx and total > ctx:
            raise HydraspecError(f"prompt {i} ({n} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                                 f"model's context of {ctx} tokens")
        if window and total > window:
            raise HydraspecError(f"prompt {i} + max_new_tokens ({total}) exceeds the model's sliding window "
                                 f"({window}); tree attention over a sliding window is not supported")

    def _run(self, order: list[int], rows_max: int, all_ids, max_new: int, sampling: Sampling, seed, stops,
             results, keep_hidden: bool = False, on_result=None) -> tuple[int, int]:
        model, dev = self.model, self.model.device
        accept_name = "greedy" if sampling.greedy else (self.acceptor or "lossless")
        accept = ACCEPTORS[accept_name]
        extra = self.typical if accept_name == "typical" else {}
        need_hidden = keep_hidden or self.drafter.needs_hidden or any(d.needs_hidden for _, d in self.trees)

        # the caches: rows_max rows, allocated once; row slots are reused by waiting prompts
        capacity = max(len(all_ids[i]) for i in order) + max_new + self.max_nodes + 1
        cache = new_cache(model, capacity)
        _allocate(cache, model, rows_max)
        bd = _BatchDraft.make(self.drafter, capacity + self.max_nodes + 1, rows_max)
        queue = list(order)
        active: list[_Row] = []
        admissions = 0

        def admit(k: int) -> None:
            t0 = time.perf_counter()
            new = []
            for i in queue[:k]:
                ids = all_ids[i]
                gen = None
                if not sampling.greedy or accept_name == "typical":
                    gen = torch.Generator().manual_seed(seed + i if seed is not None else torch.seed())
                state = DecodeState(tokens=list(ids), prompt_len=len(ids), sampling=sampling, generator=gen)
                new.append(_Row(index=i, ids=ids, drafter=copy.copy(self.drafter), state=state, gen=gen,
                                stats=Stats(prompt_tokens=len(ids))))
            del queue[:k]
            first = len(active)
            _prefill(model, cache, first, new, need_hidden)
            if keep_hidden:
                for r in new:
                    r.hidden_log = [r.state.new_hidden.clone()] if r.state.new_hidden is not None else []
            if bd is not None:
                bd.add(first, new)
            else:
                for r in new:
                    r.drafter.start(r.state, len(r.ids) + max_new + self.max_nodes + 1)
            _use_rows(cache, 0, first + len(new))
            if bd is not None:
                _use_rows(bd.cache, 0, first + len(new))
            t1 = time.perf_counter()
            for r in new:
                r.t_start = t0
                r.stats.prefill_s = t1 - t0
            active.extend(new)

        admit(rows_max)
        admissions += 1
        forwards = 0
        while active:
            # 1. drafts, one per row, trimmed to the row's token budget
            n_active = len(active)
            cap = None if self.verify_budget is None else max(1, self.verify_budget // n_active - 1)
            trees, shapes = [], []
            t0 = time.perf_counter()
            if bd is not None:  # draft-model chains: one draft forward per depth for every row
                together = bd.propose(active)
            else:  # head drafters: one heads call per depth for every row (None: other drafters)
                together = propose_heads_batched(self._drafter_for(active[0], n_active), [r.state for r in active],
                                                 [r.drafter for r in active])
            if together is not None:
                dt = (time.perf_counter() - t0) / n_active
                for r in active:
                    r.stats.draft_s += dt
            for j, r in enumerate(active):
                t0 = time.perf_counter()
                tree = together[j] if together is not None else self._drafter_for(r, n_active).propose(r.state)
                remaining = max_new - len(r.new)
                if cap is not None and len(tree.tokens) > cap:
                    tree = tree.head(cap)
                shape = shape_of(tree.with_root())
                if int(shape.depth[-1]) > remaining - 1:
                    tree = tree.head(int((shape.depth <= remaining - 1).sum()) - 1)
                    shape = shape_of(tree.with_root())
                trees.append(tree)
                shapes.append(shape)
                r.stats.draft_s += time.perf_counter() - t0

            # 2. one verify forward over every row's tree, padded to N nodes
            t1 = time.perf_counter()
            B = len(active)
            N = max(s.size for s in shapes)
            W = max(r.length for r in active)
            ids = torch.zeros(B, N, dtype=torch.long)
            pos = torch.empty(B, N, dtype=torch.long)
            tree_allowed = torch.eye(N, dtype=torch.bool).repeat(B, 1, 1)  # dummy nodes see only themselves
            node_lists = []
            for b, (r, tree, shape) in enumerate(zip(active, trees, shapes)):
                n = shape.size
                nodes = [r.state.tokens[-1]] + tree.tokens.tolist()
                node_lists.append(nodes)
                ids[b, :n] = torch.tensor(nodes)
                pos[b, :n] = r.length + shape.depth
                pos[b, n:] = r.length
                tree_allowed[b, :n, :n] = shape.ancestors
            for layer in cache.layers:
                layer.length = W
            mask = _ragged_mask([r.length for r in active], W, tree_allowed, model.dtype, dev)
            out = model(input_ids=ids.to(dev), position_ids=pos.to(dev), attention_mask=mask,
                        past_key_values=cache, use_cache=True, output_hidden_states=need_hidden)
            logits = out.logits.float()
            hid = out.hidden_states[-1] if need_hidden else None
            del out
            forwards += 1
            t2 = time.perf_counter()
            verify_s = t2 - t1

            # 3. per-row acceptance, then one compaction of every row's accepted path
            src = torch.full((B, N), W + N - 1, dtype=torch.long)
            dst = torch.full((B, N), W + N - 1, dtype=torch.long)
            finished = []
            for b, (r, tree, shape) in enumerate(zip(active, trees, shapes)):
                ta = time.perf_counter()
                n = shape.size
                q = tree.q
                if q is not None and q.shape[-1] != logits.shape[-1]:
                    q = _fit_vocab(q, logits.shape[-1])
                acc = accept(shape, node_lists[b], logits[b, :n], q=q, sampling=sampling, generator=r.gen, **extra)
                k = len(acc.path)
                src[b, :k] = W + torch.tensor(acc.path)
                dst[b, :k] = r.length + torch.arange(k)
                r.length += k
                emitted = [node_lists[b][i] for i in acc.path[1:]] + [acc.next_token]
                self._emit(r, emitted, max_new, stops)
                r.stats.target_forwards += 1
                r.stats.verify_s += verify_s
                r.state.hidden = hid[b, acc.path[-1]] if hid is not None else None
                r.state.new_hidden = hid[b, acc.path] if hid is not None else None
                if keep_hidden:
                    r.hidden_log.append(r.state.new_hidden)
                tb = time.perf_counter()
                r.stats.accept_s += tb - ta
                if r.done:
                    r.stats.wall_s = tb - r.t_start
                    finished.append(b)
                else:
                    if bd is not None:
                        bd.observe(r, len(acc.path) - 1)
                    else:
                        self._drafter_for(r, n_active).observe(r.state, [i - 1 for i in acc.path[1:]])
                    r.stats.draft_s += time.perf_counter() - tb
            _compact(cache, src.to(dev), dst.to(dev))

            # 4. finished rows leave the batch
            if finished:
                for b in finished:
                    r = active[b]
                    results[r.index] = self._result(r, stops)
                    if on_result is not None:
                        on_result(r.index, results[r.index])
                keep = [b for b in range(B) if b not in set(finished)]
                active[:] = [active[b] for b in keep]
                _select_rows(cache, torch.tensor(keep, dtype=torch.long, device=dev))
                if bd is not None:
                    _select_rows(bd.cache, torch.tensor(keep, dtype=torch.long, device=bd.model.device))
                if queue:  # waiting prompts take the free rows
                    admit(min(rows_max - len(active), len(queue)))
                    admissions += 1
        del cache
        return forwards, admissions

    def _emit(self, r: _Row, emitted: list[int], max_new: int, stops: list[str]) -> None:
        """The stop rules of SpeculativeGenerator.generate: EOS (kept), token budget, stop strings."""
        eos = self.base.eos
        cut = len(emitted)
        for i, t in enumerate(emitted):
            if t in eos:
                cut, r.finish = i + 1, "eos"
                break
        if len(r.new) + cut >= max_new and r.finish != "eos":
            cut = max_new - len(r.new)
        emitted = emitted[:cut]
        r.new.extend(emitted)
        if stops:
            n_before = len(r.new) - len(emitted)
            hit = _stop_at(self.tokenizer, r.new, n_before, stops)
            if hit is not None:
                del r.new[hit:]
                emitted = emitted[: max(0, hit - n_before)]
                r.finish = "stop"
        r.stats.count(len(emitted))
        r.state.tokens.extend(emitted)
        r.done = r.finish != "length" or len(r.new) >= max_new

    def _result(self, r: _Row, stops: list[str]) -> GenerationResult:
        r.stats.new_tokens = len(r.new)
        text = self.tokenizer.decode(r.new, skip_special_tokens=True)
        if r.finish == "stop":
            text = _trim_after_stop(text, stops)
        hidden = None
        if r.hidden_log is not None:  # positions 0 .. T - 2 (an accepted path may run past a stop)
            hidden = torch.cat(r.hidden_log)[: len(r.ids) + len(r.new) - 1]
            r.hidden_log = None
        return GenerationResult(text=text, token_ids=list(r.new), prompt_ids=list(r.ids), stats=r.stats,
                                finish_reason=r.finish, hidden_states=hidden)


class _BatchDraft:
    """A DraftModelDrafter in chain mode for all rows at once: one draft cache of B rows laid out like the
    target's (row b at slots [0, d_len_b), a masked gap, new tokens written at the shared pointer and
    moved next to the row's prefix), one draft forward per depth for every row still drafting. Each row
    keeps the single-sequence drafter's rules: its own dynamic length (+2 after a fully accepted draft,
    -1 otherwise), the greedy confidence stop, draws from its own generator, and after verification the
    draft cache keeps only the accepted drafts."""

    def __init__(self, proto, capacity: int, rows_max: int):
        self.p, self.model = proto, proto.model
        self.cache = new_cache(self.model, capacity)
        _allocate(self.cache, self.model, rows_max)

    @staticmethod
    def make(drafter, capacity: int, rows_max: int):
        from .drafters.draft_model import DraftModelDrafter

        if type(drafter) is not DraftModelDrafter or drafter.widths or drafter.leaves:  # leaves: per row
            return None
        return _BatchDraft(drafter, capacity, rows_max)

    def add(self, first: int, rows: list[_Row]) -> None:
        """New rows at cache rows [first, first + len(rows)): prefill the draft model on their prompts but
        the last token (which the next proposal feeds)."""
        for r in rows:
            r.d_k = self.p.k0
            r.d_fed = 0
            r.d_cached = r.d_len = len(r.ids) - 1
        if any(r.d_cached for r in rows):
            _prefill(self.model, self.cache, first, rows, False, draft=True)

    def _forward(self, active: list[_Row], feeds: list[list[int]]) -> torch.Tensor:
        """Append feeds[b] to row b's draft cache; logits [B, vocab] at each row's last fed token."""
        dev = self.model.device
        B, C = len(active), max(1, max(len(f) for f in feeds))
        W = max(r.d_len for r in active)
        ids = torch.zeros(B, C, dtype=torch.long)
        pos = torch.empty(B, C, dtype=torch.long)
        tree_allowed = torch.eye(C, dtype=torch.bool).repeat(B, 1, 1)
        src = torch.full((B, C), W + C - 1, dtype=torch.long)
        dst = torch.full((B, C), W + C - 1, dtype=torch.long)
        for b, (r, f) in enumerate(zip(active, feeds)):
            c = len(f)
            pos[b] = r.d_len + torch.arange(C).clamp(max=max(c - 1, 0))
            if c:
                ids[b, :c] = torch.tensor(f)
                tree_allowed[b, :c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
                src[b, :c] = W + torch.arange(c)
                dst[b, :c] = r.d_len + torch.arange(c)
        for layer in self.cache.layers:
            layer.length = W
        mask = _ragged_mask([r.d_len for r in active], W, tree_allowed, self.model.dtype, dev)
        out = self.model(input_ids=ids.to(dev), position_ids=pos.to(dev), attention_mask=mask,
                         past_key_values=self.cache, use_cache=True)
        last = torch.tensor([max(len(f) - 1, 0) for f in feeds], device=out.logits.device)
        logits = out.logits[torch.arange(B, device=last.device), last].float()
        _compact(self.cache, src.to(dev), dst.to(dev))
        for r, f in zip(active, feeds):
            r.d_len += len(f)
        return logits

    @torch.inference_mode()
    def propose(self, active: list[_Row]):
        from .sampling import sample_without_replacement
        from .tree import DraftTree, chain

        p = self.p
        feeds = [r.state.tokens[r.d_cached:] for r in active]
        logits = self._forward(active, feeds)
        for r in active:
            r.d_cached, r.d_fed = len(r.state.tokens), 0
        toks: list[list[int]] = [[] for _ in active]
        qs: list[list[torch.Tensor]] = [[] for _ in active]
        drafting = [True] * len(active)
        for depth in range(max(r.d_k for r in active)):
            for b, r in enumerate(active):
                if not drafting[b] or depth >= r.d_k:
                    drafting[b] = False
                    continue
                lg = logits[b]
                sampling = r.state.sampling
                if sampling.greedy:
                    top = torch.topk(lg, 1)
                    if p.confidence > 0 and toks[b] and \
                            top.values[0].item() - torch.logsumexp(lg, -1).item() < p.log_confidence:
                        drafting[b] = False
                        continue
                    toks[b].append(int(top.indices[0]))
                else:
                    probs = sampling.probs(lg)
                    toks[b].append(int(sample_without_replacement(probs, 1, r.state.generator)[0]))
                    qs[b].append(probs)
                if depth >= r.d_k - 1:  # the last draft of a chain is not fed
                    drafting[b] = False
            if not any(drafting):
                break
            feeds = [[toks[b][-1]] if drafting[b] else [] for b in range(len(active))]
            logits = self._forward(active, feeds)
            for r, f in zip(active, feeds):
                r.d_fed += len(f)
        return [DraftTree(torch.tensor(t, dtype=torch.long), chain(len(t)), torch.stack(q) if q else None)
                for t, q in zip(toks, qs)]

    def observe(self, r: _Row, n_accepted: int) -> None:
        kept = min(n_accepted, r.d_fed)  # accepted drafts already in the draft cache stay, the rest go
        r.d_cached += kept
        r.d_len = r.d_cached
        if self.p.dynamic:
            r.d_k = min(r.d_k + 2, self.p.max_k) if n_accepted >= r.d_k else max(1, r.d_k - 1)


def propose_heads_batched(drafter, states: list[DecodeState], row_drafters=None):
    """HeadDrafter.propose for many rows at once (same trees, same tokens, same random draws per row's
    generator), calling each head once per depth for all rows instead of once per row: the heads' vocabulary
    projection is read once per depth. None when `drafter` is not a head drafter (then call it per row)."""
    from .drafters.heads import HeadDrafter, _prefix_closed, _reindex
    from .sampling import sample_without_replacement
    from .tree import DraftTree

    if not isinstance(drafter, HeadDrafter) or not all(hasattr(drafter, a) for a in ("levels", "paths", "ranks")):
        return None
    out: list = [DraftTree.empty() for _ in states]
    live = [j for j, s in enumerate(states) if s.hidden is not None]
    if not live:
        return out
    heads, parents, n = drafter.heads, drafter.parents, len(drafter.parents)
    if getattr(heads, "prefix", None) is not None:
        # Hydra++: each row's own drafter keeps that row's prefix-layer cache and gives what the heads read
        if row_drafters is None:
            return None
        H = torch.stack([row_drafters[j]._head_input(states[j]) for j in live])
    else:
        H = torch.stack([states[j].hidden for j in live])  # [R, dim]
    to_ids = getattr(heads, "token_ids", lambda i: i)  # draft vocabulary -> token ids
    to_probs = getattr(heads, "full_probs", lambda p: p)
    greedy = states[0].sampling.greedy
    tokens = [[0] * n for _ in live]
    qrows = [[None] * n for _ in live]
    for d, (par, kids) in enumerate(drafter.levels):
        P = len(par)
        if heads.kind == "medusa":
            lg = heads.logits(d, H).float()[:, None, :].expand(-1, P, -1)  # [R, P, V]
        else:
            path_ids = [[states[j].tokens[-1]] + [tokens[r][k] for k in (drafter.paths[p] if p >= 0 else [])]
                        for r, j in enumerate(live) for p in par]
            emb = drafter.embed(torch.tensor(path_ids, device=H.device))  # [R * P, d + 1, dim]
            lg = heads.logits(d, H.repeat_interleave(P, 0), emb).float().view(len(live), P, -1)
        if greedy:
            need = max(drafter.ranks[c] for p in par for c in kids[p]) + 1
            top = to_ids(torch.topk(lg, need, dim=-1).indices).tolist()  # [R][P][need]
        for r, j in enumerate(live):
            for i, p in enumerate(par):
                children = kids[p]
                if greedy:
                    for c in children:
                        tokens[r][c] = top[r][i][drafter.ranks[c]]
                else:
                    probs = to_probs(states[j].sampling.probs(lg[r, i]))
                    draws = sample_without_replacement(probs, len(children), states[j].generator).tolist()
                    for c, x in zip(children, draws):
                        tokens[r][c] = x
                        qrows[r][c] = probs
    for r, j in enumerate(live):
        if greedy:
            out[j] = DraftTree(torch.tensor(tokens[r]), parents)
            continue
        drawn = [i for i in range(n) if qrows[r][i] is not None]
        if len(drawn) < n:  # fewer tokens with nonzero probability than children: cut the tree
            keep = _prefix_closed(parents, set(drawn))
            out[j] = DraftTree(torch.tensor([tokens[r][i] for i in keep]), _reindex(parents, keep),
                               torch.stack([qrows[r][i] for i in keep]) if keep else None)
        else:
            out[j] = DraftTree(torch.tensor(tokens[r]), parents, torch.stack(qrows[r]))
    return out


def _additive(allowed: torch.Tensor, dtype, device) -> torch.Tensor:
    """[B, q, k] bool -> [B, 1, q, k] additive mask (0 where allowed, dtype min elsewhere)."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None].to(device)


def _allocate(cache, model, rows: int) -> None:
    """Allocate every layer's buffers for `rows` rows now (SlotLayer would allocate at its first write)."""
    cfg = _text_config(model)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    empty = torch.empty(rows, kv_heads, 0, head_dim, dtype=model.dtype, device=model.device)
    for layer in cache.layers:
        layer.lazy_initialization(empty, empty)
        layer.full_k, layer.full_v = layer.k_buf, layer.v_buf
        layer.length = 0


def _use_rows(cache, start: int, stop: int) -> None:
    """Make the layers read and write rows [start, stop) of their full buffers."""
    for layer in cache.layers:
        layer.k_buf, layer.v_buf = layer.full_k[start:stop], layer.full_v[start:stop]
        layer.keys = layer.k_buf[:, :, : layer.length]
        layer.values = layer.v_buf[:, :, : layer.length]


@torch.inference_mode()
def _prefill(model, cache, first: int, rows: list[_Row], need_hidden: bool, draft: bool = False) -> None:
    """Write every new row's prompt but its last token into cache rows [first, first + len(rows)), slots
    [0, len - 1); sets row.length (target) and the hidden state of the last prefilled token when asked.
    Each row is prefilled by its own forward over exactly its prompt: a prefill is compute-bound, and
    one right-padded [B, longest] forward spent a third of its time on padding for HumanEval prompts."""
    lens = [len(r.ids) - 1 for r in rows]
    if not draft:
        for r, n in zip(rows, lens):
            r.length = n
    dev = model.device
    saved = [layer.length for layer in cache.layers]
    for b, (r, n) in enumerate(zip(rows, lens)):
        if n == 0:
            continue
        _use_rows(cache, first + b, first + b + 1)
        for layer in cache.layers:
            layer.length = 0
        out = model(input_ids=torch.tensor([r.ids[:-1]], device=dev), position_ids=torch.arange(n, device=dev)[None],
                    past_key_values=cache, use_cache=True, output_hidden_states=need_hidden, logits_to_keep=1)
        if need_hidden:
            h = out.hidden_states[-1][0]
            r.state.hidden = h[n - 1]
            r.state.new_hidden = h[:n]
    for layer, n in zip(cache.layers, saved):  # the caller selects the rows to use next
        layer.length = n


def _is_ids(p) -> bool:
    """A prompt given as token ids (a non-empty list/tuple of ints or a 1D tensor) rather than text/messages."""
    if isinstance(p, torch.Tensor):
        return p.dim() == 1
    return isinstance(p, (list, tuple)) and bool(p) and all(isinstance(t, int) for t in p)


def _ragged_mask(lengths: list[int], W: int, tree_allowed: torch.Tensor, dtype, device) -> torch.Tensor:
    """[B, 1, N, W + N] additive mask, built on the device: row b's N new nodes (written at slots
    [W, W + N)) see its cache [0, lengths[b]) and, among the new slots, what tree_allowed[b] ([N, N] bool)
    allows; the gap [lengths[b], W) is hidden."""
    B, N, _ = tree_allowed.shape
    prefix = torch.arange(W, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]  # [B, W]
    allowed = torch.cat([prefix[:, None, :].expand(B, N, W), tree_allowed.to(device)], dim=-1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def _compact(cache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Per row b: slots dst[b] <- slots src[b] (padding entries copy a slot onto itself). Advanced
    indexing, not gather/scatter with an expanded index: those took ~35 ms per layer buffer on a CPU
    at 2,000 slots (and grew with the slots); this takes ~15 us."""
    rows = torch.arange(src.shape[0], device=src.device)[:, None]
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        for name in ("k_buf", "v_buf"):
            buf = getattr(layer, name)
            buf[rows, :, dst] = buf[rows, :, src]  # [B, N, heads, dim] read first, then written


def _select_rows(cache, keep: torch.Tensor) -> None:
    """Drop the cache rows of finished sequences: the kept rows move to the front of the same buffers
    (allocated once, never grown) and the layers see only those rows from now on."""
    n = keep.numel()
    if not torch.equal(keep.cpu(), torch.arange(n)):
        for layer in cache.layers:
            for name in ("full_k", "full_v"):
                buf = getattr(layer, name)
                buf[:n] = buf[keep]
    _use_rows(cache, 0, n)


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
