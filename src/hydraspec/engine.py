"""The decoding engine: many sequences share every target forward, each accepts on its own, and sequences
join and leave at step boundaries (continuous batching).

One step, as data flows through it (one method each, over one :class:`StepRecord`)::

    propose   trees = drafter.propose(states), cut by the policy     [B] DraftTree
    verify    one forward over every row's tree                      logits [T, vocab], hidden [T, dim]
    accept    per row: accepted path + recovered/bonus token         [B] Acceptance
    compact   the cache keeps each row's accepted path               one gather/scatter per layer
    advance   tokens, stop rules, streaming hooks                    finished rows
    observe   drafter.observe(states, verdicts); policy.update(...)

Layout. One SpecCache holds up to ``rows`` rows. Row b's cache content lives at slots [0, L_b)
(left-aligned, its own length L_b); slots [L_b, W) of a shorter row are a masked gap, where W = max_b L_b
is the shared write pointer. One verify forward writes every row's verify tree (pending token + drafts) at
slots [W, W + N) (N = the largest tree) and sees a 4D additive mask per row: a node attends to its row's
[0, L_b) and to its own tree ancestors. Where the backend's attention runs (hydraspec.verify.verify_rows),
the rows' nodes go through the model packed, as one sequence of sum-of-tree-sizes tokens, so a row pays the
linear layers for its own nodes only; elsewhere each tree is padded to N with dummy nodes. Position ids are
per row: L_b + depth. After acceptance each row moves its own accepted path from W + path to L_b + i and
L_b grows by the path length. Rows that finish (EOS, token budget, stop string, cancellation) leave the
cache at once; a waiting request takes a free row at the next step and reads its prompt: whole, on its
own, where no row decodes; else a chunk a step inside the decoding forwards, the last chunk as the lead of
its first verify tree. The caches are allocated once, for ``rows`` rows of ``capacity`` slots, and reused. With a
prefix pool (hydraspec.prefix_pool) a joining row first takes the longest cached prefix of its prompt and
reads only the rest; a leaving row leaves its tokens there. A drafter that reads hidden states gets those of
what the target computes: not of a cached prefix, nor of a prompt read in chunks.

Guarantee: every request's output is what it would be decoded alone (greedy: token for token; sampling:
the same distribution, and with its own seed the same draws), whatever runs beside it. Each request
carries its own sampling settings, token budget and stop strings.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .accept import ACCEPTORS, Acceptance, fit_vocab
from .cache import allocate_rows, compact, fill_holes, new_cache, prefill_rows, select_rows, use_rows
from .drafters.base import DecodeState, Drafter, NoDrafter, Verdict
from .errors import HydraspecError
from .policy import DraftPolicy, RowStep, StepReport
from .prefix_pool import PrefixPool
from .results import GenerationResult, Stats
from .sampling import Sampling
from .tree import DraftTree, TreeShape, after_lead, chain, shape_of
from .verify import can_pack, verify_rows

__all__ = ["Request", "Engine", "cancelled_result", "stop_at", "trim_after_stop"]


@dataclass(eq=False)
class Request:
    """One sequence to decode. ``on_tokens(request, ids)`` (optional) is called after every step with the
    tokens that step added (stop-string cuts applied); ``result`` is set when the request is finished."""

    ids: list[int]
    max_new_tokens: int
    sampling: Sampling = field(default_factory=lambda: Sampling(0.0, 0, 1.0))
    seed: int | None = None
    stops: list[str] = field(default_factory=list)
    on_tokens: Callable | None = None
    tag: object = None  # the caller's handle (e.g. the input position)
    prediction: list[int] | None = None  # token ids the answer is expected to mostly repeat (a draft source)
    result: GenerationResult | None = None
    cancelled: bool = False


def cancelled_result(req: Request) -> GenerationResult:
    """The result of a request cancelled before it produced anything that is kept."""
    return GenerationResult(text="", token_ids=[], prompt_ids=list(req.ids), stats=Stats(), finish_reason="cancelled")


@dataclass
class _Row:
    req: Request
    state: DecodeState  # the row's one token history: state.tokens = prompt + answer
    gen: torch.Generator | None
    stats: Stats
    finish: str = "length"
    length: int = 0  # this row's cache length L_b
    done: bool = False
    t_start: float = 0.0  # when the row was admitted (its latency runs from here)
    order: int = 0  # admission order: prompt chunks go to the earliest admitted reading rows first
    hidden_log: list | None = None  # keep_hidden: the target's last hidden states, in position order
    reading: bool = True  # its prompt is not all in the cache yet (it does not decode)

    @property
    def new(self) -> list[int]:
        return self.state.tokens[self.state.prompt_len:]

    @property
    def unread(self) -> int:
        """Prompt tokens (all but the last, the pending one) not yet in the cache."""
        return max(0, self.state.prompt_len - 1 - self.length)


@dataclass
class StepRecord:
    """One step's data as it flows through the phases; B running rows, T verify nodes over all rows."""

    rows: list[_Row]  # [B] the decoding rows, in cache order
    started: float  # perf_counter at the start of the step
    where: list[int] = field(default_factory=list)  # [B] each decoding row's index into the engine's rows
    chunks: dict[int, list[int]] = field(default_factory=dict)  # row index -> prompt tokens it reads this step
    leads: dict[int, list[int]] = field(default_factory=dict)  # decoding row index -> the rest of its prompt,
    # read in this forward just before its verify tree (the row's first step: it decodes as it finishes reading)
    width: int = 0  # N: the largest verify tree (or chunk); the forward writes slots [W, W + N)
    drafted: bool = False  # whether the drafter was asked
    trees: list[DraftTree] = field(default_factory=list)  # [B] each row's proposal, as verified
    shapes: list[TreeShape] = field(default_factory=list)  # [B] verify trees (node 0: the pending token)
    nodes: list[list[int]] = field(default_factory=list)  # [B] verify-tree tokens: pending token + drafts
    logits: torch.Tensor | None = None  # [T, vocab] float32
    hidden: torch.Tensor | None = None  # [T, dim] last hidden states, when anyone reads them
    first: list[int] = field(default_factory=list)  # [B] row b's first index into logits / hidden
    accepted: list[Acceptance] = field(default_factory=list)  # [B] accepted path + next token
    emitted: list[list[int]] = field(default_factory=list)  # [B] tokens each row kept

    @property
    def states(self) -> list[DecodeState]:
        return [r.state for r in self.rows]

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the step's forward reads beside the trees (chunks and leads)."""
        return sum(len(c) for c in self.chunks.values()) + sum(len(c) for c in self.leads.values())


