from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..tree import DraftTree
from .base import DecodeState, Drafter, RowStates, Verdict
from .prompt_lookup import PromptLookupDrafter


@dataclass
class HybridRow:
    """How one sequence's last tree was made."""

    mode: str = "merge"  # "lookup-only", "lookup", "inner" or "merge"
    inner_n: int = 0  # nodes that came from the inner drafter (indices before reordering < this)
    order: list[int] = field(default_factory=list)  # merged BFS position -> index before reordering
    chain: list[int] = field(default_factory=list)  # indices before reordering of prompt lookup's chain


class LookupHybridDrafter(Drafter):
    """Prompt lookup on top of another drafter (methods `pld+medusa`, `pld+hydra`, `pld+hydra++`, `pld+draft`).

    Text that repeats its context (code that restates the prompt's signature, edits, quotes) is what
    prompt lookup drafts best; everything else is what trained heads draft best. Greedy decoding merges
    both into one tree: prompt lookup's chain is walked down the inner drafter's tree while its tokens
    match existing nodes, and the rest hangs below as a chain, so one verify forward checks both and
    the step accepts whichever path the target agrees with longest.

    Sampling (lossless or typical) needs every set of siblings drawn from one q, so there the step
    uses one drafter's whole tree: prompt lookup's chain when it finds a match (deterministic, so
    lossless stays exact), otherwise the inner drafter's tree. The inner drafter still sees every
    step (a Hydra++ prefix layer must be fed every committed state).

    With ``prefer_lookup`` (method `pld+draft`) a step that finds a prompt-lookup match verifies that chain
    alone and does not run the inner drafter, whose forward would cost more than its tokens add there (a
    draft model); the inner drafter catches up on the committed tokens at its next proposal.
    """

    def __init__(self, inner: Drafter, lookup: PromptLookupDrafter | None = None, prefer_lookup: bool = False):
        self.inner = inner
        self.lookup = lookup or PromptLookupDrafter()
        self.prefer_lookup = prefer_lookup
        self.name = f"pld+{inner.name}"
        self.needs_hidden = inner.needs_hidden
        self.max_nodes = inner.max_nodes + self.lookup.max_nodes
        self.rows: RowStates[HybridRow] = RowStates(lambda s: HybridRow())

    def propose(self, states: list[DecodeState]) -> list[DraftTree]:
        chains = [self.lookup.propose([s])[0] if self.prefer_lookup else None for s in states]
        asks = [j for j, c in enumerate(chains) if c is None or not len(c)]
        out: list[DraftTree] = list(chains)
        for j in range(len(states)):
            if j not in asks:  # the inner drafter is not run this step; it catches up later
                self.rows.of(states[j]).mode = "lookup-only"
        trees = self.inner.propose([states[j] for j in asks]) if asks else []
        for j, tree in zip(asks, trees):
            s, row = states[j], self.rows.of(states[j])
            chain = chains[j] if chains[j] is not None else self.lookup.propose([s])[0]
            if not s.sampling.greedy:
                row.mode = "lookup" if len(chain) else "inner"
                out[j] = chain if len(chain) else tree
            else:
                row.mode = "merge"
                out[j] = merge(row, tree, chain)
        return out

    def forget(self) -> None:
        self.inner.forget()

    def observe(self, states: list[DecodeState], verdicts: list[Verdict]) -> None:
        inner_s, inner_v = [], []
        for s, v in zip(states, verdicts):
            row = self.rows.get(s)
            if row is None:
                continue
            if row.mode == "lookup-only":
                self.lookup.observe([s], [v])
                continue
            if row.mode in ("lookup", "inner"):
                mine = row.mode == "lookup"
                self.lookup.observe([s], [v if mine else Verdict([], 0)])
                inner_s.append(s)
                inner_v.append(Verdict([], 0) if mine else v)
                continue
            lookup_v, inner = split_verdict(row, v)
            self.lookup.observe([s], [lookup_v])
            inner_s.append(s)
            inner_v.append(inner)
        if inner_s:
            self.inner.observe(inner_s, inner_v)


def merge(row: HybridRow, tree: DraftTree, chain: DraftTree) -> DraftTree:
    """Prompt lookup's chain walked down the inner tree while its tokens match existing nodes, the rest
    hung below as a chain; BFS order again (new nodes after the inner nodes of their depth)."""
    tokens = tree.tokens.tolist()
    parents = list(tree.parents)
    row.inner_n = len(parents)
    kids: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(tokens, parents)):
        kids.setdefault(p, {}).setdefault(t, i)
    node, path = -1, []
    for t in chain.tokens.tolist():
        nxt = kids.get(node, {}).get(t) if node < row.inner_n else None
        if nxt is None:  # leave the inner tree: append a new node under `node`
            nxt = len(tokens)
            tokens.append(t)
            parents.append(node)
        path.append(nxt)
        node = nxt
    row.chain = path
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    order = sorted(range(len(tokens)), key=lambda i: (depth[i], i))
    pos = {old: new for new, old in enumerate(order)}
    row.order = order
    return DraftTree(torch.tensor([tokens[i] for i in order], dtype=torch.long),
                     tuple(-1 if parents[i] < 0 else pos[parents[i]] for i in order))


def split_verdict(row: HybridRow, v: Verdict) -> tuple[Verdict, Verdict]:
    """A merged tree's verdict as prompt lookup's and the inner drafter's."""
    old = [row.order[i] for i in v.accepted]
    n_chain = 0
    while n_chain < min(len(old), len(row.chain)) and old[n_chain] == row.chain[n_chain]:
        n_chain += 1
    seen = set(row.order[: v.verified])
    inner = []
    for i in old:  # the inner nodes on the path form its prefix
        if i >= row.inner_n:
            break
        inner.append(i)
    lookup_seen = sum(1 for i in row.chain if i in seen)
    inner_seen = sum(1 for i in seen if i < row.inner_n)
    return Verdict(list(range(n_chain)), lookup_seen), Verdict(inner, inner_seen)
