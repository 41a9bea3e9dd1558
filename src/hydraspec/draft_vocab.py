"""A draft model's output layer cut to part of its vocabulary.

The output layer of a small model with a large vocabulary is a large share of its cost per token (Qwen2.5's
151,936 x 896 matrix is 28 % of the 0.5B's weights). FR-Spec (Zhao et al., 2025) drafts over a
frequency-ranked subset of the vocabulary instead. Here the subset is the first N token ids, which BPE
vocabularies order by merge rank (the frequent tokens first), plus every special token; the draft's logits
for the other tokens are -inf, so it never proposes them. The target verifies every draft token, so this
changes how many tokens are accepted, never the output (greedy or sampled: the draft distribution q that
speculative sampling divides by is exactly the one drafted from).
"""
from __future__ import annotations

import torch
from torch import nn

from .errors import HydraspecError

AUTO_CUT, AUTO_SIZE = 65536, 32768  # by default a vocabulary above AUTO_CUT ids drafts over AUTO_SIZE


def auto_size(vocab: int) -> int:
    """The default cut for a draft vocabulary of ``vocab`` ids (0: none; measured in BENCHMARKS.md)."""
    return AUTO_SIZE if vocab > AUTO_CUT else 0


class DraftVocabHead(nn.Module):
    """An output layer over the ids ``keep`` of a ``vocab``-sized vocabulary; full-size logits, -inf elsewhere."""

    def __init__(self, sub: nn.Module, keep: torch.Tensor, vocab: int):
        super().__init__()
        self.sub, self.vocab = sub, vocab
        self.register_buffer("keep", keep.to(torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.sub(x)
        out = y.new_full((*y.shape[:-1], self.vocab), float("-inf"))
        out.index_copy_(-1, self.keep, y)
        return out

    def extra_repr(self) -> str:
        return f"{len(self.keep)} of {self.vocab} tokens"


def kept_ids(size: int, vocab: int, special_ids) -> torch.Tensor:
    """Ids 0 .. size-1 and the special ones, sorted."""
    ids = set(range(min(size, vocab))) | {int(i) for i in special_ids if 0 <= int(i) < vocab}
    return torch.tensor(sorted(ids), dtype=torch.long)


def _rows(head: nn.Module, keep: torch.Tensor) -> nn.Module:
    if hasattr(head, "select"):  # a GGUF-precision layer keeps the file's codes for those rows
        return head.select(keep)
    if isinstance(getattr(head, "weight", None), torch.Tensor) and hasattr(head, "in_features"):
        lin = nn.Linear(head.in_features, len(keep), bias=head.bias is not None, dtype=head.weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(head.weight[keep])
            if head.bias is not None:
                lin.bias.copy_(head.bias[keep])
        return lin
    raise HydraspecError(f"cannot cut the draft vocabulary of a {type(head).__name__} output layer")


def cut_output(model, keep: torch.Tensor) -> None:
    """Replace ``model``'s output layer by a :class:`DraftVocabHead` over the ids ``keep`` (its rows only)."""
    head = model.get_output_embeddings()
    model.set_output_embeddings(DraftVocabHead(_rows(head, keep), keep, head.out_features))


def kept_ids_of(model) -> torch.Tensor | None:
    """The ids a model's cut output layer keeps (:class:`DraftVocabHead`), or None for a whole one."""
    head = model.get_output_embeddings()
    return head.keep if isinstance(head, DraftVocabHead) else None


def greedy_tops(logits: torch.Tensor, keep: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
    """Per row of ``logits`` [B, vocab]: the most likely token and the log of its probability, computed over the
    ids ``keep`` only where given (the others are -inf there, so both are the same as over the whole row, at a
    fraction of the cost)."""
    sub = (logits if keep is None else logits.index_select(-1, keep)).float()
    top, at = sub.max(-1)
    ids = at if keep is None else keep[at]
    return ids.tolist(), (top - torch.logsumexp(sub, -1)).tolist()


def trim_draft_vocab(model, size: int, special_ids) -> int:
    """Replace ``model``'s output layer by a :class:`DraftVocabHead` over :func:`kept_ids`; returns how
    many ids it keeps (the whole vocabulary: nothing changed)."""
    vocab = model.get_output_embeddings().out_features
    if size < 1:
        raise HydraspecError(f"--draft-vocab must be at least 1, got {size}")
    keep = kept_ids(size, vocab, special_ids)
    if len(keep) >= vocab:
        return vocab
    cut_output(model, keep)
    return len(keep)
