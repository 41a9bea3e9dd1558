"""Calibration data for data-driven token trees (`hydraspec build-tree`).

Calibration data are the target's own greedy continuations of calibration prompts, generated with the
engine. At every position p of such a sequence S (S[p + 1] is the pending token, the hidden state h_p
produced it) the drafter's depth-d proposals under the pending token aim at S[p + 2 + d]. Under greedy
verification only the drafter's proposals along the *correct* path matter: a node can only be accepted
if its parent was, and its token is right exactly when it equals the target's greedy token. So one
number per (position, depth) says everything: r_d(p), the rank of S[p + 2 + d] among the drafter's
proposals given the correct path (Medusa head d on h_p; Hydra head d on h_p and the embeddings of
S[p + 1 .. p + 1 + d]; an EAGLE head's depth-d guess along S; a draft model's next-token ranking after S[.. p + 1 + d]). A tree of rank paths
then accepts, at position p, the longest prefix (r_0(p), ..., r_{k-1}(p)) that is one of its paths.
Where decoding would not draft a node at all -- past the token budget at the end of a sequence, or
below the point where a draft model's confidence stop (`--draft-confidence`) ends its chain -- its rank
is recorded as "not proposed", so replaying a tree walks the sequence exactly as greedy decoding does,
last step included.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..drafters.draft_model import log_top_prob
from ..drafters.heads import full_vocab_logits
from ..errors import HydraspecError
from ..features import features
from ..generator import SpeculativeGenerator


@dataclass
class Calibration:
    """Per calibration sequence: an int array [positions, depth] of ranks r_d(p) (K = not in the top K)."""

    ranks: list[np.ndarray]
    depth: int
    max_rank: int
    prompts: list[str] = field(default_factory=list)  # ids of the calibration prompts used
    # per sequence and position: how many levels a draft model drafts there before its confidence stop
    # (the engine trims to its token budget only after drafting); None: every level of the tree
    levels: list[np.ndarray] | None = None

    @property
    def positions(self) -> int:
        return int(sum(r.shape[0] for r in self.ranks))

    def rows(self) -> list[list[tuple[int, ...]]]:
        """The ranks as tuples, computed once (replays look up their prefixes many times)."""
        if getattr(self, "_rows", None) is None:
            self._rows = [[tuple(int(x) for x in row) for row in r] for r in self.ranks]
        return self._rows


def greedy_sequences(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + the target's greedy continuation, prompt length), generated with the engine."""
    gen = SpeculativeGenerator(model, tokenizer)
    out = []
    for ids in prompt_ids:
        res = gen.generate(input_ids=ids, max_new_tokens=max_new_tokens)
        out.append((list(ids) + list(res.token_ids), len(ids)))
    return out


