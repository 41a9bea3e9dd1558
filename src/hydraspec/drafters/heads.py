from __future__ import annotations

import torch

from ..errors import HydraspecError
from ..sampling import sample_without_replacement
from ..tree import DraftTree, parents_from_paths, shape_of
from .base import DecodeState, Drafter


class PrefixInput:
    """What head drafters share: the hidden state the heads read, which for Hydra++ heads is the output
    of their prefix-attention layer, fed (with its own cache) the states the target commits each step."""

    _prefix_cache, _prefix_len, _fed, _last = None, 0, None, None

    def start(self, state: DecodeState, capacity: int) -> None:
        if getattr(self.heads, "prefix", None) is not None:
            from ..heads.prefix import new_prefix_cache

            self._prefix_cache, self._prefix_len, self._fed = new_prefix_cache(), 0, None

    def _head_input(self, state: DecodeState) -> torch.Tensor | None:
        """The hidden state the heads read: the target's, or (Hydra++) the prefix layer's output,
        after feeding the prefix layer the states the target committed since the last call."""
        if getattr(self.heads, "prefix", None) is None or state.hidden is None:
            return state.hidden
        new = state.new_hidden
        if new is not None and new is not self._fed:
            if self._prefix_cache is None:
                self.start(state, 0)
            out = self.heads.prefix(new, self._prefix_len, self._prefix_cache)
            self._prefix_len += new.shape[0]
            self._fed, self._last = new, out[-1]
        return self._last


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
            from ..tree import load_tree_spec  # a tree.json file, its dict or a JSON string

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
        self._prefix_cache, self._prefix_len, self._fed = None, 0, None

    @torch.inference_mode()
    def propose_batch(self, states: list[DecodeState], row_drafters=None):
        """:meth:`propose` for many rows at once (same trees, same tokens, same random draws per row's
        generator), calling each head once per depth for all rows instead of once per row: the heads'
        vocabulary projection is read once per depth. ``row_drafters``: each row's own drafter (Hydra++ keeps
        a row's prefix-layer cache there). None for a subclass with its own :meth:`propose`."""
        drafter = self
        if type(drafter).propose is not HeadDrafter.propose or \
                not all(hasattr(drafter, a) for a in ("levels", "paths", "ranks")):
            return None  # a subclass with its own proposal is asked row by row
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

    def propose(self, state: DecodeState) -> DraftTree:
        h = self._head_input(state)
        if h is None:
            return DraftTree.empty()
        greedy = state.sampling.greedy
        n = len(self.parents)
        tokens = [0] * n
        qrows: list[torch.Tensor | None] = [None] * n
        pending = state.tokens[-1]
        # heads with a draft vocabulary return logits over it: map ranks to token ids, q to the full vocabulary
        to_ids = getattr(self.heads, "token_ids", lambda i: i)
        to_probs = getattr(self.heads, "full_probs", lambda p: p)
        for d, (par, kids) in enumerate(self.levels):
            if self.heads.kind == "medusa":
                lg = self.heads.logits(d, h[None]).float()
                lg = lg.expand(len(par), -1)
            else:
                path_ids = [[pending] + [tokens[j] for j in (self.paths[p] if p >= 0 else [])] for p in par]
                emb = self.embed(torch.tensor(path_ids, device=h.device))  # [P, d + 1, dim]
                lg = self.heads.logits(d, h[None].expand(len(par), -1), emb).float()
            for row, p in enumerate(par):
                children = kids[p]
                if greedy:
                    need = max(self.ranks[c] for c in children) + 1
                    top = to_ids(torch.topk(lg[row], need).indices).tolist()
                    for c in children:
                        tokens[c] = top[self.ranks[c]]
                else:
                    probs = to_probs(state.sampling.probs(lg[row]))
                    draws = sample_without_replacement(probs, len(children), state.generator).tolist()
                    for c, x in zip(children, draws):
                        tokens[c] = x
                        qrows[c] = probs
        if not greedy:
            drawn = [i for i in range(n) if qrows[i] is not None]
            if len(drawn) < n:  # fewer tokens with nonzero probability than children: cut the tree
                keep = prefix_closed(self.parents, set(drawn))
                return DraftTree(torch.tensor([tokens[i] for i in keep]), reindex(self.parents, keep),
                                 torch.stack([qrows[i] for i in keep]) if keep else None)
            return DraftTree(torch.tensor(tokens), self.parents, torch.stack(qrows))
        return DraftTree(torch.tensor(tokens), self.parents)


def prefix_closed(parents, present: set[int]) -> list[int]:
    keep = []
    for i, p in enumerate(parents):
        if i in present and (p < 0 or p in keep):
            keep.append(i)
    return keep


def reindex(parents, keep: list[int]) -> tuple[int, ...]:
    pos = {old: new for new, old in enumerate(keep)}
    return tuple(-1 if parents[i] < 0 else pos[parents[i]] for i in keep)
