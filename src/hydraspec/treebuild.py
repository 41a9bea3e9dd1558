"""Data-driven token trees (`hydraspec build-tree`).

Calibration data are the target's own greedy continuations of calibration prompts, generated with the
engine. At every position p of such a sequence S (S[p + 1] is the pending token, the hidden state h_p
produced it) the drafter's depth-d proposals under the pending token aim at S[p + 2 + d]. Under greedy
verification only the drafter's proposals along the *correct* path matter: a node can only be accepted
if its parent was, and its token is right exactly when it equals the target's greedy token. So one
number per (position, depth) says everything: r_d(p), the rank of S[p + 2 + d] among the drafter's
proposals given the correct path (Medusa head d on h_p; Hydra head d on h_p and the embeddings of
S[p + 1 .. p + 1 + d]; a draft model's next-token ranking after S[.. p + 1 + d]). A tree of rank paths
then accepts, at position p, the longest prefix (r_0(p), ..., r_{k-1}(p)) that is one of its paths.
Where decoding would not draft a node at all -- past the token budget at the end of a sequence, or
below the point where a draft model's confidence stop (`--draft-confidence`) ends its chain -- its rank
is recorded as "not proposed", so replaying a tree walks the sequence exactly as greedy decoding does,
last step included.

Two ways to grow nested trees T_1 ⊂ T_2 ⊂ ... ⊂ T_N, one node at a time:

- `medusa` (Cai et al. 2024): a_d^(i) = P(r_d = i), and under independence a path [i_0 .. i_{k-1}] is
  accepted with probability Π_d a_d^(i_d); the expected tokens per verify step of a tree is 1 (the
  target's bonus token) + the sum of its paths' probabilities; add the node with the largest one.
- `simulate`: replay decoding on the calibration sequences with the tree (each step accepts the longest
  matching prefix, then moves past the accepted tokens and the bonus token) and add the child that most
  increases the observed mean tokens per step. Candidates are the children of the tree's nodes; the
  `preselect` with the most matching positions are replayed.

`--select measure` then times a verify step and the drafter's step for a few tree sizes on the actual
device / dtype, predicts tokens/s(n) = E[tokens per step](T_n) / step_time(n), confirms the best few
by generating on the calibration prompts and keeps the fastest. For a draft model it does so for
several confidence stops (the draft's top probability below the stop ends a branch): each stop has its
own replay and its own nested trees, and the (stop, size) pair measured fastest wins, its stop recorded
in tree.json for decoding.
"""
from __future__ import annotations

import heapq
import json
import os
import platform
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import HydraspecError
from .drafters.heads import full_vocab_logits
from .tree import TREE_FORMAT, bfs_paths, parents_from_paths, shape_of

# ---- calibration data ----------------------------------------------------------------------------


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
    from .generator import SpeculativeGenerator

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
        hid = model(input_ids=x, output_hidden_states=True, use_cache=False).hidden_states[-1][0]
        if getattr(heads, "prefix", None) is not None:  # Hydra++: what the heads read (same as step by step)
            hid = heads.prefixed(hid)
        s = torch.tensor(seq, device=dev)
        emb = embed(s[None])[0] if heads.kind != "medusa" else None
        r = torch.zeros(len(ps), depth, dtype=torch.long)
        for a in range(0, len(ps), chunk):
            p = torch.tensor(ps[a:a + chunk], device=dev)
            h = hid[p]
            for d in range(depth):
                if heads.kind == "medusa":
                    lg = full_vocab_logits(heads, heads.logits(d, h).float())
                else:
                    idx = p[:, None] + 1 + torch.arange(d + 1, device=dev)[None]  # S[p+1 .. p+1+d]
                    lg = full_vocab_logits(heads, heads.logits(d, h, emb[idx.clamp(max=len(seq) - 1)]).float())
                r[a:a + len(ps[a:a + chunk]), d] = _rank_of(lg, s[(p + 2 + d).clamp(max=len(seq) - 1)]).cpu()
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
    from .drafters.draft_model import log_top_prob

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


# ---- growing trees -------------------------------------------------------------------------------


