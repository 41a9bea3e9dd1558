"""Dynamic draft trees (the idea of EAGLE-2, Li et al. 2024): the tree's shape follows the drafter's own
confidence at every step instead of a fixed list of paths.

Each step: the `topk` most probable tokens under the pending token form depth 0; at every further depth
the `topk` nodes of the previous depth with the highest *path score* (sum of log-probabilities along
the path) are expanded with their `topk` most probable children; finally all nodes are reranked by
path score and the best `nodes` are kept. A child's score never exceeds its parent's and a sibling's
never exceeds an earlier sibling's (ties go to the shallower / earlier node), so the kept set is a
tree whose children are always each node's best-ranked ones.

Greedy decoding uses that tree as is (tokens = top-k). Sampling must stay lossless, which needs every
node's children to be draws without replacement from a distribution q that is reported, and the
decision of how many children a node gets must not depend on the values drawn. So in sampling mode the
*shape* (which rank slots exist) is chosen first, by the procedure above on the warped distributions
along the most probable tokens (a deterministic function of the context), and then the slots are
filled depth by depth by drawing each node's children without replacement from the warped
distribution given its sampled path; q is reported in DraftTree.q as for static trees. This costs a
second pass of the drafter for Hydra heads and draft models (Medusa heads do not look at the path, so
their rows are reused).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import HydraspecError
from ..sampling import sample_without_replacement
from ..tree import DraftTree, shape_of
from ..verify import forward_nodes
from .base import DecodeState, Drafter, RowStates
from .draft_model import DraftModelDrafter
from .heads import PrefixInput, PrefixRow, full_vocab_logits


def check_dynamic(nodes: int, depth: int, topk: int, max_depth: int | None = None) -> None:
    if nodes < 1 or depth < 1 or topk < 1:
        raise HydraspecError("a dynamic tree needs --tree-nodes, --tree-depth and --tree-topk >= 1")
    if max_depth is not None and depth > max_depth:
        raise HydraspecError(f"tree depth {depth} exceeds the number of heads ({max_depth})")


def grow_dynamic(root_logp: torch.Tensor, expand: Callable[..., torch.Tensor],
                 nodes: int, depth: int, topk: int):
    """Choose a dynamic tree. root_logp: [V] log-probabilities of depth 0. expand(d, parents, paths) ->
    [len(parents), V] log-probabilities of the children (depth d) of the given nodes, `paths` being each
    node's token path (depth 0 first); expand may also take a fourth argument, each node's own parent
    among the earlier nodes (-1 at depth 0). Returns (parents, ranks, tokens) in BFS order."""
    score: list[float] = []
    dep: list[int] = []
    par: list[int] = []
    rank: list[int] = []
    tok: list[int] = []

    def add(logp: torch.Tensor, parent: int, d: int, base: float) -> list[int]:
        k = min(topk, logp.shape[-1])
        v, ix = torch.topk(logp, k)
        made = []
        for r, (s, t) in enumerate(zip(v.tolist(), ix.tolist())):
            if s == float("-inf"):
                break
            score.append(base + min(s, 0.0))
            dep.append(d)
            par.append(parent)
            rank.append(r)
            tok.append(t)
            made.append(len(tok) - 1)
        return made

    def path(i: int) -> list[int]:
        out = []
        while i >= 0:
            out.append(tok[i])
            i = par[i]
        return out[::-1]

    level = add(root_logp, -1, 0, 0.0)
    for d in range(1, depth):
        if not level:
            break
        frontier = sorted(sorted(level, key=lambda j: (-score[j], j))[:topk])
        logp = expand(d, frontier, [path(j) for j in frontier], [par[j] for j in frontier])
        level = []
        for row, j in enumerate(frontier):
            level += add(logp[row], j, d, score[j])
    kept = sorted(range(len(tok)), key=lambda j: (-score[j], dep[j], j))[:nodes]
    kept_set = set(kept)
    assert all(par[j] < 0 or par[j] in kept_set for j in kept)
    # breadth-first order: by depth, then by the parent's new index, then by rank
    new_index: dict[int, int] = {}
    order: list[int] = []
    for d in range(depth):
        layer = sorted((j for j in kept if dep[j] == d), key=lambda j: (new_index.get(par[j], -1), rank[j]))
        for j in layer:
            new_index[j] = len(order)
            order.append(j)
    parents = tuple(-1 if par[j] < 0 else new_index[par[j]] for j in order)
    return parents, tuple(rank[j] for j in order), [tok[j] for j in order]


def fill_sampled(parents: tuple[int, ...], root_q: torch.Tensor,
                 q_of: Callable[..., torch.Tensor], generator) -> DraftTree:
    """Sampling mode: draw every node's children without replacement from q given the node's sampled
    path. q_of(d, nodes, paths, node_parents) -> [len(nodes), V] the warped distributions of the
    children (depth d) of those nodes. A node whose q has fewer nonzero tokens than children loses the
    extra children."""
    shape = shape_of(parents)
    n = len(parents)
    depth = shape.depth.tolist()
    tokens = [0] * n
    qrows: list[torch.Tensor | None] = [None] * n
    drawn = [False] * n
    q_row = {-1: root_q}
    for d in range((depth[-1] + 1) if n else 0):
        layer = [i for i in range(n) if depth[i] == d]
        kids: dict[int, list[int]] = {}
        for i in layer:
            if parents[i] < 0 or drawn[parents[i]]:
                kids.setdefault(parents[i], []).append(i)
        for p, children in kids.items():
            q = q_row[p]
            for c, x in zip(children, sample_without_replacement(q, len(children), generator).tolist()):
                tokens[c], qrows[c], drawn[c] = x, q, True
        expand = [i for i in layer if drawn[i] and shape.children[i]]
        if expand:
            paths = [[tokens[j] for j in shape.path_to(i)] for i in expand]
            rows = q_of(d + 1, expand, paths, [parents[i] for i in expand])
            for i, row in zip(expand, rows):
                q_row[i] = row
    keep = [i for i in range(n) if drawn[i]]  # parents are drawn before children: prefix-closed
    pos = {old: new for new, old in enumerate(keep)}
    new_parents = tuple(-1 if parents[i] < 0 else pos[parents[i]] for i in keep)
    if not keep:
        return DraftTree.empty()
    return DraftTree(torch.tensor([tokens[i] for i in keep], dtype=torch.long), new_parents,
                     torch.stack([qrows[i] for i in keep]))


def _logp(sampling, logits: torch.Tensor) -> torch.Tensor:
    """Scores for choosing the shape: raw log-softmax in greedy mode, log of the warped q otherwise."""
    if sampling.greedy:
        return torch.log_softmax(logits.float(), -1)
    return torch.log(sampling.probs(logits))


class DynamicHeadDrafter(PrefixInput, Drafter):
    """Medusa / Hydra heads with a dynamic tree of at most `nodes` nodes and `depth` (<= heads) levels."""

    needs_hidden = True

    def __init__(self, heads, embed: torch.nn.Module, nodes: int = 32, depth: int | None = None, topk: int = 8):
        depth = heads.num_heads if depth is None else depth
        check_dynamic(nodes, depth, topk, heads.num_heads)
        self.heads, self.embed = heads, embed
        self.name = heads.kind
        self.nodes, self.depth, self.topk = nodes, depth, topk
        self.max_nodes = nodes
        self.prefix_rows: RowStates[PrefixRow] = RowStates(lambda s: PrefixRow())

    def _logits(self, d: int, h: torch.Tensor, pending: int, paths: list[list[int]]) -> torch.Tensor:
        """Head d's logits for the children (depth d) of nodes whose token paths are `paths` ([] = root)."""
        if self.heads.kind == "medusa":
            return full_vocab_logits(self.heads, self.heads.logits(d, h[None]).float()).expand(len(paths), -1)
        ids = torch.tensor([[pending] + p for p in paths], device=h.device)
        return full_vocab_logits(self.heads, self.heads.logits(d, h[None].expand(len(paths), -1), self.embed(ids)).float())

    def propose(self, states: list[DecodeState]) -> list[DraftTree]:
        return [self.propose_one(s) for s in states]

    @torch.inference_mode()
    def propose_one(self, state: DecodeState) -> DraftTree:
        h = self.head_input(state)
        if h is None:
            return DraftTree.empty()
        s, pending = state.sampling, state.tokens[-1]
        root = self._logits(0, h, pending, [[]])[0]
        parents, _, tokens = grow_dynamic(
            _logp(s, root), lambda d, nodes, paths, _: _logp(s, self._logits(d, h, pending, paths)),
            self.nodes, self.depth, self.topk)
        if s.greedy:
            return DraftTree(torch.tensor(tokens, dtype=torch.long), parents)
        return fill_sampled(parents, s.probs(root),
                            lambda d, nodes, paths, _: s.probs(self._logits(d, h, pending, paths)), state.generator)