def charge(rows: list[_Row], what: str, seconds: float, share: bool = True) -> None:
    """Add ``seconds`` to each row's stats field ``what``: split evenly, or whole to each (a shared forward)."""
    each = seconds / len(rows) if share else seconds
    for r in rows:
        setattr(r.stats, what, getattr(r.stats, what) + each)


class Engine:
    """Step-wise speculative decoding of up to ``rows`` sequences at once over caches of ``capacity`` slots.

    ``add(request)`` queues a request; ``step()`` admits waiting requests into free rows, runs one
    propose / verify / accept step for every running row and returns the requests that finished;
    ``cancel(request)`` drops it at the next step boundary. eos: the token ids that end a sequence.
    policy: how much of each proposal is verified (hydraspec.policy; default: all of it). keep_hidden: each
    result also carries the target's last hidden states. packed: verify the rows packed where the backend
    allows (hydraspec.verify.can_pack). prefix_pool: keys and values of earlier sequences to start from
    (hydraspec.prefix_pool). prefill_chunk: while rows decode, a joining row reads its prompt this many
    tokens a step inside the decoding forward (packed rows only), so the running rows keep advancing; 0, or
    when no row decodes: the prompt is read whole at admission."""

    def __init__(self, model, tokenizer, drafter: Drafter | None, eos: set[int], *, rows: int, capacity: int,
                 acceptor: str | None = None, typical: dict | None = None, policy: DraftPolicy | None = None,
                 keep_hidden: bool = False, packed: bool = True, prefix_pool: PrefixPool | None = None,
                 prefill_chunk: int = 0):
        self.model, self.tokenizer, self.eos = model, tokenizer, set(eos)
        self.device, self.dtype = model.device, model.dtype
        self.drafter = drafter or NoDrafter()
        self.acceptor, self.typical = acceptor, typical or {}
        self.policy = policy or DraftPolicy()
        self.keep_hidden, self.packed = keep_hidden, packed and can_pack(model)
        self.rows, self.capacity = rows, capacity
        self.need_hidden = keep_hidden or self.drafter.needs_hidden
        # a drafter reading hidden states reads those of what the target computes (the prompt after a cached
        # prefix; none of a chunked prompt); kept hidden states (a learner's data) cover whole prompts
        self.prefix_pool = None if keep_hidden else prefix_pool
        self.prefill_chunk = 0 if keep_hidden or not self.packed else max(0, int(prefill_chunk))
        with torch.inference_mode():  # inference tensors wherever the engine is built, as every step makes them
            self.cache = new_cache(model, capacity)
            allocate_rows(self.cache, model, rows)
        self.waiting: list[Request] = []
        self.active: list[_Row] = []
        self.forwards = 0
        self.admissions = self.admitted = 0  # admission steps, rows admitted
        self.last_verify_s, self.last_rows = 0.0, 0

    # -- the queue ------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if not req.ids:
            raise HydraspecError("empty prompt")
        need = self.slots(req)
        if need > self.capacity:
            raise HydraspecError(f"prompt ({len(req.ids)} tokens) + max_new_tokens ({req.max_new_tokens}) needs "
                                 f"{need} cache slots; the engine holds {self.capacity}")
        self.waiting.append(req)

    def slots(self, req: Request) -> int:
        return len(req.ids) + req.max_new_tokens + self.drafter.max_nodes + 1

    def cancel(self, req: Request) -> None:
        req.cancelled = True

    def forget(self) -> None:
        """Drop what finished requests left for later ones: the prefix pool's entries and the drafter's memory
        of earlier answers (between steps; requests in flight are unaffected)."""
        if self.prefix_pool is not None:
            self.prefix_pool.clear()
        self.drafter.forget()

    @property
    def busy(self) -> bool:
        return bool(self.active or self.waiting)

    def _accept_name(self, sampling: Sampling) -> str:
        return "greedy" if sampling.greedy else (self.acceptor or "lossless")

    # -- admission --------------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Waiting requests take free rows, each starting from the longest prefix the pool holds; the rest of
        their prompts is read whole now where no row decodes (nobody waits), else a chunk a step inside the
        decoding forwards (``_record``)."""
        k = min(self.rows - len(self.active), len(self.waiting))
        if k > 0:
            t0 = time.perf_counter()
            new = [self._new_row(req) for req in self.waiting[:k]]
            del self.waiting[:k]
            for i, r in enumerate(new):
                r.t_start, r.order = t0, self.admitted + i
                r.length = self._reuse(len(self.active) + i, r)
            self.active.extend(new)
            use_rows(self.cache, 0, len(self.active))
            self.admissions += 1
            self.admitted += k
        for r in self.active:
            if r.reading and not r.unread:
                self._done_reading(r)
        if not self.prefill_chunk or all(r.reading for r in self.active):
            self._read_whole()

    def _read_whole(self) -> None:
        """Every reading row's unread prompt into the cache, one forward each (a prefill is compute-bound)."""
        reading = [(b, r) for b, r in enumerate(self.active) if r.reading]
        for b, r in reading:
            h = prefill_rows(self.model, self.cache, b, [r.req.ids[r.length:-1]], self.need_hidden, [r.length])[0]
            r.length = len(r.req.ids) - 1
            if h is not None:
                r.state.hidden, r.state.new_hidden = h[-1], h
                if self.keep_hidden:
                    r.hidden_log.append(h.clone())
            self._done_reading(r)
        if reading:  # (a row's read used its own row of the cache: every row again)
            use_rows(self.cache, 0, len(self.active))

    @staticmethod
    def _done_reading(r: _Row) -> None:
        r.reading = False
        r.stats.prefill_s = time.perf_counter() - r.t_start

    def _reuse(self, row: int, r: _Row) -> int:
        """Cache row ``row`` takes the longest prefix of the prompt that the prefix pool holds; its length."""
        n = self.prefix_pool.load(self.cache, row, r.req.ids[:-1]) if self.prefix_pool is not None else 0
        if n:
            r.state.counters["cached_tokens"] = n
        return n

    def _new_row(self, req: Request) -> _Row:
        gen = None
        if not req.sampling.greedy or self._accept_name(req.sampling) == "typical":
            gen = torch.Generator().manual_seed(req.seed if req.seed is not None else torch.seed())
        state = DecodeState(tokens=list(req.ids), prompt_len=len(req.ids), sampling=req.sampling, generator=gen,
                            capacity=self.slots(req), prediction=req.prediction)
        return _Row(req=req, state=state, gen=gen, stats=Stats(prompt_tokens=len(req.ids)),
                    hidden_log=[] if self.keep_hidden else None)

    # -- one step -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Admit waiting requests, drop cancelled rows, run one propose / verify / accept step; returns the
        requests finished in this step (their ``result`` set)."""
        done = self._drop_cancelled()
        self._admit()
        if not self.active:
            return done
        rec = self._record()
        self._propose(rec)
        self._verify(rec)
        self._accept(rec)
        self._compact(rec)
        finished = self._advance(rec)
        self._observe(rec)
        self._leave(finished, None, done)
        return done

    def _drop_cancelled(self) -> list[Request]:
        done = [q for q in self.waiting if q.cancelled]
        for q in done:
            q.result = cancelled_result(q)
        self.waiting = [q for q in self.waiting if not q.cancelled]
        self._leave([b for b, r in enumerate(self.active) if r.req.cancelled], "cancelled", done)
        return done

    def _record(self) -> StepRecord:
        """The step's decoding rows, and the prompt chunks reading rows take (within the chunk budget and the
        cache's room above the write pointer). A reading row whose rest of the prompt and pending token both fit
        in what is left of the budget reads that rest as the lead of its first verify tree (``rec.leads``) and
        decodes in this step: its first token comes a step sooner."""
        where = [a for a, r in enumerate(self.active) if not r.reading]
        rec = StepRecord(rows=[], started=time.perf_counter(), where=where)
        if len(where) < len(self.active):  # a row is reading its prompt
            room = self.capacity - max(r.length for r in self.active)
            budget = min(self.policy.prefill(len(where), self.prefill_chunk), room)
            for a, r in sorted(enumerate(self.active), key=lambda ar: ar[1].order):
                if r.reading and budget > 0:
                    n = min(r.unread, budget)
                    if n == r.unread < budget and n + 1 + self.drafter.max_nodes <= room:
                        rec.leads[a], budget = r.req.ids[r.length:r.length + n], budget - n - 1
                        self._done_reading(r)
                    else:
                        rec.chunks[a], budget = r.req.ids[r.length:r.length + n], budget - n
            rec.where = sorted(where + list(rec.leads))
        rec.rows = [self.active[a] for a in rec.where]
        return rec

    def _propose(self, rec: StepRecord) -> None:
        """Each row's draft tree: the drafter's proposal within the policy's limit and the row's token budget,
        then cut by the policy."""
        t0 = time.perf_counter()
        extra = rec.prompt_tokens
        limit = self.policy.limit(len(rec.rows), extra)
        rec.drafted = limit != 0
        self.drafter.beside, self.drafter.readers, self.drafter.limit = extra, len(rec.chunks), limit
        trees = self.drafter.propose(rec.states) if rec.drafted else [DraftTree.empty() for _ in rec.rows]
        trees = [self._fit(t, r, limit) for t, r in zip(trees, rec.rows)]
        rec.trees = self.policy.cut(trees, rec.states, extra) if rec.drafted else trees
        rec.shapes = [shape_of(t.with_root()) for t in rec.trees]
        rec.nodes = [[r.state.tokens[-1]] + t.tokens.tolist() for r, t in zip(rec.rows, rec.trees)]
        charge(rec.rows, "draft_s", time.perf_counter() - t0)

    @staticmethod
    def _fit(tree: DraftTree, row: _Row, limit: int | None) -> DraftTree:
        """At most ``limit`` nodes, and no deeper than the row's remaining token budget needs."""
        if limit is not None and len(tree) > limit:
            tree = tree.head(limit)
        depth = shape_of(tree.with_root()).depth
        remaining = row.req.max_new_tokens - len(row.new)
        if int(depth[-1]) > remaining - 1:
            tree = tree.head(int((depth <= remaining - 1).sum()) - 1)
        return tree

    def _verify(self, rec: StepRecord) -> None:
        """One forward over every row's tree (after its lead, if any) and every prompt chunk (packed where the
        backend can, else padded to N nodes); logits only where a tree needs them."""
        t0 = time.perf_counter()
        nodes, shapes = [[] for _ in self.active], [shape_of(()) for _ in self.active]
        skip = [0] * len(self.active)  # each row's first nodes whose logits no one reads
        for b, a in enumerate(rec.where):
            lead = rec.leads.get(a, [])
            nodes[a], shapes[a], skip[a] = lead + rec.nodes[b], after_lead(len(lead), rec.shapes[b]), len(lead)
        for a, chunk in rec.chunks.items():
            nodes[a], shapes[a], skip[a] = chunk, shape_of(chain(len(chunk))), len(chunk)
        rec.width = max(s.size for s in shapes)
        rec.logits, rec.hidden, first = verify_rows(
            self.model, self.cache, nodes, shapes, [r.length for r in self.active], self.need_hidden,
            self.packed, self.device, self.dtype, skip)
        rec.first = [first[a] for a in rec.where]
        self.forwards += 1
        self.last_verify_s, self.last_rows = time.perf_counter() - t0, len(rec.rows)
        charge(rec.rows, "verify_s", self.last_verify_s, share=False)

    def _accept(self, rec: StepRecord) -> None:
        """Per row: the accepted path and the recovered or bonus token (hydraspec.accept)."""
        t0 = time.perf_counter()
        vocab = rec.logits.shape[-1]
        for b, (r, tree, shape) in enumerate(zip(rec.rows, rec.trees, rec.shapes)):
            q = tree.q if tree.q is None or tree.q.shape[-1] == vocab else fit_vocab(tree.q, vocab)
            name = self._accept_name(r.state.sampling)
            logits = rec.logits[rec.first[b]:rec.first[b] + shape.size]
            rec.accepted.append(ACCEPTORS[name](shape, rec.nodes[b], logits, q=q, sampling=r.state.sampling,
                                                generator=r.gen, **(self.typical if name == "typical" else {})))
        charge(rec.rows, "accept_s", time.perf_counter() - t0)

    def _compact(self, rec: StepRecord) -> None:
        """Every row's accepted path, and every chunk read, moves next to its prefix (one gather/scatter per
        layer for the batch); a row whose prompt is now all in the cache decodes from the next step."""
        paths = [[] for _ in self.active]
        for b, a in enumerate(rec.where):
            lead = len(rec.leads.get(a, ()))
            paths[a] = list(range(lead)) + [lead + i for i in rec.accepted[b].path]
        for a, chunk in rec.chunks.items():
            paths[a] = list(range(len(chunk)))
        B, N = len(self.active), rec.width
        W = max(r.length for r in self.active)
        src = torch.full((B, N), W + N - 1, dtype=torch.long)
        dst = torch.full((B, N), W + N - 1, dtype=torch.long)
        for a, (r, path) in enumerate(zip(self.active, paths)):
            k = len(path)
            src[a, :k] = W + torch.tensor(path, dtype=torch.long)
            dst[a, :k] = r.length + torch.arange(k)
            r.length += k
        compact(self.cache, src.to(self.device), dst.to(self.device))
        for a in rec.chunks:
            if not self.active[a].unread:
                self._done_reading(self.active[a])

    def _advance(self, rec: StepRecord) -> list[int]:
        """Tokens, stop rules, hidden states and streaming hooks; returns the rows that finished (indices
        into the engine's rows)."""
        finished = []
        for b, (r, acc) in enumerate(zip(rec.rows, rec.accepted)):
            emitted = self._emit(r, [rec.nodes[b][i] for i in acc.path[1:]] + [acc.next_token])
            rec.emitted.append(emitted)
            r.stats.target_forwards += 1
            if rec.hidden is not None:
                rows = [rec.first[b] + i for i in acc.path]
                r.state.hidden, r.state.new_hidden = rec.hidden[rows[-1]], rec.hidden[rows]
                if self.keep_hidden:
                    r.hidden_log.append(r.state.new_hidden)
            if r.req.on_tokens is not None and emitted:
                r.req.on_tokens(r.req, emitted)
            if r.done:
                r.stats.wall_s = time.perf_counter() - r.t_start
                finished.append(rec.where[b])
        return finished

    def _observe(self, rec: StepRecord) -> None:
        """The drafter learns each row's verdict (the last step too); the policy what the step cost."""
        t0 = time.perf_counter()
        if rec.drafted:
            verdicts = [Verdict([i - 1 for i in acc.path[1:]], len(t)) for acc, t in zip(rec.accepted, rec.trees)]
            self.drafter.observe(rec.states, verdicts)
        steps = [RowStep(r.state.key, r.state.tokens, int(s.depth[-1]), len(acc.path) - 1, r.done)
                 for r, s, acc in zip(rec.rows, rec.shapes, rec.accepted)]
        read = sum(len(n) for n in rec.nodes) + rec.prompt_tokens
        self.drafter.step_took(len(self.active), read, self.last_verify_s)
        self.policy.update(StepReport(len(rec.rows), rec.drafted, time.perf_counter() - rec.started,
                                      sum(len(e) for e in rec.emitted), steps, read, len(rec.chunks),
                                      len(rec.leads)))
        charge(rec.rows, "draft_s", time.perf_counter() - t0)

    # -- leaving --------------------------------------------------------------------------------------
    def _leave(self, gone: list[int], finish: str | None, done: list[Request]) -> None:
        """Rows ``gone`` (indices into active) leave the batch; their requests get their results."""
        if not gone:
            return
        for b in gone:
            r = self.active[b]
            if finish is not None:
                r.finish = finish
                r.stats.wall_s = time.perf_counter() - r.t_start
            r.state.done = True
            if self.prefix_pool is not None:  # its cache holds tokens [0, length): kept for later requests
                self.prefix_pool.store(self.cache, b, r.state.tokens[:min(r.length, len(r.state.tokens))])
            r.req.result = self._result(r)
            done.append(r.req)
        keep = fill_holes(len(self.active), gone)
        self.active[:] = [self.active[b] for b in keep]
        select_rows(self.cache, keep, [r.length for r in self.active])

    def _emit(self, r: _Row, emitted: list[int]) -> list[int]:
        """The stop rules: EOS (kept), token budget, stop strings. Returns the tokens that stay."""
        max_new, stops, tokens = r.req.max_new_tokens, r.req.stops, r.state.tokens
        n_before = len(r.new)
        cut = len(emitted)
        for i, t in enumerate(emitted):
            if t in self.eos:
                cut, r.finish = i + 1, "eos"
                break
        if n_before + cut >= max_new and r.finish != "eos":
            cut = max_new - n_before
        tokens.extend(emitted[:cut])
        if stops:
            hit = stop_at(self.tokenizer, r.new, n_before, stops)
            if hit is not None:
                del tokens[r.state.prompt_len + hit:]
                r.finish = "stop"
        kept = tokens[r.state.prompt_len + n_before:]
        r.stats.count(len(kept))
        r.done = r.finish != "length" or len(r.new) >= max_new
        return kept

    def _result(self, r: _Row) -> GenerationResult:
        new = r.new
        r.stats.new_tokens = len(new)
        r.stats.counters = dict(r.state.counters)
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        if r.finish == "stop":
            text = trim_after_stop(text, r.req.stops)
        hidden = None
        if r.hidden_log is not None:  # positions 0 .. T - 2 (an accepted path may run past a stop)
            hidden = torch.cat(r.hidden_log)[: len(r.state.tokens) - 1]
            r.hidden_log = None
        return GenerationResult(text=text, token_ids=list(new), prompt_ids=list(r.req.ids), stats=r.stats,
                                finish_reason=r.finish, hidden_states=hidden)


def stop_at(tokenizer, new: list[int], n_before: int, stops: list[str]) -> int | None:
    """Smallest token count (> n_before) whose decoded text contains a stop string, or None."""
    if not any(s in tokenizer.decode(new, skip_special_tokens=True) for s in stops):
        return None
    for n in range(n_before + 1, len(new) + 1):
        text = tokenizer.decode(new[:n], skip_special_tokens=True)
        if any(s in text for s in stops):
            return n
    return None


def trim_after_stop(text: str, stops: list[str]) -> str:
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return text[: min(ends)] if ends else text
