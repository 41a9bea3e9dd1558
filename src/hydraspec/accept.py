"""Deciding which draft tokens the target accepts.

Every acceptor walks the verify tree from node 0 (the pending token, already the target's) and returns
the accepted path plus one more token from the target: the *bonus* token when the walk ends at a leaf
or the *recovered* token when every child of the last node was rejected.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import Sampling, sample
from .tree import TreeShape


@dataclass
class Acceptance:
    path: list[int]  # verify-tree nodes kept, starting with 0 (the pending token)
    next_token: int  # bonus or recovered token, the new pending token


def accept_greedy(shape: TreeShape, tokens: list[int], logits: torch.Tensor, **_) -> Acceptance:
    """Greedy verification: follow the child whose token is the target's argmax. Exact for greedy decoding."""
    # tokens: [n] verify-tree tokens; logits: [n, vocab]. The argmax of node 0 alone first: most walks end
    # there (its children rejected), and a row's argmax over the vocabulary is most of this function's time;
    # once the walk goes on, those of every later node (breadth-first order) in one call.
    best = {0: int(logits[0].argmax())}
    node, path = 0, [0]
    while True:
        if node not in best:
            best.update(enumerate(logits[node:].argmax(-1).tolist(), start=node))
        t = best[node]
        for c in shape.children[node]:
            if tokens[c] == t:
                node = c
                path.append(c)
                break
        else:
            return Acceptance(path, t)


def accept_lossless(shape: TreeShape, tokens: list[int], logits: torch.Tensor, q: torch.Tensor | None,
                    sampling: Sampling, generator: torch.Generator | None, **_) -> Acceptance:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) generalised to trees by recursive
    rejection sampling over the siblings (SpecInfer, Miao et al. 2024; without replacement as in Jeon et
    al. 2024). Lossless: the emitted tokens are distributed exactly as sampling from the target.

    Siblings are tried in index order. Child x, drawn from draft distribution q, is accepted with
    probability min(1, p(x)/q(x)). On rejection the target becomes norm(max(0, p - q)) and x leaves q
    (siblings were drawn without replacement). If every child is rejected the *recovered* token is
    drawn from what is left of p. With q = None (deterministic drafter) q is one-hot on each child.
    q: [n - 1, vocab] draft distribution of each draft node (verify node i uses row i - 1).
    """
    node, path = 0, [0]
    while True:
        p = sampling.probs(logits[node])
        kids = shape.children[node]
        if not kids:
            return Acceptance(path, sample(p, generator))
        qd = None if q is None else q[kids[0] - 1].clone()
        accepted = None
        for c in kids:
            x = tokens[c]
            u = torch.rand((), generator=generator).item()
            if qd is None:
                if u < p[x].item():
                    accepted = c
                    break
                p[x] = 0.0
            else:
                qx = qd[x].item()
                if qx > 0 and u * qx < p[x].item():
                    accepted = c
                    break
                p = torch.clamp(p - qd, min=0.0)
                qd[x] = 0.0
                s = qd.sum()
                if s > 0:
                    qd /= s
            total = p.sum()
            if total <= 0:  # only reachable through rounding when p == q; then nothing is left to reject
                p = sampling.probs(logits[node])
                total = p.sum()
            p /= total
        if accepted is None:
            return Acceptance(path, sample(p, generator))
        node = accepted
        path.append(node)


def accept_typical(shape: TreeShape, tokens: list[int], logits: torch.Tensor, sampling: Sampling,
                   generator: torch.Generator | None, epsilon: float = 0.09, alpha: float = 0.3,
                   **_) -> Acceptance:
    """Typical acceptance (Medusa, Cai et al. 2024): accept a child x when p(x) > min(epsilon,
    alpha * exp(-H(p))). Faster than speculative sampling but NOT distribution-preserving: the output
    follows a truncated version of the target distribution. The extra token is drawn from the target
    restricted to the same typical set."""
    node, path = 0, [0]
    while True:
        p = sampling.probs(logits[node])
        ent = -(p * torch.log(p.clamp_min(1e-20))).sum()
        threshold = min(epsilon, alpha * float(torch.exp(-ent)))
        for c in shape.children[node]:
            if p[tokens[c]].item() > threshold:
                node = c
                path.append(c)
                break
        else:
            typical = torch.where(p > threshold, p, torch.zeros_like(p))
            if typical.sum() <= 0:
                return Acceptance(path, int(p.argmax()))
            return Acceptance(path, sample(typical / typical.sum(), generator))


ACCEPTORS = {"greedy": accept_greedy, "lossless": accept_lossless, "typical": accept_typical}


def fit_vocab(q: torch.Tensor, v: int) -> torch.Tensor:
    """A drafter's distributions q [n, V'] cut or zero-padded to the target's vocabulary of v."""
    if q.shape[-1] > v:
        return q[:, :v]
    return torch.nn.functional.pad(q, (0, v - q.shape[-1]))
