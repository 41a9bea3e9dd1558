"""Training targets and losses for draft heads, on one sequence of base-model hidden states.

Offsets: the base lm_head at position t predicts token t + 1. Head k (0-based) at position t predicts
token t + k + 2. A Hydra head k also reads the input embeddings of tokens t + 1 .. t + k + 1 (teacher
forcing: the real tokens). Only targets inside the answer count (the prompt is the user's text).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def head_positions(seq_len: int, prompt_len: int, k: int) -> torch.Tensor:
    """Positions t whose head-k target t + k + 2 exists and lies in the answer (>= prompt_len)."""
    first = max(0, prompt_len - (k + 2))
    last = seq_len - (k + 2)  # exclusive
    return torch.arange(first, max(first, last))


def head_logits(heads, k: int, hidden: torch.Tensor, ids: torch.Tensor, embed, pos: torch.Tensor) -> torch.Tensor:
    """Logits [len(pos), vocab] of head k at positions pos. hidden: [T, dim]; ids: [T]."""
    h = hidden[pos]
    if heads.kind == "hydra":
        path = pos[:, None] + torch.arange(1, k + 2, device=pos.device)[None]  # [P, k + 1]
        return heads.logits(k, h, embed(ids[path]))
    return heads.logits(k, h)


def heads_loss(heads, hidden: torch.Tensor, ids: torch.Tensor, prompt_len: int, embed=None,
               decay: float = 0.8, teacher_logits: torch.Tensor | None = None):
    """sum_k decay^k * loss_k, where loss_k is the cross-entropy of head k against the real token
    t + k + 2 (Medusa-1 / Hydra) or, with teacher_logits [T, vocab] from the base model, against the base
    model's distribution for that token, softmax(teacher_logits[t + k + 1]) (Hydra++ distillation;
    with a draft vocabulary, teacher_logits may hold the whole vocabulary or only its columns).
    Returns (loss, per-head dict of top-1 / top-5 hit counts and the number of targets)."""
    total = hidden.new_zeros((), dtype=torch.float32)
    stats = []
    for k in range(heads.num_heads):
        pos = head_positions(ids.numel(), prompt_len, k)
        if pos.numel() == 0:
            stats.append({"n": 0, "top1": 0, "top5": 0})
            continue
        logits = head_logits(heads, k, hidden, ids, embed, pos).float()
        target = ids[pos + k + 2]
        subset = getattr(heads, "subset", None)
        if subset is not None:  # draft vocabulary: targets as indices into it (-100: outside, a sure miss)
            index = torch.full((heads.vocab,), -100, dtype=torch.long, device=target.device)
            index[subset] = torch.arange(subset.numel(), device=target.device)
            target = index[target]
        if teacher_logits is None:
            loss = F.cross_entropy(logits, target, ignore_index=-100) if (target >= 0).any() else logits.sum() * 0
        else:
            teacher = teacher_logits[pos + k + 1].float()
            if subset is not None and teacher.shape[-1] != subset.numel():
                teacher = teacher[:, subset]  # the base distribution renormalised over the draft vocabulary
            loss = -(teacher.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
        total = total + (decay ** k) * loss
        with torch.no_grad():
            top5 = logits.topk(min(5, logits.shape[-1]), -1).indices
            stats.append({"n": int(pos.numel()), "top1": int((top5[:, 0] == target).sum()),  # -100 never hits
                          "top5": int((top5 == target[:, None]).any(-1).sum())})
    return total, stats