class DynamicDraftModelDrafter(DraftModelDrafter):
    """A draft model with a dynamic tree: per depth, one draft forward over the `topk` expanded nodes
    under a tree mask. The draft cache keeps only the verified sequence between steps (the tree's
    entries are dropped; the accepted tokens are fed again with the bonus token on the next step)."""

    name = "draft"

    def __init__(self, model, nodes: int = 32, depth: int = 6, topk: int = 8):
        check_dynamic(nodes, depth, topk)
        super().__init__(model, k=1, dynamic=False)
        self.nodes, self.depth, self.topk = nodes, depth, topk
        self.max_nodes = nodes

    def _capacity(self, capacity: int) -> int:
        return super()._capacity(capacity) + self.topk * self.depth + self.nodes + 1

    def _feeder(self, row, prefix: int):
        """Returns feed(tokens_of_new_nodes, fed_parent_of_each) -> logits rows, growing a tree of fed nodes
        (in BFS order) after `prefix` in the draft cache."""
        fed_parents: list[int] = []
        dev = self.model.device

        def feed(ids: list[int], fed_par: list[int]) -> torch.Tensor:
            start = len(fed_parents)
            fed_parents.extend(fed_par)
            shape = shape_of(tuple(fed_parents))
            anc = None if shape.is_chain else shape.ancestors[start:, :]
            lg, _ = forward_nodes(self.model, row.cache, torch.tensor(ids, dtype=torch.long, device=dev),
                                  (prefix + shape.depth[start:]).to(dev), anc, prefix)
            return lg

        return feed

    @torch.inference_mode()
    def propose_one(self, row, state: DecodeState) -> DraftTree:
        toks, dev = state.tokens, self.model.device
        feed0 = torch.tensor(toks[row.n_cached:], dtype=torch.long, device=dev)
        pos = torch.arange(row.n_cached, len(toks), device=dev)
        logits, _ = forward_nodes(self.model, row.cache, feed0, pos, None, row.n_cached, last_only=True)
        row.n_cached = prefix = len(toks)
        row.n_fed = 0  # observe keeps nothing of the tree in the draft cache
        s = state.sampling
        root = logits[-1]

        def expander(as_q: bool):
            feed = self._feeder(row, prefix)
            fed_of: dict[int, int] = {}  # node -> its index among the fed nodes

            def expand(d, nodes, paths, node_parents):
                # only fed nodes are expanded, so every node's parent (if any) was fed before it
                fed_par = [fed_of[p] if p >= 0 else -1 for p in node_parents]
                for i in nodes:
                    fed_of[i] = len(fed_of)
                lg = feed([p[-1] for p in paths], fed_par)
                return s.probs(lg) if as_q else _logp(s, lg)

            return expand

        # pass 1: the shape, along the most probable tokens
        parents, _, tokens = grow_dynamic(_logp(s, root), expander(False), self.nodes, self.depth, self.topk)
        row.cache.keep(prefix, torch.empty(0, dtype=torch.long))
        if s.greedy:
            return DraftTree(torch.tensor(tokens, dtype=torch.long), parents)
        # pass 2: draw the tokens of that shape
        tree = fill_sampled(parents, s.probs(root), expander(True), state.generator)
        row.cache.keep(prefix, torch.empty(0, dtype=torch.long))
        return tree

    def observe_one(self, row, accepted: list[int]) -> None:
        row.cache.keep(row.n_cached, torch.empty(0, dtype=torch.long))


def parse_dynamic(spec) -> bool:
    return isinstance(spec, str) and spec.strip().lower() == "dynamic"


__all__ = ["DynamicHeadDrafter", "DynamicDraftModelDrafter", "grow_dynamic", "fill_sampled", "parse_dynamic",
           "check_dynamic"]