def acceptance_table(cal: Calibration) -> np.ndarray:
    """a[d, i] = P(r_d = i): how often the drafter's rank-i proposal at depth d is the target's token."""
    allr = np.concatenate(cal.ranks) if cal.ranks else np.zeros((0, cal.depth), dtype=np.int64)
    a = np.zeros((cal.depth, cal.max_rank))
    if len(allr):
        for d in range(cal.depth):
            a[d] = np.bincount(allr[:, d], minlength=cal.max_rank + 1)[: cal.max_rank] / len(allr)
    return a


def expected_tokens(paths: list[list[int]], a: np.ndarray) -> float:
    """1 + Σ_paths Π_d a[d, path[d]]: expected tokens per verify step under independence."""
    total = 1.0
    for p in paths:
        prob = 1.0
        for d, i in enumerate(p):
            prob *= a[d, i] if d < a.shape[0] and i < a.shape[1] else 0.0
        total += prob
    return total


def grow_medusa(a: np.ndarray, max_nodes: int) -> tuple[list[list[int]], list[float]]:
    """Greedy growth by path probability (paths in the order added: every prefix is a tree).
    Returns the order and the expected tokens per step of T_1 .. T_N."""
    depth, K = a.shape
    heap = [(-float(a[0, i]), (i,)) for i in range(K)]
    heapq.heapify(heap)
    order, exp, total = [], [], 1.0
    while heap and len(order) < max_nodes:
        negp, path = heapq.heappop(heap)
        order.append(list(path))
        total += -negp
        exp.append(total)
        if len(path) < depth:
            for i in range(K):
                heapq.heappush(heap, (negp * float(a[len(path), i]), path + (i,)))
    return order, exp


def _accepted(r: np.ndarray, tree: set) -> int:
    k = 0
    while k < len(r) and tuple(r[: k + 1]) in tree:
        k += 1
    return k


def replay_steps(ranks, tree: set) -> list[int]:
    """Drafts accepted at each verify step when greedy decoding replays one calibration sequence with
    `tree` (a set of rank-path tuples): a step at position p accepts the longest matching prefix of
    r(p) and emits it plus the bonus token, so the next step is at p + accepted + 1.
    ranks: [positions, depth] array, or its rows as tuples."""
    rows = ranks if isinstance(ranks, list) else [tuple(int(x) for x in row) for row in ranks]
    out, p = [], 0
    while p < len(rows):
        acc = _accepted(rows[p], tree)
        out.append(acc)
        p += acc + 1
    return out


def replay(cal: Calibration, tree: set) -> float:
    """Mean tokens per verify step (accepted drafts + the bonus token) over the calibration sequences."""
    tokens = steps = 0
    for r in cal.rows():
        acc = replay_steps(r, tree)
        tokens += sum(acc) + len(acc)
        steps += len(acc)
    return tokens / steps if steps else 1.0


def drafted_nodes(cal: Calibration, paths: list[list[int]]) -> float:
    """Mean number of T's nodes a drafter actually drafts per verify step when greedy decoding replays
    the calibration sequences with T (nodes deeper than the levels drafted at that position are not
    drafted); len(paths) without `cal.levels`."""
    if cal.levels is None:
        return float(len(paths))
    tree = set(map(tuple, paths))
    per_depth = np.bincount([len(p) - 1 for p in paths], minlength=cal.depth)
    cum = np.concatenate([[0], np.cumsum(per_depth)])  # cum[k]: nodes in the first k levels
    total = steps = 0
    for rows, lv in zip(cal.rows(), cal.levels):
        acc = replay_steps(rows, tree)
        at = np.cumsum([0] + [a + 1 for a in acc[:-1]])  # the position of each step
        total += int(cum[np.minimum(lv[at], len(cum) - 1)].sum()) if acc else 0
        steps += len(acc)
    return total / steps if steps else float(len(paths))


