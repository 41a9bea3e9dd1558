"""The decoding engine: many sequences share every target forward, each accepts on its own, and sequences
join and leave at step boundaries (continuous batching).

Layout. One SpecCache holds up to ``rows`` rows. Row b's cache content lives at slots [0, L_b)
(left-aligned, its own length L_b); slots [L_b, W) of a shorter row are a masked gap, where W = max_b L_b
is the shared write pointer. One verify forward writes every row's verify tree (pending token + drafts) at
slots [W, W + N) (N = the largest tree) and sees a 4D additive mask per row: a node attends to its row's
[0, L_b) and to its own tree ancestors. Where the backend's attention runs (hydraspec.verify.verify_rows),
the rows' nodes go through the model packed, as one sequence of sum-of-tree-sizes tokens, so a row pays the
linear layers for its own nodes only; elsewhere each tree is padded to N with dummy nodes that see only
themselves, nobody sees them, and they are never accepted. Position ids are per row: L_b + depth. After
acceptance each row moves its own accepted path from W + path to L_b + i (one gather/scatter per layer
for the whole batch) and L_b grows by the path length. Rows that finish (EOS, token budget, stop string,
cancellation) leave the cache and later forwards at once; a waiting request takes a free row at the next
step: it is prefilled on its own and joins that step. The caches are allocated once, for ``rows`` rows of
``capacity`` slots, and reused.

Guarantee: every request's output is what it would be decoded alone (greedy: token for token; sampling:
the same distribution, and with its own seed the same draws), whatever runs beside it. Each request
carries its own sampling settings, token budget and stop strings.

Drafters are per-sequence objects: one row decodes with the engine's drafter itself, every other row with
its own ``drafter.fork()`` (models and heads are shared, per-sequence state is not). Drafters that can
share work across rows do it themselves: a drafter's ``batch_state`` (draft-model chains: one B-row draft
cache in the same layout, one draft forward per depth) drafts for every row in place of the rows' own
drafters; otherwise ``propose_batch`` (Medusa/Hydra heads: one heads call per depth) or each row's
``propose``. A Medusa/Hydra drafter can use a different static tree per number of active rows
(``trees={batch_size: paths}``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .accept import ACCEPTORS, fit_vocab
from .cache import allocate_rows, compact, new_cache, prefill_rows, select_rows, use_rows
from .drafters.base import DecodeState, Drafter, NoDrafter
from .errors import HydraspecError
from .results import GenerationResult, Stats
from .sampling import Sampling
from .tree import DraftTree, shape_of
from .verify import can_pack, verify_rows

PRIOR_RATE, PRIOR_WEIGHT = 0.5, 20.0
ROW_PRIOR_WEIGHT = 4.0

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
    result: GenerationResult | None = None
    cancelled: bool = False


def cancelled_result(req: Request) -> GenerationResult:
    """The result of a request cancelled before it produced anything that is kept."""
    return GenerationResult(text="", token_ids=[], prompt_ids=list(req.ids), stats=Stats(), finish_reason="cancelled")


@dataclass
class _Row:
    req: Request
    ids: list[int]
    drafter: Drafter
    state: DecodeState
    gen: torch.Generator | None
    stats: Stats
    new: list[int] = field(default_factory=list)
    finish: str = "length"
    length: int = 0  # this row's cache length L_b
    done: bool = False
    t_start: float = 0.0  # when the row was admitted (its latency runs from here)
    accepted_drafts: int = 0  # this row's share of the engine's counts below
    draft_misses: int = 0
    shadow: tuple[int, list[int]] | None = None  # a chain proposal cut before verification: (where, tokens)
    hidden_log: list | None = None  # keep_hidden: the target's last hidden states, in position order


class Engine:
    """Step-wise speculative decoding of up to ``rows`` sequences at once over caches of ``capacity`` slots.

    ``add(request)`` queues a request; ``step()`` admits waiting requests into free rows, runs one
    draft / verify / accept step for every running row and returns the requests that finished;
    ``cancel(request)`` drops it at the next step boundary. eos: the token ids that end a sequence.
    verify_budget: a cap on the tokens one verify forward holds over the whole batch; each row's draft is
    cut to max(1, budget // rows - 1) nodes (its first nodes, so still a tree). draft_cap: instead, a
    function of the number of running rows giving each row's most draft nodes (0: no drafting that step);
    if it also has ``widths(rows, lengths, rates)`` (hydraspec.adaptive.AdaptiveDraft), that cuts each row's
    actual proposal given the rows' acceptance rates. Cutting a draft only drops candidates; the output is
    unchanged. packed: verify the rows packed where the backend allows (hydraspec.verify.can_pack)."""

    def __init__(self, model, tokenizer, drafter: Drafter | None, eos: set[int], *, rows: int, capacity: int,
                 acceptor: str | None = None, typical: dict | None = None,
                 trees: list[tuple[int, Drafter]] | None = None, verify_budget: int | None = None,
                 draft_cap: Callable[[int], int] | None = None, keep_hidden: bool = False, packed: bool = True):
        self.model, self.tokenizer, self.eos = model, tokenizer, set(eos)
        self.device, self.dtype = model.device, model.dtype
        self.drafter = drafter or NoDrafter()
        self.acceptor, self.typical = acceptor, typical or {}
        self.trees = trees or []
        self.verify_budget, self.draft_cap = verify_budget, draft_cap
        self.keep_hidden, self.packed = keep_hidden, packed and can_pack(model)
        self.rows, self.capacity = rows, capacity
        self.need_hidden = keep_hidden or self.drafter.needs_hidden or any(d.needs_hidden for _, d in self.trees)
        self.max_nodes = max([self.drafter.max_nodes] + [d.max_nodes for _, d in self.trees])
        with torch.inference_mode():  # inference tensors wherever the engine is built, as every step makes them
            self.cache = new_cache(model, capacity)
            allocate_rows(self.cache, model, rows)
            # the drafter's own state for drafting every row at once (None: the rows' drafters draft)
            self.draft_batch = self.drafter.batch_state(capacity + self.max_nodes + 1, rows)
        self.waiting: list[Request] = []
        self.active: list[_Row] = []
        self.forwards = 0
        self.admissions = 0
        self.last_verify_s, self.last_rows = 0.0, 0
        # drafted tokens accepted, and row-steps whose draft was cut short by a rejection (a miss): together
        # an estimate of the per-token acceptance rate (accepted / (accepted + misses))
        self.accepted_drafts = 0
        self.draft_misses = 0

    # -- the queue ------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        need = len(req.ids) + req.max_new_tokens + self.max_nodes + 1
        if not req.ids:
            raise HydraspecError("empty prompt")
        if need > self.capacity:
            raise HydraspecError(f"prompt ({len(req.ids)} tokens) + max_new_tokens ({req.max_new_tokens}) needs "
                                 f"{need} cache slots; the engine holds {self.capacity}")
        self.waiting.append(req)

    def cancel(self, req: Request) -> None:
        req.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.active or self.waiting)

    def _drafter_for(self, row: _Row, active: int) -> Drafter:
        chosen = None
        for bs, d in self.trees:
            if bs <= active:
                chosen = d
        return chosen or row.drafter

    def _cap(self, n_active: int) -> int | None:
        if self.draft_cap is not None:
            return max(0, int(self.draft_cap(n_active)))
        return None if self.verify_budget is None else max(1, self.verify_budget // n_active - 1)

    def _admit(self) -> None:
        k = min(self.rows - len(self.active), len(self.waiting))
        if k <= 0:
            return
        t0 = time.perf_counter()
        new = []
        proto_free = all(r.drafter is not self.drafter for r in self.active)
        for req in self.waiting[:k]:
            sampling = req.sampling
            gen = None
            if not sampling.greedy or self._accept_name(sampling) == "typical":
                gen = torch.Generator().manual_seed(req.seed if req.seed is not None else torch.seed())
            state = DecodeState(tokens=list(req.ids), prompt_len=len(req.ids), sampling=sampling, generator=gen)
            new.append(_Row(req=req, ids=list(req.ids), drafter=self._row_drafter(proto_free and not new), state=state, gen=gen,
                            stats=Stats(prompt_tokens=len(req.ids))))
        del self.waiting[:k]
        first = len(self.active)
        # every prompt but its last token (the pending one) into the cache
        hidden = prefill_rows(self.model, self.cache, first, [r.ids[:-1] for r in new], self.need_hidden)
        for r, h in zip(new, hidden):
            r.length = len(r.ids) - 1
            if h is not None:
                r.state.hidden, r.state.new_hidden = h[-1], h
            if self.keep_hidden:
                r.hidden_log = [r.state.new_hidden.clone()] if r.state.new_hidden is not None else []
        if self.draft_batch is not None:
            self.draft_batch.add(first, [r.state for r in new])
        else:
            for r in new:
                r.drafter.start(r.state, len(r.ids) + r.req.max_new_tokens + self.max_nodes + 1)
        use_rows(self.cache, 0, first + len(new))
        t1 = time.perf_counter()
        for r in new:
            r.t_start = t0
            r.stats.prefill_s = t1 - t0
        self.active.extend(new)
        self.admissions += 1

    def _row_drafter(self, proto_free: bool) -> Drafter:
        """The drafter itself for a row while no other row uses it (so a one-row run decodes with the caller's
        object), else a fork."""
        return self.drafter if proto_free else self.drafter.fork()

    def _accept_name(self, sampling: Sampling) -> str:
        return "greedy" if sampling.greedy else (self.acceptor or "lossless")

    # -- one step -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Admit waiting requests, drop cancelled rows, run one draft / verify / accept step; returns the
        requests finished in this step (their ``result`` set)."""
        done: list[Request] = [q for q in self.waiting if q.cancelled]
        for q in done:
            q.result = cancelled_result(q)
        self.waiting = [q for q in self.waiting if not q.cancelled]
        self._leave([b for b, r in enumerate(self.active) if r.req.cancelled], "cancelled", done)
        self._admit()
        if not self.active:
            return done
        model, dev, active = self.model, self.device, self.active
        # 1. drafts, one per row, trimmed to the row's token budget
        n_active = len(active)
        cap = self._cap(n_active)
        t_step, emitted_total = time.perf_counter(), 0
        trees, shapes = [], []
        t0 = time.perf_counter()
        together = None
        if cap != 0:
            if self.draft_batch is not None:  # e.g. draft-model chains: one draft forward per depth
                together = self.draft_batch.propose([r.state for r in active])
            else:  # head drafters: one heads call per depth for every row (None: other drafters)
                together = self._drafter_for(active[0], n_active).propose_batch([r.state for r in active],
                                                                                [r.drafter for r in active])
        if together is not None:
            dt = (time.perf_counter() - t0) / n_active
            for r in active:
                r.stats.draft_s += dt
        for j, r in enumerate(active):
            t0 = time.perf_counter()
            if cap == 0:
                tree = DraftTree.empty()
            else:
                tree = together[j] if together is not None else self._drafter_for(r, n_active).propose(r.state)
            remaining = r.req.max_new_tokens - len(r.new)
            if cap is not None and len(tree.tokens) > cap:
                tree = tree.head(cap)
            shape = shape_of(tree.with_root())
            if int(shape.depth[-1]) > remaining - 1:
                tree = tree.head(int((shape.depth <= remaining - 1).sum()) - 1)
                shape = shape_of(tree.with_root())
            trees.append(tree)
            shapes.append(shape)
            r.stats.draft_s += time.perf_counter() - t0
        if cap != 0 and hasattr(self.draft_cap, "widths"):  # how many of its drafts each row keeps this step
            keep = self.draft_cap.widths(n_active, [len(t) for t in trees], [self.row_rate(r) for r in active])
            for j, w in enumerate(keep):
                if w < len(trees[j]):
                    r = active[j]
                    if r.shadow is None and shapes[j].is_chain:  # its acceptance is counted as decoding goes on
                        r.shadow = (len(r.state.tokens), trees[j].tokens.tolist())
                    trees[j] = trees[j].head(w)
                    shapes[j] = shape_of(trees[j].with_root())
                    if self.draft_batch is None:  # the row's own drafter (a no-op for most) learns of the cut
                        self._drafter_for(r, n_active).cut(w)

        # 2. one verify forward over every row's tree (packed where the backend can, else padded to N nodes)
        t1 = time.perf_counter()
        B = self.last_rows = len(active)
        N = max(s.size for s in shapes)
        W = max(r.length for r in active)
        node_lists = [[r.state.tokens[-1]] + tree.tokens.tolist() for r, tree in zip(active, trees)]
        logits, hid, first = verify_rows(model, self.cache, node_lists, shapes, [r.length for r in active],
                                         self.need_hidden, self.packed, self.device, self.dtype)
        self.forwards += 1
        verify_s = self.last_verify_s = time.perf_counter() - t1

        # 3. per-row acceptance, then one compaction of every row's accepted path
        src = torch.full((B, N), W + N - 1, dtype=torch.long)
        dst = torch.full((B, N), W + N - 1, dtype=torch.long)
        finished = []
        for b, (r, tree, shape) in enumerate(zip(active, trees, shapes)):
            ta = time.perf_counter()
            n = shape.size
            q = tree.q
            if q is not None and q.shape[-1] != logits.shape[-1]:
                q = fit_vocab(q, logits.shape[-1])
            name = self._accept_name(r.state.sampling)
            acc = ACCEPTORS[name](shape, node_lists[b], logits[first[b]:first[b] + n], q=q, sampling=r.state.sampling,
                                  generator=r.gen, **(self.typical if name == "typical" else {}))
            k = len(acc.path)
            if len(tree) and r.shadow is None:
                self._count(r, k - 1, int(k - 1 < int(shape.depth[-1])))
            src[b, :k] = W + torch.tensor(acc.path)
            dst[b, :k] = r.length + torch.arange(k)
            r.length += k
            emitted = self._emit(r, [node_lists[b][i] for i in acc.path[1:]] + [acc.next_token])
            emitted_total += len(emitted)
            if r.shadow is not None:
                self._shadow(r)
            r.stats.target_forwards += 1
            r.stats.verify_s += verify_s
            r.state.hidden = hid[first[b] + acc.path[-1]] if hid is not None else None
            r.state.new_hidden = hid[[first[b] + i for i in acc.path]] if hid is not None else None
            if self.keep_hidden:
                r.hidden_log.append(r.state.new_hidden)
            tb = time.perf_counter()
            r.stats.accept_s += tb - ta
            if r.req.on_tokens is not None and emitted:
                r.req.on_tokens(r.req, emitted)
            if self.draft_batch is not None and cap != 0:
                self.draft_batch.observe(b, len(acc.path) - 1)
            elif len(tree) or r.done:  # the last step too: a drafter sees every verdict
                self._drafter_for(r, n_active).observe(r.state, [i - 1 for i in acc.path[1:]])
            r.stats.draft_s += time.perf_counter() - tb
            if r.done:
                r.stats.wall_s = time.perf_counter() - r.t_start
                finished.append(b)
        if not torch.equal(src, dst):  # a row's accepted chain may already sit where it belongs
            compact(self.cache, src.to(dev), dst.to(dev))
        if cap is not None and hasattr(self.draft_cap, "observe"):  # the rule checks itself against the clock
            self.draft_cap.observe(n_active, max(len(t) for t in trees), time.perf_counter() - t_step, emitted_total)

        # 4. finished rows leave the batch
        self._leave(finished, None, done)
        return done

    def _count(self, r: _Row, accepted: int, miss: int) -> None:
        self.accepted_drafts += accepted
        self.draft_misses += miss
        r.accepted_drafts += accepted
        r.draft_misses += miss

    def _shadow(self, r: _Row) -> None:
        """Count a cut proposal as if it had been verified, once the tokens decoded since show how far it
        would have been accepted (exactly so for greedy rows: greedy verification accepts the drafts that
        equal the target's own next tokens)."""
        at, tokens = r.shadow
        seen = r.state.tokens[at:]
        m = 0
        while m < min(len(seen), len(tokens)) and seen[m] == tokens[m]:
            m += 1
        if m == len(tokens) or m < len(seen):  # all of it would have been accepted, or a token differs
            self._count(r, m, int(m < len(tokens)))
            r.shadow = None
        elif r.done:
            r.shadow = None

    def rate(self) -> float:
        """The per-token acceptance rate of drafts so far, accepted / (accepted + misses), from a prior of
        PRIOR_RATE worth PRIOR_WEIGHT draws."""
        return (self.accepted_drafts + PRIOR_RATE * PRIOR_WEIGHT) / (self.accepted_drafts + self.draft_misses + PRIOR_WEIGHT)

    def row_rate(self, r: _Row) -> float:
        """The same for one row, with the engine's rate as its prior (worth ROW_PRIOR_WEIGHT draws)."""
        return (r.accepted_drafts + self.rate() * ROW_PRIOR_WEIGHT) / (r.accepted_drafts + r.draft_misses + ROW_PRIOR_WEIGHT)

    def _leave(self, gone: list[int], finish: str | None, done: list[Request]) -> None:
        """Rows ``gone`` (indices into active) leave the batch; their requests get their results."""
        if not gone:
            return
        for b in gone:
            r = self.active[b]
            if finish is not None:
                r.finish = finish
                r.stats.wall_s = time.perf_counter() - r.t_start
            r.req.result = self._result(r)
            done.append(r.req)
        keep = [b for b in range(len(self.active)) if b not in set(gone)]
        self.active[:] = [self.active[b] for b in keep]
        select_rows(self.cache, torch.tensor(keep, dtype=torch.long, device=self.device))
        if self.draft_batch is not None:
            self.draft_batch.keep(keep)

    def _emit(self, r: _Row, emitted: list[int]) -> list[int]:
        """The stop rules of SpeculativeGenerator.generate: EOS (kept), token budget, stop strings.
        Returns the tokens that stay."""
        max_new, stops = r.req.max_new_tokens, r.req.stops
        cut = len(emitted)
        for i, t in enumerate(emitted):
            if t in self.eos:
                cut, r.finish = i + 1, "eos"
                break
        if len(r.new) + cut >= max_new and r.finish != "eos":
            cut = max_new - len(r.new)
        emitted = emitted[:cut]
        r.new.extend(emitted)
        if stops:
            n_before = len(r.new) - len(emitted)
            hit = stop_at(self.tokenizer, r.new, n_before, stops)
            if hit is not None:
                del r.new[hit:]
                emitted = emitted[: max(0, hit - n_before)]
                r.finish = "stop"
        r.stats.count(len(emitted))
        r.state.tokens.extend(emitted)
        r.done = r.finish != "length" or len(r.new) >= max_new
        return emitted

    def _result(self, r: _Row) -> GenerationResult:
        r.stats.new_tokens = len(r.new)
        text = self.tokenizer.decode(r.new, skip_special_tokens=True)
        if r.finish == "stop":
            text = trim_after_stop(text, r.req.stops)
        hidden = None
        if r.hidden_log is not None:  # positions 0 .. T - 2 (an accepted path may run past a stop)
            hidden = torch.cat(r.hidden_log)[: len(r.ids) + len(r.new) - 1]
            r.hidden_log = None
        return GenerationResult(text=text, token_ids=list(r.new), prompt_ids=list(r.ids), stats=r.stats,
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
