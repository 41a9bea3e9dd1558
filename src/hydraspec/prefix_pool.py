"""A prefix cache across requests: the keys and values of earlier sequences (prompt and answer), so that a
request whose prompt starts with one of them reads only the tokens after the shared prefix. This is what
vLLM's automatic prefix caching, SGLang's RadixAttention and llama-server's prompt cache do; a chat client
re-sends the whole conversation every turn, so a second turn's prompt is the first turn's prompt and answer
plus the new message.

Entries are whole sequences, matched by their longest common prefix with the new prompt; the pool holds at
most ``max_tokens`` tokens, the least recently used entry dropped first, and an entry that a newer one
extends is dropped when the newer one is stored (the turns of one chat keep one entry). Exactness: a cached
position holds the keys and values the model wrote for the same token at the same position after the same
prefix; only the order of the floating-point work that produced them can differ.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .cache import read_row, write_row

__all__ = ["PrefixPool"]


@dataclass
class Entry:
    ids: torch.Tensor  # [n] token ids at positions 0 .. n - 1
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [kv_heads, n, head_dim]


class PrefixPool:
    """Keys and values of up to ``max_tokens`` earlier tokens; ``min_hit``: shorter shared prefixes are not
    used (copying them costs about what reading them does)."""

    def __init__(self, max_tokens: int, min_hit: int = 8):
        self.max_tokens, self.min_hit = int(max_tokens), int(min_hit)
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.tokens = 0
        self.hits = self.hit_tokens = self.lookups = 0
        self._next = 0

    def match(self, ids: list[int]) -> tuple[int, int | None]:
        """(length of the longest cached prefix of ``ids``, its entry's key); (0, None) below ``min_hit``."""
        if not self.entries or len(ids) < self.min_hit:
            return 0, None
        q = torch.tensor(ids, dtype=torch.long)
        best, key = 0, None
        for k, e in self.entries.items():
            m = min(len(q), len(e.ids))
            diff = (q[:m] != e.ids[:m]).nonzero()
            n = int(diff[0]) if len(diff) else m
            if n >= best:  # ties: the most recently used (later in the order)
                best, key = n, k
        return (best, key) if best >= self.min_hit else (0, None)

    def load(self, cache, row: int, ids: list[int]) -> int:
        """Write the longest cached prefix of ``ids`` into cache row ``row`` at slots [0, n); returns n."""
        self.lookups += 1
        n, key = self.match(ids)
        if key is None:
            return 0
        e = self.entries[key]
        self.entries.move_to_end(key)
        write_row(cache, row, [(k[:, :n], v[:, :n]) for k, v in e.kv])
        self.hits += 1
        self.hit_tokens += n
        return n

    def store(self, cache, row: int, ids: list[int]) -> None:
        """Keep cache row ``row``'s slots [0, len(ids)), which hold ``ids``; entries it extends are dropped."""
        n = len(ids)
        if n < self.min_hit or n > self.max_tokens:
            return
        new = torch.tensor(ids, dtype=torch.long)
        for k in [k for k, e in self.entries.items() if len(e.ids) <= n and torch.equal(e.ids, new[:len(e.ids)])]:
            self._drop(k)
        while self.entries and self.tokens + n > self.max_tokens:
            self._drop(next(iter(self.entries)))
        self.entries[self._next] = Entry(new, [(k.clone(), v.clone()) for k, v in read_row(cache, row, n)])
        self._next += 1
        self.tokens += n

    def clear(self) -> None:
        """Drop every entry (the counters stay)."""
        for key in list(self.entries):
            self._drop(key)

    def _drop(self, key: int) -> None:
        self.tokens -= len(self.entries.pop(key).ids)