def grow_simulate(cal: Calibration, max_nodes: int, preselect: int = 8) -> tuple[list[list[int]], list[float]]:
    """Greedy growth by replayed mean tokens per step (no independence assumption)."""
    counts: Counter = Counter()
    for r in cal.ranks:
        for row in r:
            for k in range(cal.depth):
                if row[k] >= cal.max_rank:
                    break
                counts[tuple(int(x) for x in row[: k + 1])] += 1
    tree: set = set()
    order, exp = [], []
    while len(order) < max_nodes:
        cands = [t for t in counts if t not in tree and (len(t) == 1 or t[:-1] in tree)]
        if not cands:  # nothing observed can be added: grow by the next unused rank, deepest-first order
            cands = [t + (i,) for t in sorted(tree, key=lambda t: (len(t), t)) + [()]
                     for i in range(cal.max_rank) if len(t) < cal.depth and t + (i,) not in tree][:1]
            if not cands:
                break
            best = cands[0]
            score = replay(cal, tree | {best})
        else:
            cands.sort(key=lambda t: (-counts[t], len(t), t))
            scored = [(replay(cal, tree | {t}), -counts[t], t) for t in cands[:preselect]]
            scored.sort(key=lambda x: (-x[0], x[1], len(x[2]), x[2]))
            score, _, best = scored[0]
        tree.add(best)
        order.append(list(best))
        exp.append(score)
    return order, exp


# ---- timing ---------------------------------------------------------------------------------------


def machine_info(model) -> dict:
    dev = model.device
    info = {"device": str(dev), "dtype": str(model.dtype).removeprefix("torch."), "batch_size": 1,
            "torch_threads": torch.get_num_threads()}
    if dev.type == "cuda":
        info["machine"] = torch.cuda.get_device_name(dev)
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        info["machine"] = f"{name} ({os.cpu_count()} cores)"
    return info


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def sample_sizes(n: int) -> list[int]:
    sizes, s = [], 1
    while s < n:
        sizes.append(s)
        s *= 2
    return sizes + [n]


def interpolate(sizes: list[int], values: list[float], n: int) -> float:
    return float(np.interp(n, sizes, values))


def _verify_inputs(order: list[list[int]], n: int, prefix: list[int], seq: list[int]):
    """Tree T_n as one verify step after `prefix` would see it: (paths, shape with the pending token as
    root, token ids [pending + n nodes] taken from `seq`, positions)."""
    L = len(prefix) - 1
    paths = bfs_paths(order[:n])
    parents, _ = parents_from_paths(paths)
    shape = shape_of((-1,) + tuple(p + 1 for p in parents))
    ids = [prefix[-1]] + [seq[(L + 1 + i) % len(seq)] for i in range(n)]
    return paths, shape, ids, L + shape.depth


@torch.inference_mode()
def time_steps(model, make, order: list[list[int]], seq: list[int], plen: int, sizes: list[int],
               reps: int = 5, want_hidden: bool = True,
               accepted: dict[int, int] | None = None) -> dict[int, tuple[float, float]]:
    """{n: (verify seconds, draft seconds)}: the median of `reps` verify forwards over the pending token
    and T_n under its tree mask after the calibration prefix, and of `reps` drafter steps for T_n.
    Between drafter steps the sequence advances as decoding would: `accepted[n]` nodes of the rank-0
    path are accepted (reported to the drafter, so a draft model keeps them cached) plus the target's
    token, so the catch-up work of the next step is part of the timing (default: nothing accepted)."""
    from .cache import new_cache
    from .drafters.base import DecodeState
    from .sampling import Sampling
    from .verify import forward_nodes

    dev = model.device
    prefix = seq[: max(plen, 2)]
    L = len(prefix) - 1
    cache = new_cache(model, len(seq) + max(sizes) + reps + 8)
    _, hid = forward_nodes(model, cache, torch.tensor(prefix[:-1], device=dev), torch.arange(L, device=dev), None, 0,
                           want_hidden=True, last_only=True)
    hidden = hid[-1]
    out = {}
    for n in sizes:
        paths, shape, ids, positions = _verify_inputs(order, n, prefix, seq)
        ids, positions = torch.tensor(ids, device=dev), positions.to(dev)
        anc = None if shape.is_chain else shape.ancestors
        times = []
        for _ in range(reps + 1):
            _sync(dev)
            t0 = time.perf_counter()
            forward_nodes(model, cache, ids, positions, anc, L, want_hidden=want_hidden)
            _sync(dev)
            times.append(time.perf_counter() - t0)
            cache.crop(L)
        verify = float(np.median(times[1:]))
        drafter = make(paths)
        tokens = list(prefix)
        state = DecodeState(tokens=tokens, prompt_len=plen, sampling=Sampling(), hidden=hidden, new_hidden=hid)
        drafter.start(state, len(seq) + max(sizes) + reps + 8)
        index = {tuple(p): i for i, p in enumerate(paths)}
        chain = []  # node indices of the rank-0 path, as deep as T_n holds it
        while (0,) * (len(chain) + 1) in index:
            chain.append(index[(0,) * (len(chain) + 1)])
        acc = chain[: max(0, (accepted or {}).get(n, 0))]
        dtimes = []
        for r in range(reps + 1):
            _sync(dev)
            t0 = time.perf_counter()
            drafter.propose(state)
            _sync(dev)
            dtimes.append(time.perf_counter() - t0)
            drafter.observe(state, list(acc))
            for _ in range(len(acc) + 1):  # the accepted nodes and the target's token, as in decoding
                state.tokens.append(seq[len(state.tokens) % len(seq)])
        out[n] = (verify, float(np.median(dtimes[1:])))
    return out


