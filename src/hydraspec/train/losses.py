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
               decay: float = 0.8, teacher_logits: torch.Tensor | None = None, eagle: dict | None = None):
    """sum_k decay^k * loss_k, where loss_k is the cross-entropy of head k against the real token
    t + k + 2 (Medusa-1 / Hydra) or, with teacher_logits [T, vocab] from the base model, against the base
    model's distribution for that token, softmax(teacher_logits[t + k + 1]) (Hydra++ distillation;
    with a draft vocabulary, teacher_logits may hold the whole vocabulary or only its columns).
    Returns (loss, per-head dict of top-1 / top-5 hit counts and the number of targets).
    An EAGLE head has a loss of its own (:func:`eagle_loss`; ``eagle`` holds its options)."""
    if heads.method == "eagle":
        return eagle_loss(heads, hidden, ids, prompt_len, embed=embed, teacher_logits=teacher_logits, **(eagle or {}))
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


def eagle_loss(heads, hidden: torch.Tensor, ids: torch.Tensor, prompt_len: int, embed=None,
               teacher_logits: torch.Tensor | None = None, steps: int = 2, noise: float = 0.1,
               reg_weight: float = 1.0, cls_weight: float = 0.1, decay: float = 0.8):
    """EAGLE's loss on one sequence: hidden [T - 1, dim] the base's states f_0 .. f_{T-2}, ids [T].

    At every depth k = 1 .. ``steps`` (:meth:`hydraspec.heads.eagle.EagleHeads.guesses`) the guess at
    position j is scored against the next feature f_{j+1} by a smooth-L1 regression (weight ``reg_weight``;
    both scaled by the features' standard deviation, so that the two losses keep EAGLE's balance whatever
    the base's feature scale: a final norm's output can be several times larger than the residual stream
    EAGLE read) and its token distribution against the base's own distribution for x_{j+2}
    (``teacher_logits``; without them, against the token) by a cross-entropy (weight ``cls_weight``), as
    EAGLE trains; depth k weighs ``decay``^(k-1). Depth 1
    reads the true features (EAGLE-1); the deeper ones read the head's own guesses, as drafting does (as
    HASS and EAGLE-3 train), so that deeper drafts do not drift. Under autograd the true features get
    uniform noise of ``noise`` times their standard deviation (EAGLE's). Only targets inside the answer
    count. Returns (loss, per-depth dicts of top-1 / top-5 hits against x_{j+2} and the number of
    targets), like :func:`heads_loss`.

    An EAGLE-3 head (``heads.regresses_features`` false) reads the first k * dim columns of ``hidden`` (the
    joined layers; training appends the last state, which the teacher logits come from) and is scored on
    the distribution alone (weight 1), as EAGLE-3 trains."""
    if not heads.regresses_features:
        hidden = hidden[:, :len(heads.feature_layers) * heads.hidden]
        reg_weight, cls_weight = 0.0, 1.0
    n = ids.numel() - 2  # pairs j = 0 .. T - 3 have a target
    total = hidden.new_zeros((), dtype=torch.float32)
    stats = [{"n": 0, "top1": 0, "top5": 0} for _ in range(steps)]
    if n < 1:
        return total, stats
    feats = hidden[:n].float()
    if noise and torch.is_grad_enabled():
        feats = feats + (torch.rand_like(feats) * 2 - 1) * (noise * feats.std())
    guesses = heads.guesses(feats, embed(ids[1:n + 1]).float(), steps)  # pairs (f_j, e(x_{j+1}))
    target_feat = hidden[1:n + 1].float() if reg_weight else None  # f_{j+1}
    scale = 1.0 / float(target_feat.std().clamp(min=1e-6)) if reg_weight else 0.0
    target = ids[2:n + 2]  # x_{j+2}
    subset = getattr(heads, "subset", None)
    if subset is not None:
        index = torch.full((heads.vocab,), -100, dtype=torch.long, device=target.device)
        index[subset] = torch.arange(subset.numel(), device=target.device)
        target = index[target]
    teacher = None
    if teacher_logits is not None:
        teacher = teacher_logits[1:n + 1].float()
        if subset is not None and teacher.shape[-1] != subset.numel():
            teacher = teacher[:, subset]
        teacher = teacher.softmax(-1)
    pos = torch.arange(n, device=ids.device)
    for k, y in enumerate(guesses, start=1):
        valid = (pos + 2 >= prompt_len) & (pos >= k - 1)
        if not valid.any():
            continue
        yv = y[valid].float()
        logits = heads.logits(k - 1, yv).float()
        tv = target[valid]
        reg = F.smooth_l1_loss(yv * scale, target_feat[valid] * scale) if reg_weight else 0.0
        if teacher is not None:
            cls = -(teacher[valid] * logits.log_softmax(-1)).sum(-1).mean()
        else:
            cls = F.cross_entropy(logits, tv, ignore_index=-100) if (tv >= 0).any() else logits.sum() * 0
        total = total + decay ** (k - 1) * (reg_weight * reg + cls_weight * cls)
        with torch.no_grad():
            top5 = logits.topk(min(5, logits.shape[-1]), -1).indices
            stats[k - 1] = {"n": int(valid.sum()), "top1": int((top5[:, 0] == tv).sum()),
                            "top5": int((top5 == tv[:, None]).any(-1).sum())}
    return total, stats