def _rank_of(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Rank (0 = best) of target[i] in logits[i]: the number of tokens with a strictly higher logit."""
    t = logits.gather(-1, target[:, None])
    return (logits > t).sum(-1)


def _positions(seq_len: int, prompt_len: int) -> range:
    # p: the hidden state h_p produced the pending token S[p + 1]. The engine's first pending token is the
    # last prompt token (p = prompt_len - 2); its last step has S[seq_len - 2] pending.
    return range(max(prompt_len - 2, 0), seq_len - 2)


def _past_the_end(ps, seq_len: int, depth: int) -> np.ndarray:
    """[positions, depth] mask of the drafts decoding never verifies at the end of a sequence: the
    engine drafts no deeper than its remaining budget less one (the last token is the target's), so a
    depth-d draft at p exists only while S[p + 2 + d] is not the sequence's last token. (An answer that
    ends with EOS behaves the same for tokens per step: the step that reaches EOS emits it either way.)"""
    return np.asarray(ps)[:, None] + 2 + np.arange(depth)[None] > seq_len - 2


@torch.inference_mode()
def head_ranks(model, heads, embed, seqs, depth: int, max_rank: int, chunk: int = 64) -> list[np.ndarray]:
    """r_d(p) for Medusa / Hydra heads on the target's hidden states along greedy sequences."""
    if depth > heads.num_heads:
        raise HydraspecError(f"tree depth {depth} exceeds the number of heads ({heads.num_heads})")
    out = []
    dev = model.device
    for seq, plen in seqs:
        ps = list(_positions(len(seq), plen))
        if not ps:
            out.append(np.zeros((0, depth), dtype=np.int64))
            continue
        x = torch.tensor([seq], device=dev)
        hid = features(model, model(input_ids=x, output_hidden_states=True, use_cache=False).hidden_states)[0]
        if getattr(heads, "prefix", None) is not None:  # Hydra++: what the heads read (same as step by step)
            hid = heads.prefixed(hid)
        s = torch.tensor(seq, device=dev)
        emb = embed(s[None])[0] if heads.kind != "medusa" else None
        r = torch.zeros(len(ps), depth, dtype=torch.long)
        if heads.method == "eagle":  # depth d along the correct path: the head's depth-d guess at p + d
            n = len(seq) - 2
            guesses = heads.guesses(hid[:n], emb[1:n + 1], depth)
            chunks = [(0, torch.tensor(ps, device=dev))]
        else:
            chunks = [(a, torch.tensor(ps[a:a + chunk], device=dev)) for a in range(0, len(ps), chunk)]
        for a, p in chunks:
            h = hid[p]
            for d in range(depth):
                if heads.method == "eagle":
                    lg = full_vocab_logits(heads, heads.logits(d, guesses[d][(p + d).clamp(max=n - 1)]).float())
                elif heads.kind == "medusa":
                    lg = full_vocab_logits(heads, heads.logits(d, h).float())
                else:
                    idx = p[:, None] + 1 + torch.arange(d + 1, device=dev)[None]  # S[p+1 .. p+1+d]
                    lg = full_vocab_logits(heads, heads.logits(d, h, emb[idx.clamp(max=len(seq) - 1)]).float())
                r[a:a + len(p), d] = _rank_of(lg, s[(p + 2 + d).clamp(max=len(seq) - 1)]).cpu()
        r = r.clamp(max=max_rank).numpy()
        r[_past_the_end(ps, len(seq), depth)] = max_rank
        out.append(r)
    return out


def draft_ranks(draft_model, seqs, depth: int, max_rank: int, confidence: float | None = None) -> list[np.ndarray]:
    """r_d(p) for a draft model's top-k tree: its next-token ranking after S[.. p + 1 + d].
    `confidence` (the greedy early stop of `--draft-confidence`): where the draft model's top
    probability after S[.. p + 1 + d] is below it for some d >= 1, decoding drafts nothing from depth d
    on, so those ranks become "not proposed" (max_rank). This is exact for chains; for a branching tree,
    which is cut only where every parent of a level is unsure, it looks at the parent on the correct
    path only (a slightly pessimistic estimate)."""
    return draft_ranks_and_levels(draft_model, seqs, depth, max_rank, confidence)[0]


def draft_ranks_and_levels(draft_model, seqs, depth: int, max_rank: int,
                           confidence: float | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """draft_ranks, and per sequence the number of levels drafted at each position before the
    confidence stop (what the draft model's work per step depends on; the engine trims drafts to its
    token budget only after drafting, so the budget does not shorten them)."""
    return ranks_and_levels(draft_scores(draft_model, seqs), seqs, depth, max_rank, confidence)


@torch.inference_mode()
def draft_scores(draft_model, seqs) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sequence S, from one forward of the draft model over it: (R, top) with R[j] the draft's rank
    of S[j + 1] after S[.. j] and top[j] the log of its top probability there. Everything the replay
    needs for any tree depth and any confidence stop."""
    out = []
    dev = draft_model.device
    for seq, _ in seqs:
        s = torch.tensor(seq, device=dev)
        lg = draft_model(input_ids=s[None], use_cache=False).logits[0].float()
        out.append((_rank_of(lg[:-1], s[1:]).cpu().numpy(), log_top_prob(lg).cpu().numpy()))
    return out


def ranks_and_levels(scores, seqs, depth: int, max_rank: int,
                     confidence: float | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """draft_ranks_and_levels from draft_scores (so several stops cost one pass of the draft model)."""
    out, levels = [], []
    for (seq, plen), (R, top) in zip(seqs, scores):
        ps = np.array(list(_positions(len(seq), plen)), dtype=np.int64)
        if not len(ps):
            out.append(np.zeros((0, depth), dtype=np.int64))
            levels.append(np.zeros(0, dtype=np.int64))
            continue
        idx = np.minimum(ps[:, None] + 1 + np.arange(depth)[None], len(R) - 1)
        r = np.minimum(R[idx], max_rank)
        stop = np.zeros(r.shape, dtype=bool)
        if confidence:
            unsure = top[idx] < np.log(confidence)
            unsure[:, 0] = False  # the chain always drafts its first token
            stop = np.cumsum(unsure, axis=1) > 0
        r[stop | _past_the_end(ps, len(seq), depth)] = max_rank
        out.append(r)
        levels.append((~stop).sum(1))
    return out, levels


__all__ = ["Calibration", "greedy_sequences", "head_ranks", "draft_ranks", "draft_ranks_and_levels", "draft_scores",
           "ranks_and_levels"]