@torch.inference_mode()
def time_batch_verify(model, order: list[list[int]], seq: list[int], plen: int, sizes: list[int], batch: int,
                      reps: int = 3) -> dict[int, float]:
    """{n: seconds}: the median of `reps` verify forwards of `batch` rows, each holding the pending token
    and T_n under its tree mask after the same calibration prefix (what one step of the batched engine
    costs when every row drafts T_n)."""
    from .cache import new_cache
    from .verify import tree_mask

    dev = model.device
    prefix = seq[: max(plen, 2)]
    L = len(prefix) - 1
    cache = new_cache(model, L + max(sizes) + 2)
    rows = torch.tensor([prefix[:-1]] * batch, device=dev)
    model(input_ids=rows, past_key_values=cache, use_cache=True, logits_to_keep=1)
    out = {}
    for n in sizes:
        _, shape, ids, positions = _verify_inputs(order, n, prefix, seq)
        ids = torch.tensor([ids] * batch, device=dev)
        positions = positions.to(dev)[None].expand(batch, -1)
        mask = None if shape.is_chain else tree_mask(L, shape.ancestors, model.dtype, dev).expand(batch, -1, -1, -1)
        times = []
        for _ in range(reps + 1):
            _sync(dev)
            t0 = time.perf_counter()
            model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True)
            _sync(dev)
            times.append(time.perf_counter() - t0)
            cache.crop(L)
        out[n] = float(np.median(times[1:]))
    return out


def measure_throughput(model, tokenizer, drafter, prompt_ids: list[list[int]], max_new_tokens: int) -> dict:
    """Greedy generation over the calibration prompts (after one warm-up), as tree.json records it:
    end-to-end tokens/s, tokens/s after the prefill (what the per-step prediction models) and the mean
    tokens per target forward."""
    from .generator import SpeculativeGenerator

    gen = SpeculativeGenerator(model, tokenizer, drafter)
    gen.generate(input_ids=prompt_ids[0], max_new_tokens=min(8, max_new_tokens))
    toks, forwards, wall, prefill = 0, 0, 0.0, 0.0
    for ids in prompt_ids:
        _sync(model.device)
        t0 = time.perf_counter()
        res = gen.generate(input_ids=ids, max_new_tokens=max_new_tokens)
        _sync(model.device)
        wall += time.perf_counter() - t0
        toks += len(res.token_ids)
        forwards += res.stats.target_forwards
        prefill += res.stats.prefill_s
    return {"measured_tokens_per_s": round(toks / wall if wall > 0 else 0.0, 4),
            "measured_decode_tokens_per_s": round(toks / (wall - prefill) if wall > prefill else 0.0, 4),
            "measured_tokens_per_step": round(toks / forwards if forwards else 0.0, 5)}


# ---- the whole build ------------------------------------------------------------------------------

# confidence stops build-tree tries for a draft model unless told one: off, then stricter and stricter
DEFAULT_STOPS = (0.0, 0.4, 0.6, 0.8, 0.9)


