from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import HydraspecError
from ..heads.eagle import additive, new_cache
from ..sampling import sample_without_replacement
from ..tree import DraftTree, load_tree_spec, parents_from_paths, shape_of
from .base import DecodeState, Drafter, RowStates
from .heads import prefix_closed, reindex


@dataclass
class EagleRow:
    """One sequence's EAGLE head cache: the committed (feature, token) pairs it has read."""

    cache: object
    fed: int = 0  # positions read
    seen: torch.Tensor | None = None  # the last new_hidden read (read once)
    root: torch.Tensor | None = None  # the head's output at the last committed pair


FOLLOW_TREE = [[0]]  # a following head's proposal inside auto: one node (BENCHMARKS.md)


class EagleDrafter(Drafter):
    """Drafting with an EAGLE head (Li et al. 2024; heads.eagle): a static token tree filled depth by depth.

    Each step the head's layer first reads the pairs (f_i, e(x_{i+1})) the target committed since the last
    step (its features and the tokens they chose, the pending token last) into its own KV cache; its
    output at the last pair gives the first depth. Deeper, each node that has children is fed as the pair
    (guessed feature of its parent, its own token) under a tree mask (the committed pairs and its own
    ancestors), and its output gives its children. Those tree entries are dropped from the head's cache
    once the tree is made. Greedy mode puts the rank-r token at a rank-r node; sampling draws each node's
    children without replacement from the head's warped distribution and reports it as q, so acceptance
    stays lossless. The output is the target's whatever the head drafts.

    ``min_prob`` (greedy only): a node whose path probability under the head (the product of the head's
    probabilities of the tokens from the pending one down to it) falls below it is left out with everything
    under it, and is not fed to the head: as in EAGLE-2, the head's confidence stands in for the chance that
    the target accepts the node, so nodes unlikely to be accepted cost neither a draft forward nor a verify
    row. (Sampling keeps the whole tree: leaving out drawn tokens by their value would bias what is drawn.)

    ``follow``: the drafter counts as ``cheap``, so a drafter chosen per step (``auto``) asks it every step
    and scores the proposals it does not verify. Its layer then reads every committed pair; asked only now and
    then, its cache would miss the pairs of the steps between (``_commit`` skips them). Its proposal is then
    paid every step, for every row of a batch.
    """

    needs_hidden = True

    @property
    def follows(self) -> bool:
        """Following every step is what makes it cheap (Drafter.follows)."""
        return self.cheap

    def __init__(self, heads, embed: torch.nn.Module, paths, min_prob: float = 0.0, follow: bool = False):
        if not 0.0 <= min_prob < 1.0:
            raise HydraspecError(f"min_prob must be in [0, 1), got {min_prob}")
        self.heads, self.embed, self.min_prob, self.cheap = heads, embed, min_prob, follow
        self.name = heads.kind
        if not isinstance(paths, list) or not all(isinstance(p, (list, tuple)) for p in paths):
            paths = load_tree_spec(paths)
        parents, ranks = parents_from_paths(paths)
        shape = shape_of(parents)
        if int(shape.depth.max()) + 1 > heads.num_heads:
            raise HydraspecError(f"tree depth {int(shape.depth.max()) + 1} exceeds the head's draft depth "
                                 f"({heads.num_heads})")
        self.parents, self.ranks, self.shape = parents, ranks, shape
        self.max_nodes = len(parents)
        self.expand = [i for i in range(len(parents)) if shape.children[i]]  # nodes fed to the head (BFS order)
        self.rows: RowStates[EagleRow] = RowStates(self._new_row)

    def propose(self, states: list[DecodeState]) -> list[DraftTree]:
        return [self.propose_one(self.rows.of(s), s) for s in states]

    def _new_row(self, state: DecodeState) -> EagleRow:
        """A row whose head cache holds its whole sequence and a tree (in place), where its length is known."""
        room = state.capacity + self.max_nodes + 1 if state.capacity else 0
        return EagleRow(new_cache(room, len(self.heads.layers)))

    def _commit(self, row: EagleRow, state: DecodeState) -> torch.Tensor | None:
        """Feed the head the pairs committed since the last call; returns its output at the last one."""
        new = state.new_hidden
        if new is None or new is row.seen:
            return row.root
        end = len(state.tokens) - 1  # committed positions [0, end); tokens[end] is the pending token
        # a step that drafted nothing, a cached prefix or a prompt read in chunks leaves a gap: skipped
        first = max(end - new.shape[0], row.fed)
        if first < end:
            feats = new[new.shape[0] - (end - first):]
            toks = torch.tensor(state.tokens[first + 1:end + 1], device=feats.device)
            pos = torch.arange(first, end, device=feats.device)
            out = self.heads.step(feats, self.embed(toks), pos, row.cache)
            row.root, row.fed = out[-1], end
        row.seen = new
        return row.root

    @torch.inference_mode()
    def propose_one(self, row: EagleRow, state: DecodeState) -> DraftTree:
        root = self._commit(row, state)
        if root is None:
            return DraftTree.empty()
        heads, parents, n = self.heads, self.parents, len(self.parents)
        greedy = state.sampling.greedy
        to_ids = heads.token_ids
        end = len(state.tokens) - 1
        cached = row.cache.get_seq_length()
        tokens = [0] * n
        qrows: list[torch.Tensor | None] = [None] * n
        prune = greedy and self.min_prob > 0
        path_p = [1.0] * n  # (pruning) each node's path probability under the head
        alive = [not prune] * n  # (pruning) drafted and likely enough, as its ancestors
        feats = {-1: root}  # a node's guessed feature (the one its children are drafted from)
        slot: dict[int, int] = {}  # a fed node's entry in the head's cache, after the committed ones

        def fill(logits: torch.Tensor, nodes_by_parent: list[tuple[int, list[int]]]) -> None:
            """Children of each parent from its row of ``logits`` [P, out_vocab]."""
            if greedy:
                need = max(self.ranks[c] for _, kids in nodes_by_parent for c in kids) + 1
                top = torch.topk(logits.float(), need, dim=-1)
                ids = to_ids(top.indices).tolist()
                probs = (top.values - logits.float().logsumexp(-1, keepdim=True)).exp().tolist() if prune else None
                for row, (p, kids) in enumerate(nodes_by_parent):
                    for c in kids:
                        tokens[c] = ids[row][self.ranks[c]]
                        if prune:
                            path_p[c] = (path_p[p] if p >= 0 else 1.0) * probs[row][self.ranks[c]]
                            alive[c] = path_p[c] >= self.min_prob and (p < 0 or alive[p])
                return
            for row, (_, kids) in enumerate(nodes_by_parent):
                probs = heads.full_probs(state.sampling.probs(logits[row].float()))
                for c, x in zip(kids, sample_without_replacement(probs, len(kids), state.generator).tolist()):
                    tokens[c], qrows[c] = x, probs

        roots = [i for i in range(n) if parents[i] < 0]
        fill(heads.logits(0, root[None]), [(-1, roots)])
        depth = self.shape.depth
        levels: dict[int, list[int]] = {}
        for i in self.expand:
            levels.setdefault(int(depth[i]), []).append(i)
        try:
            for d in sorted(levels):
                nodes = [i for i in levels[d] if (alive[i] if greedy else qrows[i] is not None)]
                if not nodes:
                    continue
                base = cached + len(slot)
                allowed = torch.zeros(len(nodes), base + len(nodes), dtype=torch.bool)
                allowed[:, :cached] = True
                for r, i in enumerate(nodes):
                    for a in self.shape.path_to(i)[:-1]:
                        allowed[r, slot[a]] = True
                    allowed[r, base + r] = True
                dev = root.device
                mask = additive(allowed.to(dev), heads.dtype)
                f = torch.stack([feats[parents[i]] for i in nodes])
                e = self.embed(torch.tensor([tokens[i] for i in nodes], device=dev))
                pos = torch.full((len(nodes),), end + d, dtype=torch.long, device=dev)
                out = heads.step(f, e, pos, row.cache, mask)
                for r, i in enumerate(nodes):
                    feats[i], slot[i] = out[r], base + r
                fill(heads.logits(d + 1, out), [(i, list(self.shape.children[i])) for i in nodes])
        finally:
            extra = row.cache.get_seq_length() - cached
            if extra:
                row.cache.crop(-extra)  # the tree's entries go; the committed pairs stay
        if greedy:
            keep = prefix_closed(parents, {i for i in range(n) if alive[i]}) if prune else None
            if keep is not None and len(keep) < n:  # (children of a left-out node were never drafted)
                return DraftTree(torch.tensor([tokens[i] for i in keep], dtype=torch.long), reindex(parents, keep))
            return DraftTree(torch.tensor(tokens), parents)
        drawn = [i for i in range(n) if qrows[i] is not None]
        if len(drawn) < n:  # fewer tokens with nonzero probability than children: cut the tree
            keep = prefix_closed(parents, set(drawn))
            return DraftTree(torch.tensor([tokens[i] for i in keep]), reindex(parents, keep),
                             torch.stack([qrows[i] for i in keep]) if keep else None)
        return DraftTree(torch.tensor(tokens), parents, torch.stack(qrows))
