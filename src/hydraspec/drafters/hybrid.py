from __future__ import annotations

import torch

from ..tree import DraftTree
from .base import DecodeState, Drafter
from .prompt_lookup import PromptLookupDrafter


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
        self._inner_n = 0  # nodes of the last tree that came from the inner drafter (old indices < this)
        self._order: list[int] = []  # merged BFS position -> index before reordering
        self._chain: list[int] = []  # pre-reorder indices of prompt lookup's chain, in order
        self._mode = "merge"

    def fork(self) -> "LookupHybridDrafter":
        twin = LookupHybridDrafter(self.inner.fork(), self.lookup.fork(), self.prefer_lookup)
        twin.name = self.name
        return twin

    def start(self, state: DecodeState, capacity: int) -> None:
        self.inner.start(state, capacity)
        self.lookup.start(state, capacity)

    def propose(self, state: DecodeState) -> DraftTree:
        chain = self.lookup.propose(state) if self.prefer_lookup else None
        if chain is not None and len(chain):  # the inner drafter is not run this step; it catches up later
            self._mode = "lookup-only"
            return chain
        tree = self.inner.propose(state)
        if chain is None:
            chain = self.lookup.propose(state)
        if not state.sampling.greedy:
            self._mode = "lookup" if len(chain) else "inner"
            return chain if len(chain) else tree
        self._mode = "merge"
        tokens = tree.tokens.tolist()
        parents = list(tree.parents)
        self._inner_n = len(parents)
        kids: dict[int, dict[int, int]] = {}
        for i, (t, p) in enumerate(zip(tokens, parents)):
            kids.setdefault(p, {}).setdefault(t, i)
        node, path = -1, []
        for t in chain.tokens.tolist():
            nxt = kids.get(node, {}).get(t) if node < self._inner_n else None
            if nxt is None:  # leave the inner tree: append a new node under `node`
                nxt = len(tokens)
                tokens.append(t)
                parents.append(node)
            path.append(nxt)
            node = nxt
        self._chain = path
        # BFS order again (depth, then index): new nodes go after the inner nodes of their depth
        depth = []
        for p in parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        order = sorted(range(len(tokens)), key=lambda i: (depth[i], i))
        pos = {old: new for new, old in enumerate(order)}
        self._order = order
        return DraftTree(torch.tensor([tokens[i] for i in order], dtype=torch.long),
                         tuple(-1 if parents[i] < 0 else pos[parents[i]] for i in order))

    def observe(self, state: DecodeState, accepted: list[int]) -> None:
        if self._mode == "lookup-only":
            self.lookup.observe(state, accepted)
            return
        if self._mode == "lookup":
            self.lookup.observe(state, accepted)
            self.inner.observe(state, [])
            return
        if self._mode == "inner":
            self.inner.observe(state, accepted)
            self.lookup.observe(state, [])
            return
        old = [self._order[i] for i in accepted]
        n_chain = 0
        while n_chain < min(len(old), len(self._chain)) and old[n_chain] == self._chain[n_chain]:
            n_chain += 1
        self.lookup.observe(state, list(range(n_chain)))
        inner = []
        for i in old:  # the inner nodes on the path form its prefix
            if i >= self._inner_n:
                break
            inner.append(i)
        self.inner.observe(state, inner)