def stop_candidates(spec) -> list:
    """The draft model's confidence stops to choose among: None (off, as before), a number, a list of
    numbers, or "auto" (DEFAULT_STOPS). A stop is a probability in [0, 1); 0 is off."""
    if spec is None:
        return [None]
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text == "auto":
            return list(DEFAULT_STOPS)
        try:
            spec = [float(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise HydraspecError(f"--draft-confidence takes a probability, a comma-separated list of them or "
                                 f"'auto', got {spec!r}") from None
    values = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    if not values:
        raise HydraspecError("no draft confidence stop given")
    for v in values:
        if not isinstance(v, (int, float)) or not 0 <= v < 1:
            raise HydraspecError(f"a draft confidence stop must be in [0, 1), got {v!r}")
    return list(dict.fromkeys(float(v) for v in values))


def _stop_label(c) -> str:
    return "" if c is None else (" (no stop)" if c == 0 else f" (stop {c:g})")


def _stop_summary(stops, sizes_of, grown) -> list[dict]:
    """Per confidence stop tried: its best tree by predicted tokens/s (or the largest without timing)."""
    out = []
    for c in stops:
        rows = sizes_of[c]
        timed = [r for r in rows if r["predicted_tokens_per_s"] is not None]
        r = max(timed, key=lambda r: r["predicted_tokens_per_s"]) if timed else rows[-1]
        out.append({"confidence": c, "nodes": r["nodes"], "depth": r["depth"],
                    "expected_tokens_per_step": r["expected_tokens_per_step"],
                    **{k: r[k] for k in ("drafted_nodes", "predicted_tokens_per_s", "measured_tokens_per_s")
                       if r.get(k) is not None}})
    return out



def build_tree(model, tokenizer, *, prompt_ids: list[list[int]], prompt_names: list[str], max_nodes: int = 100,
               method: str = "simulate", select: str = "measure", heads=None, draft_model=None,
               depth: int | None = None,
               max_rank: int = 10, max_new_tokens: int = 128, confirm: int = 3, reps: int = 5, preselect: int = 8,
               batch_sizes: list[int] | None = None, default_paths: list[list[int]] | None = None,
               draft_confidence: float | list[float] | str | None = None, log=print) -> dict:
    """Build a tree for `heads` (Medusa / Hydra) or `draft_model` (its top-k tree); returns the tree.json
    dict. prompt_names are recorded as the calibration prompts used. With select="measure" and
    `batch_sizes`, the verify step is also timed with B rows for every B > 1 and a tree is chosen per
    batch size by predicted tokens/s = B x expected tokens per step / (verify_B + draft time at batch 1);
    the result's "by_batch" holds them ({B: paths}, read by --batch-trees). With select="measure" the
    drafter's default (`default_paths`, e.g. the heads checkpoint's tree; None: the built-in default tree
    of the heads or the draft model's adaptive chain) is measured the same way and reported beside the
    selected tree (result "default"). `draft_confidence`: the draft model's early stop, applied to the
    timed and confirmed trees as `--draft-confidence` applies it in decoding (None: off for static
    trees, the chain's 0.4 for the default chain). Several stops (a list, or "auto" for DEFAULT_STOPS):
    trees are grown, predicted and ranked for each; the confirmed (stop, size) with the best measured
    tokens/s wins, its stop is recorded as drafter.confidence (decoding with the tree uses it unless told
    another), the default chain keeps its own stop, and "stops" sums up each stop's best tree."""
    if (heads is None) == (draft_model is None):
        raise HydraspecError("build-tree needs exactly one drafter: heads or a draft model")
    if method not in ("medusa", "simulate"):
        raise HydraspecError(f"unknown tree method '{method}'; known: medusa, simulate")
    if select not in ("measure", "none"):
        raise HydraspecError(f"unknown selection '{select}'; known: measure, none")
    if max_nodes < 1 or max_rank < 1:
        raise HydraspecError("--max-nodes and --max-rank must be at least 1")
    if not prompt_ids:
        raise HydraspecError("build-tree needs at least one calibration prompt")
    if heads is not None:
        depth = heads.num_heads if depth is None else depth
        if depth > heads.num_heads:
            raise HydraspecError(f"tree depth {depth} exceeds the number of heads ({heads.num_heads})")
    depth = depth or 6
    if depth < 1:
        raise HydraspecError("--max-depth must be at least 1")

    stops = stop_candidates(draft_confidence) if heads is None else [None]
    t0 = time.perf_counter()
    seqs = greedy_sequences(model, tokenizer, prompt_ids, max_new_tokens)
    log(f"calibration: {len(seqs)} greedy continuations ({sum(len(s) - p for s, p in seqs)} tokens) "
        f"in {time.perf_counter() - t0:.1f} s")
    scores = draft_scores(draft_model, seqs) if heads is None else None
    kind = heads.kind if heads is not None else "draft"
    grown = {}  # confidence stop -> (Calibration, growth order, expected tokens per step of T_1..T_N)
    for c in stops:
        if heads is not None:
            cal = Calibration(head_ranks(model, heads, model.get_input_embeddings(), seqs, depth, max_rank), depth,
                              max_rank, list(prompt_names))
        else:  # levels only vary with a stop
            ranks, levels = ranks_and_levels(scores, seqs, depth, max_rank, confidence=c)
            cal = Calibration(ranks, depth, max_rank, list(prompt_names), levels=levels if c else None)
        if cal.positions == 0:
            raise HydraspecError("no calibration positions: every greedy continuation is shorter than 2 tokens; "
                                 "raise --max-new-tokens or use other prompts")
        order, exp = grow_medusa(acceptance_table(cal), max_nodes) if method == "medusa" else \
            grow_simulate(cal, max_nodes, preselect=preselect)
        grown[c] = (cal, order, exp)
        log(f"{method}{_stop_label(c)}: {len(order)} nested trees from {cal.positions} positions; expected "
            f"tokens/step T1 {exp[0]:.3f}, T{len(order)} {exp[-1]:.3f}")

    def make(paths, stop):  # paths None: the drafter's default
        from .drafters import make_drafter

        if heads is not None:
            return make_drafter(heads.kind, heads=heads, embed=model.get_input_embeddings(), tree=paths)
        return make_drafter("draft", draft_model=draft_model, tree=paths, confidence=stop)

    def size_rows(c):
        cal, order, exp = grown[c]
        return [{"nodes": n, "depth": len(max(order[:n], key=len)), "expected_tokens_per_step": round(exp[n - 1], 5),
                 "verify_s": None, "draft_s": None, "step_s": None, "predicted_tokens_per_s": None,
                 "measured_tokens_per_s": None} for n in range(1, len(order) + 1)]

    sizes_of = {c: size_rows(c) for c in stops}
    best_stop, best = stops[0], len(grown[stops[0]][1])
    by_batch: dict[str, int] = {}
    timings: dict = {}  # growth order -> (verify times, draft times) at its sampled sizes: shared by equal orders
    if select == "measure":
        seq, plen = max(seqs, key=lambda x: len(x[0]))
        for c in stops:
            cal, order, exp = grown[c]
            sample = sample_sizes(len(order))
            key = tuple(map(tuple, order))
            if key not in timings:
                # With the confidence stop, how much a draft model drafts per step depends on the text, so
                # timing it on one sequence says little: time whole trees (no stop) and charge each T_n the
                # verify and draft time of as many nodes as the replay shows it drafting per step on average.
                timed = time_steps(model, lambda paths: make(paths, 0.0), order, seq, plen, sample, reps=reps,
                                   want_hidden=heads is not None,
                                   accepted={n: int(round(exp[n - 1])) - 1 for n in sample})
                timings[key] = ([timed[n][0] for n in sample], [timed[n][1] for n in sample])
            vs, ds = timings[key]
            for row in sizes_of[c]:
                n = row["nodes"]
                drafted = drafted_nodes(cal, order[:n])
                if cal.levels is not None:
                    row["drafted_nodes"] = round(drafted, 3)
                v, d = interpolate(sample, vs, drafted), interpolate(sample, ds, drafted)
                row.update(verify_s=round(v, 6), draft_s=round(d, 6), step_s=round(v + d, 6),
                           predicted_tokens_per_s=round(row["expected_tokens_per_step"] / (v + d), 4),
                           timed=n in sample)
        candidates = sorted(((c, row) for c in stops for row in sizes_of[c]),
                            key=lambda cr: -cr[1]["predicted_tokens_per_s"])[: max(1, confirm)]
        for c, row in candidates:
            order = grown[c][1]
            row.update(measure_throughput(model, tokenizer, make(bfs_paths(order[: row["nodes"]]), c), prompt_ids,
                                          max_new_tokens))
            log(f"  T{row['nodes']}{_stop_label(c)}: predicted {row['predicted_tokens_per_s']:.2f} tokens/s and "
                f"{row['expected_tokens_per_step']:.2f} tokens/step; measured {row['measured_tokens_per_s']:.2f} "
                f"tokens/s ({row['measured_decode_tokens_per_s']:.2f} after the prefill) and "
                f"{row['measured_tokens_per_step']:.2f} tokens/step")
        best_stop, chosen = max(candidates, key=lambda cr: cr[1]["measured_tokens_per_s"])
        best = chosen["nodes"]
        # the default: the heads' tree, or the draft model's adaptive chain with its own stop unless one
        # stop was asked for
        base_stop = stops[0] if heads is None and len(stops) == 1 else None
        baseline = {"tree": default_paths if default_paths is not None else
                    ("the heads' built-in default tree" if heads is not None else "the adaptive-length chain"),
                    **({"confidence": base_stop} if base_stop is not None else {}),
                    **measure_throughput(model, tokenizer, make(default_paths, base_stop), prompt_ids,
                                         max_new_tokens)}
        faster = baseline["measured_tokens_per_s"] > chosen["measured_tokens_per_s"]
        log(f"  default drafter: measured {baseline['measured_tokens_per_s']:.2f} tokens/s, "
            f"{baseline['measured_tokens_per_step']:.2f} tokens/step"
            + (f" -- faster than the selected T{best} ({chosen['measured_tokens_per_s']:.2f}) on these prompts: "
               "the default is the better choice here" if faster else ""))
        rows, border = sizes_of[best_stop], grown[best_stop][1]
        for B in sorted({int(b) for b in batch_sizes or []} - {1}):
            if B < 1:
                raise HydraspecError(f"batch sizes must be positive, got {B}")
            sample = sample_sizes(len(border))
            vb = time_batch_verify(model, border, seq, plen, sample, B, reps=max(1, reps // 2))
            vbs = [vb[n] for n in sample]
            for row in rows:
                n = row["nodes"]
                v = interpolate(sample, vbs, n)
                row.setdefault("by_batch", {})[str(B)] = {
                    "verify_s": round(v, 6),
                    "predicted_tokens_per_s": round(B * row["expected_tokens_per_step"] / (v + row["draft_s"]), 4)}
            pick = max(rows, key=lambda r: r["by_batch"][str(B)]["predicted_tokens_per_s"])
            by_batch[str(B)] = pick["nodes"]
            log(f"  batch {B}: T{pick['nodes']} predicted {pick['by_batch'][str(B)]['predicted_tokens_per_s']:.2f} "
                f"tokens/s over the batch")
    sizes, (cal, order, exp) = sizes_of[best_stop], grown[best_stop]
    a = acceptance_table(cal)
    winner = bfs_paths(order[:best])
    return {
        "format": TREE_FORMAT, "version": 1,
        "paths": winner, "nodes": best,
        "notes": "paths: the chosen tree (rank paths, BFS order); order: the growth order, T_n = order[:n]; "
                 "expected_tokens_per_step: accepted drafts + the target's bonus token, comparable to "
                 "mean_accepted in hydraspec bench; times in seconds, measured on measured_on (batch size 1); "
                 "measured_tokens_per_s: greedy generation on the calibration prompts, end to end (the "
                 "selection criterion); measured_decode_tokens_per_s: the same without the prefill time, "
                 "comparable to predicted_tokens_per_s; measured_tokens_per_step: its mean accepted length; "
                 "drafted_nodes (draft model with a confidence stop): nodes drafted per step in the replay, "
                 "verify_s and draft_s are the timed whole-tree times at that many nodes; drafter.confidence: the "
                 "stop the tree was chosen with, used when decoding with it; stops: each stop tried, with its "
                 "best tree",
        "method": method, "select": select,
        "drafter": {"kind": kind, "depth": depth, "max_rank": max_rank,
                    **({"confidence": best_stop} if heads is None and best_stop is not None else {}),
                    **({"num_heads": heads.num_heads} if heads is not None else {})},
        "order": order,
        "acceptance": [[round(float(x), 5) for x in row] for row in a],
        "sizes": sizes,
        "measured_on": machine_info(model),
        **({"by_batch": {"1": winner, **{b: bfs_paths(order[:n]) for b, n in by_batch.items()}}} if by_batch else {}),
        **({"default": baseline} if select == "measure" else {}),
        **({"stops": _stop_summary(stops, sizes_of, grown)} if len(stops) > 1 else {}),
        "calibration": {"prompts": list(prompt_names), "sequences": len(seqs), "positions": cal.positions,
                        "max_new_tokens": max_new_tokens},
    }


def save_tree(result: dict, path) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def plot_tree(result: dict, path) -> None:
    """PNG: expected tokens per step, step time and tokens/s against tree size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["sizes"]
    n = [r["nodes"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(7, 9), sharex=True)
    axes[0].plot(n, [r["expected_tokens_per_step"] for r in rows], marker=".", label="expected (replay)")
    steps = [(r["nodes"], r["measured_tokens_per_step"]) for r in rows if r.get("measured_tokens_per_step")]
    if steps:
        axes[0].scatter(*zip(*steps), color="C3", label="measured (calibration prompts)", zorder=3)
        axes[0].legend()
    axes[0].set_ylabel("tokens / step")
    if rows and rows[0]["step_s"] is not None:
        axes[1].plot(n, [r["step_s"] * 1e3 for r in rows], label="verify + draft")
        axes[1].plot(n, [r["verify_s"] * 1e3 for r in rows], label="verify", linestyle="--")
        axes[1].legend()
        axes[2].plot(n, [r["predicted_tokens_per_s"] for r in rows], label="predicted (per step)")
        dec = [(r["nodes"], r["measured_decode_tokens_per_s"]) for r in rows if r.get("measured_decode_tokens_per_s")]
        if dec:
            axes[2].scatter(*zip(*dec), color="C1", marker="x", label="measured after the prefill", zorder=3)
        m = [(r["nodes"], r["measured_tokens_per_s"]) for r in rows if r["measured_tokens_per_s"] is not None]
        if m:
            axes[2].scatter(*zip(*m), color="C3", label="measured end to end", zorder=3)
        base = (result.get("default") or {}).get("measured_tokens_per_s")
        if base:
            axes[2].axhline(base, color="C2", linestyle="--", label="default drafter, end to end")
        axes[2].legend(fontsize=8)
    else:
        for ax in axes[1:]:
            ax.text(0.5, 0.5, "not measured (--select none)", ha="center", va="center", transform=ax.transAxes)
    axes[1].set_ylabel("step time (ms)")
    axes[2].set_ylabel("tokens / s")
    axes[2].set_xlabel("tree size (draft nodes)")
    for ax in axes:
        ax.axvline(result["nodes"], color="grey", linestyle=":")  # the chosen tree
    axes[2].xaxis.get_major_locator().set_params(integer=True)
    mo = result.get("measured_on", {})
    stop = (result.get("drafter") or {}).get("confidence")
    stop = "" if stop is None else (", no draft stop" if stop == 0 else f", draft stop {stop:g}")
    fig.suptitle(f"{result['method']} tree{stop}, {mo.get('machine', '?')}, {mo.get('dtype', '?')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


__all__ = ["Calibration", "build_tree", "grow_medusa", "grow_simulate", "replay", "replay_steps", "expected_tokens",
           "acceptance_table", "head_ranks", "draft_ranks", "draft_ranks_and_levels", "drafted_nodes",
           "greedy_sequences", "save_tree", "plot_tree"]
