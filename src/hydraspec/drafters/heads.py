from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..errors import HydraspecError
from ..heads.prefix import new_prefix_cache
from ..sampling import sample_without_replacement
from ..tree import DraftTree, load_tree_spec, parents_from_paths, shape_of
from .base import DecodeState, Drafter, RowStates


@dataclass
class PrefixRow:
    """One sequence's Hydra++ prefix layer: its own cache and its output at the last committed state."""

    cache: object = None
    length: int = 0
    fed: torch.Tensor | None = None  # the last new_hidden fed (fed once)
    last: torch.Tensor | None = None


class PrefixInput:
    """What head drafters share: the hidden state the heads read, which for Hydra++ heads is the output
    of their prefix-attention layer, fed (with each sequence's own cache) the states the target commits."""

    def head_input(self, state: DecodeState) -> torch.Tensor | None:
        """The hidden state the heads read for ``state``: the target's, or (Hydra++) the prefix layer's
        output, after feeding the prefix layer the states the target committed since the last call."""
        if getattr(self.heads, "prefix", None) is None or state.hidden is None:
            return state.hidden
        row = self.prefix_rows.of(state)
        new = state.new_hidden
        if new is not None and new is not row.fed:
            if row.cache is None:
                row.cache = new_prefix_cache()
            out = self.heads.prefix(new, row.length, row.cache)
            row.length += new.shape[0]
            row.fed, row.last = new, out[-1]
        return row.last


def full_vocab_logits(heads, logits: torch.Tensor) -> torch.Tensor:
    """Logits over a draft vocabulary -> over the whole vocabulary (-inf elsewhere)."""
    sub = getattr(heads, "subset", None)
    if sub is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], heads.vocab), float("-inf"))
    full[..., sub] = logits
    return full


class HeadDrafter(PrefixInput, Drafter):
    """Medusa / Hydra drafting: a static token tree filled from draft heads on the target's hidden state.

    The tree spec is a list of paths of sibling ranks (Medusa's "choices"). Depth d is filled by head
    d - 1. Medusa heads ignore the path, so one call per depth serves every node; Hydra heads are called
    once per depth for all parents at that depth, each with its own path embeddings. Greedy mode puts
    the head's rank-r token at a rank-r node; sampling mode draws each parent's children without
    replacement from the head's warped distribution and reports it as q, so acceptance stays lossless.
    """

    needs_hidden = True

    def __init__(self, heads, embed: torch.nn.Module, paths: list[list[int]]):
        self.heads, self.embed = heads, embed
        self.name = heads.kind
        if not isinstance(paths, list) or not all(isinstance(p, (list, tuple)) for p in paths):
            paths = load_tree_spec(paths)
        parents, ranks = parents_from_paths(paths)
        shape = shape_of(parents)
        depth = int(shape.depth.max()) + 1
        if depth > heads.num_heads:
            raise HydraspecError(f"tree depth {depth} exceeds the number of heads ({heads.num_heads})")
        self.parents, self.ranks, self.shape = parents, ranks, shape
        self.max_nodes = len(parents)
        # static per-depth data: the parents to expand (-1 = the pending token) and their children
        self.levels = []
        for d in range(depth):
            nodes = [i for i in range(len(parents)) if int(shape.depth[i]) == d]
            par = sorted({parents[i] for i in nodes}, key=lambda p: (p >= 0, p))
            kids = {p: [i for i in nodes if parents[i] == p] for p in par}
            self.levels.append((par, kids))
        self.paths = [shape.path_to(i) for i in range(len(parents))]
        self.prefix_rows: RowStates[PrefixRow] = RowStates(lambda s: PrefixRow())
        self.by_rows: list[tuple[int, HeadDrafter]] = []  # (batch size, the drafter of that size's tree)

    def with_trees(self, trees: dict[int, list[list[int]]]) -> "HeadDrafter":
        """This drafter with also a static tree per number of rows: {batch size: paths}."""
        twin = copy.copy(self)
        made = [(int(bs), HeadDrafter(self.heads, self.embed, paths)) for bs, paths in trees.items()]
        twin.by_rows = sorted(made, key=lambda x: x[0])
        twin.max_nodes = max([self.max_nodes] + [d.max_nodes for _, d in twin.by_rows])
        twin.prefix_rows = RowStates(lambda s: PrefixRow())
        return twin

    def for_rows(self, rows: int) -> "HeadDrafter":
        chosen = self
        for bs, d in self.by_rows:
            if bs <= rows:
                chosen = d
        return chosen

    @torch.inference_mode()
    def propose(self, states: list[DecodeState]) -> list[DraftTree]:
        """Every row's tree, each head called once per depth for all rows (the heads' vocabulary projection
        is read once per depth); each row samples from its own generator. With trees by batch size, the
        tree of the largest size listed that is not above the number of rows."""
        drafter = self.for_rows(len(states))
        out: list = [DraftTree.empty() for _ in states]
        H = [self.head_input(s) for s in states]
        live = [j for j, h in enumerate(H) if h is not None]
        if not live:
            return out
        heads, parents, n = drafter.heads, drafter.parents, len(drafter.parents)
        H = torch.stack([H[j] for j in live])  # [R, dim]
        to_ids = getattr(heads, "token_ids", lambda i: i)  # draft vocabulary -> token ids
        to_probs = getattr(heads, "full_probs", lambda p: p)
        greedy = [states[j].sampling.greedy for j in live]  # each row's own sampling settings
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
            if any(greedy):
                need = max(drafter.ranks[c] for p in par for c in kids[p]) + 1
                top = to_ids(torch.topk(lg, need, dim=-1).indices).tolist()  # [R][P][need]
            for r, j in enumerate(live):
                for i, p in enumerate(par):
                    children = kids[p]
                    if greedy[r]:
                        for c in children:
                            tokens[r][c] = top[r][i][drafter.ranks[c]]
                    else:
                        probs = to_probs(states[j].sampling.probs(lg[r, i]))
                        draws = sample_without_replacement(probs, len(children), states[j].generator).tolist()
                        for c, x in zip(children, draws):
                            tokens[r][c] = x
                            qrows[r][c] = probs
        for r, j in enumerate(live):
            if greedy[r]:
                out[j] = DraftTree(torch.tensor(tokens[r]), parents)
                continue
            drawn = [i for i in range(n) if qrows[r][i] is not None]
            if len(drawn) < n:  # fewer tokens with nonzero probability than children: cut the tree
                keep = prefix_closed(parents, set(drawn))
                out[j] = DraftTree(torch.tensor([tokens[r][i] for i in keep]), reindex(parents, keep),
                                   torch.stack([qrows[r][i] for i in keep]) if keep else None)
            else:
                out[j] = DraftTree(torch.tensor(tokens[r]), parents, torch.stack(qrows[r]))
        return out


def prefix_closed(parents, present: set[int]) -> list[int]:
    keep = []
    for i, p in enumerate(parents):
        if i in present and (p < 0 or p in keep):
            keep.append(i)
    return keep


def reindex(parents, keep: list[int]) -> tuple[int, ...]:
    pos = {old: new for new, old in enumerate(keep)}
    return tuple(-1 if parents[i] < 0 else pos[parents[i]] for i in keep)
