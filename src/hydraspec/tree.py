"""Token trees.

A tree is a tuple of parent indices in breadth-first order (a node's depth never decreases along the
list), with -1 for nodes that hang directly under the prefix. Everything a verify step needs — depths,
the ancestor mask, children lists, root-to-leaf paths — is derived from the parents and cached, so a
static tree costs nothing per step.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import HydraspecError


@dataclass(frozen=True)
class TreeShape:
    parents: tuple[int, ...]
    depth: torch.Tensor  # [n] long, 0 for nodes under the prefix
    ancestors: torch.Tensor  # [n, n] bool, node i sees node j (j == i or j is an ancestor of i)
    children: tuple[tuple[int, ...], ...]  # children of each node, in index order
    roots: tuple[int, ...]  # nodes with parent -1
    is_chain: bool  # 0 <- 1 <- 2 ...: plain causal attention suffices

    @property
    def size(self) -> int:
        return len(self.parents)

    def path_to(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


@functools.lru_cache(maxsize=4096)
def shape_of(parents: tuple[int, ...]) -> TreeShape:
    n = len(parents)
    depth = [0] * n
    anc = torch.zeros(n, n, dtype=torch.bool)
    children: list[list[int]] = [[] for _ in range(n)]
    roots = []
    for i, p in enumerate(parents):
        if p >= i or p < -1:
            raise ValueError(f"node {i} has parent {p}: parents must come before their children")
        anc[i, i] = True
        if p == -1:
            roots.append(i)
        else:
            depth[i] = depth[p] + 1
            anc[i] |= anc[p]
            children[p].append(i)
        if i and depth[i] < depth[i - 1]:
            raise ValueError("tree nodes must be in breadth-first order (non-decreasing depth)")
    is_chain = all(p == i - 1 for i, p in enumerate(parents))
    return TreeShape(
        parents=tuple(parents),
        depth=torch.tensor(depth, dtype=torch.long),
        ancestors=anc,
        children=tuple(tuple(c) for c in children),
        roots=tuple(roots),
        is_chain=is_chain,
    )


def chain(n: int) -> tuple[int, ...]:
    return tuple(range(-1, n - 1))


def after_lead(n: int, shape: TreeShape) -> TreeShape:
    """A verify tree's shape behind a lead of ``n`` tokens (a chain; the tree's root hangs on its last)."""
    if not n:
        return shape
    return shape_of(chain(n) + tuple(n - 1 if p < 0 else n + p for p in shape.parents))


@dataclass
class DraftTree:
    """What a drafter proposes: draft tokens hanging under the pending (last accepted) token.

    tokens:  [n] long, BFS order
    parents: n ints, -1 = child of the pending token
    q:       [n, vocab] the distribution each node was drawn from (siblings share their parent's row),
             or None for a deterministic drafter (q is one-hot on the proposed token).
    Siblings must have been drawn from q without replacement, in index order, for sampling to be lossless.
    grade:   the drafter's own class of how sure it is of this proposal (suffix decoding: its match length, in
             classes), 0 where it makes none; the per-request choice (drafters.auto) learns each class's
             acceptance apart.
    """

    tokens: torch.Tensor
    parents: tuple[int, ...]
    q: torch.Tensor | None = None
    grade: int = 0

    @staticmethod
    def empty(device=None) -> "DraftTree":
        return DraftTree(torch.empty(0, dtype=torch.long, device=device), ())

    def __len__(self) -> int:
        return len(self.parents)

    def head(self, n: int) -> "DraftTree":
        """The first n nodes (a BFS prefix is a tree again)."""
        return DraftTree(self.tokens[:n], self.parents[:n], None if self.q is None else self.q[:n], self.grade)

    def with_root(self) -> tuple[int, ...]:
        """Parents of the verify tree: node 0 is the pending token, drafts follow shifted by one."""
        return (-1,) + tuple(p + 1 for p in self.parents)


def side_by_side(trees: list[DraftTree]) -> tuple[DraftTree, list[int]]:
    """Trees whose top nodes differ, hung under one pending token: one tree in breadth-first order (each
    tree's own order kept, so a breadth-first cut of it cuts each of them to a breadth-first prefix), and
    which tree each of its nodes came from. The first tree's grade; no q (greedy rows only)."""
    items = []  # (depth, tree, index in it)
    for k, t in enumerate(trees):
        items += [(d, k, i) for i, d in enumerate(shape_of(t.with_root()).depth.tolist()[1:])]
    items.sort()
    at = {(k, i): j for j, (_, k, i) in enumerate(items)}
    parents = tuple(-1 if trees[k].parents[i] < 0 else at[(k, trees[k].parents[i])] for _, k, i in items)
    start = [0]
    for t in trees:
        start.append(start[-1] + len(t))
    tokens = torch.cat([t.tokens for t in trees])[[start[k] + i for _, k, i in items]]
    return DraftTree(tokens, parents, None, trees[0].grade), [k for _, k, _ in items]


# ---- tree specs (Medusa-style lists of paths) --------------------------------------------------


def parents_from_paths(paths: list[list[int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Turn Medusa-style choices ([[0], [0, 0], [1], ...], each a path of child ranks) into BFS-ordered
    parents and the rank of each node among its siblings. Validates the spec."""
    if not isinstance(paths, (list, tuple)) or not paths:
        raise HydraspecError("a tree spec must be a non-empty list of paths such as [[0], [0, 0], [1]]")
    seen = set()
    for p in paths:
        if not isinstance(p, (list, tuple)) or not p or not all(isinstance(r, int) and r >= 0 for r in p):
            raise HydraspecError(f"bad tree path {p!r}: a path is a non-empty list of non-negative ranks")
        t = tuple(p)
        if t in seen:
            raise HydraspecError(f"tree path {list(p)} appears twice")
        seen.add(t)
    for t in seen:
        if len(t) > 1 and t[:-1] not in seen:
            raise HydraspecError(f"tree path {list(t)} has no parent path {list(t[:-1])}")
    ordered = sorted(seen, key=lambda t: (len(t), t))
    index = {t: i for i, t in enumerate(ordered)}
    parents = tuple(index[t[:-1]] if len(t) > 1 else -1 for t in ordered)
    ranks = tuple(t[-1] for t in ordered)
    return parents, ranks


TREE_FORMAT = "hydraspec-tree"


def _read_spec(path_or_json):
    """The parsed spec: a dict (tree.json) or a list of paths, from any of load_tree_spec's inputs."""
    if isinstance(path_or_json, dict):
        return path_or_json
    if isinstance(path_or_json, (list, tuple)):
        return [list(p) if isinstance(p, (list, tuple)) else p for p in path_or_json]
    text = str(path_or_json)
    p = Path(text)
    try:
        is_file = p.is_file()
    except OSError:  # e.g. a JSON string too long to be a file name
        is_file = False
    try:
        return json.loads(p.read_text()) if is_file else json.loads(text)
    except json.JSONDecodeError as e:
        raise HydraspecError(f"tree spec {text[:80]!r} is neither a JSON file nor JSON: {e}") from None
    except OSError as e:
        raise HydraspecError(f"cannot read tree spec '{text}': {e.strerror or e}") from None


def tree_stop(path_or_json) -> float | None:
    """The draft-model confidence stop a tree.json was chosen with (drafter.confidence, written by
    `hydraspec build-tree --draft-model`), or None: a plain list of paths, a heads tree, no stop recorded."""
    if isinstance(path_or_json, str) and path_or_json.strip().lower() == "dynamic":
        return None
    data = _read_spec(path_or_json)
    drafter = data.get("drafter") if isinstance(data, dict) else None
    if not isinstance(drafter, dict) or drafter.get("kind") != "draft" or drafter.get("confidence") is None:
        return None
    c = drafter["confidence"]
    if not isinstance(c, (int, float)) or not 0 <= c < 1:
        raise HydraspecError(f"tree spec: drafter.confidence must be in [0, 1), got {c!r}")
    return float(c)


def load_tree_spec(path_or_json, max_depth: int | None = None) -> list[list[int]]:
    """A tree spec from a list of paths, a dict (tree.json: its "paths"), a JSON file or a JSON string.
    Validates it (see parents_from_paths) and, with max_depth, refuses paths deeper than that."""
    data = _read_spec(path_or_json)
    if isinstance(data, dict):
        data = data.get("paths", data.get("tree"))
        if data is None:
            raise HydraspecError("tree spec object has no 'paths' list")
    if not isinstance(data, list):
        raise HydraspecError(f"a tree spec must be a list of paths such as [[0], [0, 0], [1]], got "
                             f"{type(data).__name__}")
    paths = [list(x) if isinstance(x, (list, tuple)) else x for x in data]
    parents_from_paths(paths)  # raises a clear error on bad paths, duplicates and missing parents
    if max_depth is not None:
        deep = max(len(x) for x in paths)
        if deep > max_depth:
            raise HydraspecError(f"tree depth {deep} exceeds the number of heads ({max_depth})")
    return paths


def bfs_paths(paths: list[list[int]]) -> list[list[int]]:
    """The paths in the breadth-first order tree.py uses (depth, then ranks)."""
    return [list(t) for t in sorted({tuple(p) for p in paths}, key=lambda t: (len(t), t))]
