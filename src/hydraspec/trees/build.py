"""The whole build of a data-driven token tree (`hydraspec build-tree`): calibrate, grow, measure, pick.

Nested trees are grown from the target's greedy continuations (hydraspec.trees.calibrate, .grow; Medusa's
recipe, Cai et al. 2024, or a replay of decoding). `--select measure` then times a verify step and the
drafter's step for a few tree sizes on the actual device / dtype, predicts tokens/s(n) = E[tokens per
step](T_n) / step_time(n), confirms the best few by generating on the calibration prompts and keeps the
fastest. For a draft model it does so for several confidence stops (the draft's top probability below
the stop ends a branch): each stop has its own replay and its own nested trees, and the (stop, size)
pair measured fastest wins, its stop recorded in tree.json for decoding. A tree only chooses what is
drafted: decoding with it is as exact as with any other tree.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from ..drafters import make_drafter
from ..errors import HydraspecError
from ..tree import TREE_FORMAT, bfs_paths
from .calibrate import Calibration, draft_scores, greedy_sequences, head_ranks, ranks_and_levels
from .grow import acceptance_table, drafted_nodes, grow_medusa, grow_simulate
from .measure import (interpolate, machine_info, measure_throughput, sample_sizes, time_batch_verify,
                      time_steps)


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
    depth = _check(heads, draft_model, method, select, max_nodes, max_rank, prompt_ids, depth)
    stops = stop_candidates(draft_confidence) if heads is None else [None]
    t0 = time.perf_counter()
    seqs = greedy_sequences(model, tokenizer, prompt_ids, max_new_tokens)
    log(f"calibration: {len(seqs)} greedy continuations ({sum(len(s) - p for s, p in seqs)} tokens) "
        f"in {time.perf_counter() - t0:.1f} s")
    b = _Build(model, tokenizer, heads, draft_model, prompt_ids, max_new_tokens, reps, log)
    grown = _grow(b, seqs, stops, method, depth, max_rank, max_nodes, preselect, prompt_names)
    sizes_of = {c: _size_rows(grown[c]) for c in stops}
    best_stop, best = stops[0], len(grown[stops[0]][1])
    by_batch: dict[str, int] = {}
    baseline = None
    if select == "measure":
        seq, plen = max(seqs, key=lambda x: len(x[0]))
        _time_sizes(b, grown, sizes_of, stops, seq, plen)
        best_stop, chosen = _confirm(b, grown, sizes_of, stops, confirm)
        best = chosen["nodes"]
        baseline = _baseline(b, stops, default_paths, chosen)
        by_batch = _by_batch(b, sizes_of[best_stop], grown[best_stop][1], batch_sizes, seq, plen)
    return _result(b, grown, sizes_of, stops, best_stop, best, by_batch, baseline, seqs,
                   method=method, select=select, depth=depth, max_rank=max_rank, prompt_names=prompt_names)


def _check(heads, draft_model, method: str, select: str, max_nodes: int, max_rank: int, prompt_ids,
           depth: int | None) -> int:
    """Refuse what cannot be built; returns the tree depth (the number of heads, or 6 for a draft model)."""
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
    return depth


@dataclass
class _Build:
    """The target, the drafter (heads or a draft model) and what timing and confirming a tree need."""

    model: object
    tokenizer: object
    heads: object
    draft_model: object
    prompt_ids: list
    max_new_tokens: int
    reps: int
    log: object

    def make(self, paths, stop):
        """The drafter with tree ``paths`` (None: its default) and, for a draft model, confidence stop ``stop``."""
        if self.heads is not None:
            return make_drafter(self.heads.method, heads=self.heads, embed=self.model.get_input_embeddings(),
                                tree=paths)
        return make_drafter("draft", draft_model=self.draft_model, tree=paths, confidence=stop)

    def throughput(self, drafter) -> dict:
        return measure_throughput(self.model, self.tokenizer, drafter, self.prompt_ids, self.max_new_tokens)


def _grow(b: _Build, seqs, stops, method: str, depth: int, max_rank: int, max_nodes: int, preselect: int,
          prompt_names) -> dict:
    """confidence stop -> (Calibration, growth order, expected tokens per step of T_1..T_N)."""
    heads, model = b.heads, b.model
    scores = draft_scores(b.draft_model, seqs) if heads is None else None
    grown = {}
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
        b.log(f"{method}{_stop_label(c)}: {len(order)} nested trees from {cal.positions} positions; expected "
              f"tokens/step T1 {exp[0]:.3f}, T{len(order)} {exp[-1]:.3f}")
    return grown


def _size_rows(grown_c) -> list[dict]:
    cal, order, exp = grown_c
    return [{"nodes": n, "depth": len(max(order[:n], key=len)), "expected_tokens_per_step": round(exp[n - 1], 5),
             "verify_s": None, "draft_s": None, "step_s": None, "predicted_tokens_per_s": None,
             "measured_tokens_per_s": None} for n in range(1, len(order) + 1)]


def _time_sizes(b: _Build, grown: dict, sizes_of: dict, stops, seq, plen: int) -> None:
    """Each size's verify and draft time (timed at a few sizes, interpolated between) and predicted tokens/s."""
    timings: dict = {}  # growth order -> (verify times, draft times) at its sampled sizes: shared by equal orders
    for c in stops:
        cal, order, exp = grown[c]
        sample = sample_sizes(len(order))
        key = tuple(map(tuple, order))
        if key not in timings:
            # With the confidence stop, how much a draft model drafts per step depends on the text, so
            # timing it on one sequence says little: time whole trees (no stop) and charge each T_n the
            # verify and draft time of as many nodes as the replay shows it drafting per step on average.
            timed = time_steps(b.model, lambda paths: b.make(paths, 0.0), order, seq, plen, sample, reps=b.reps,
                               want_hidden=b.heads is not None,
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


def _confirm(b: _Build, grown: dict, sizes_of: dict, stops, confirm: int):
    """The best few (stop, size) by predicted tokens/s, generated on the calibration prompts; returns the
    fastest measured (stop, its size row)."""
    candidates = sorted(((c, row) for c in stops for row in sizes_of[c]),
                        key=lambda cr: -cr[1]["predicted_tokens_per_s"])[: max(1, confirm)]
    for c, row in candidates:
        order = grown[c][1]
        row.update(b.throughput(b.make(bfs_paths(order[: row["nodes"]]), c)))
        b.log(f"  T{row['nodes']}{_stop_label(c)}: predicted {row['predicted_tokens_per_s']:.2f} tokens/s and "
              f"{row['expected_tokens_per_step']:.2f} tokens/step; measured {row['measured_tokens_per_s']:.2f} "
              f"tokens/s ({row['measured_decode_tokens_per_s']:.2f} after the prefill) and "
              f"{row['measured_tokens_per_step']:.2f} tokens/step")
    return max(candidates, key=lambda cr: cr[1]["measured_tokens_per_s"])


def _baseline(b: _Build, stops, default_paths, chosen: dict) -> dict:
    """The drafter's default measured the same way: the heads' tree, or the draft model's adaptive chain with
    its own stop unless one stop was asked for."""
    base_stop = stops[0] if b.heads is None and len(stops) == 1 else None
    baseline = {"tree": default_paths if default_paths is not None else
                ("the heads' built-in default tree" if b.heads is not None else "the adaptive-length chain"),
                **({"confidence": base_stop} if base_stop is not None else {}),
                **b.throughput(b.make(default_paths, base_stop))}
    faster = baseline["measured_tokens_per_s"] > chosen["measured_tokens_per_s"]
    b.log(f"  default drafter: measured {baseline['measured_tokens_per_s']:.2f} tokens/s, "
          f"{baseline['measured_tokens_per_step']:.2f} tokens/step"
          + (f" -- faster than the selected T{chosen['nodes']} ({chosen['measured_tokens_per_s']:.2f}) on these "
             "prompts: the default is the better choice here" if faster else ""))
    return baseline


def _by_batch(b: _Build, rows: list[dict], border, batch_sizes, seq, plen: int) -> dict[str, int]:
    """For each batch size B > 1: the verify step timed with B rows and the tree size with the best predicted
    tokens/s over the batch."""
    by_batch: dict[str, int] = {}
    for B in sorted({int(x) for x in batch_sizes or []} - {1}):
        if B < 1:
            raise HydraspecError(f"batch sizes must be positive, got {B}")
        sample = sample_sizes(len(border))
        vb = time_batch_verify(b.model, border, seq, plen, sample, B, reps=max(1, b.reps // 2))
        vbs = [vb[n] for n in sample]
        for row in rows:
            n = row["nodes"]
            v = interpolate(sample, vbs, n)
            row.setdefault("by_batch", {})[str(B)] = {
                "verify_s": round(v, 6),
                "predicted_tokens_per_s": round(B * row["expected_tokens_per_step"] / (v + row["draft_s"]), 4)}
        pick = max(rows, key=lambda r: r["by_batch"][str(B)]["predicted_tokens_per_s"])
        by_batch[str(B)] = pick["nodes"]
        b.log(f"  batch {B}: T{pick['nodes']} predicted {pick['by_batch'][str(B)]['predicted_tokens_per_s']:.2f} "
              f"tokens/s over the batch")
    return by_batch


def _result(b: _Build, grown: dict, sizes_of: dict, stops, best_stop, best: int, by_batch: dict, baseline,
            seqs, *, method: str, select: str, depth: int, max_rank: int, prompt_names) -> dict:
    """The tree.json dict."""
    heads = b.heads
    sizes, (cal, order, exp) = sizes_of[best_stop], grown[best_stop]
    a = acceptance_table(cal)
    winner = bfs_paths(order[:best])
    return {
        "format": TREE_FORMAT, "version": 1,
        "paths": winner, "nodes": best,
        "notes": _NOTES,
        "method": method, "select": select,
        "drafter": {"kind": heads.kind if heads is not None else "draft", "depth": depth, "max_rank": max_rank,
                    **({"confidence": best_stop} if heads is None and best_stop is not None else {}),
                    **({"num_heads": heads.num_heads} if heads is not None else {})},
        "order": order,
        "acceptance": [[round(float(x), 5) for x in row] for row in a],
        "sizes": sizes,
        "measured_on": machine_info(b.model),
        **({"by_batch": {"1": winner, **{k: bfs_paths(order[:n]) for k, n in by_batch.items()}}} if by_batch else {}),
        **({"default": baseline} if select == "measure" else {}),
        **({"stops": _stop_summary(stops, sizes_of, grown)} if len(stops) > 1 else {}),
        "calibration": {"prompts": list(prompt_names), "sequences": len(seqs), "positions": cal.positions,
                        "max_new_tokens": b.max_new_tokens},
    }


_NOTES = ("paths: the chosen tree (rank paths, BFS order); order: the growth order, T_n = order[:n]; "
          "expected_tokens_per_step: accepted drafts + the target's bonus token, comparable to "
          "mean_accepted in hydraspec bench; times in seconds, measured on measured_on (batch size 1); "
          "measured_tokens_per_s: greedy generation on the calibration prompts, end to end (the "
          "selection criterion); measured_decode_tokens_per_s: the same without the prefill time, "
          "comparable to predicted_tokens_per_s; measured_tokens_per_step: its mean accepted length; "
          "drafted_nodes (draft model with a confidence stop): nodes drafted per step in the replay, "
          "verify_s and draft_s are the timed whole-tree times at that many nodes; drafter.confidence: the "
          "stop the tree was chosen with, used when decoding with it; stops: each stop tried, with its "
          "best tree")


def save_tree(result: dict, path) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def plot_tree(result: dict, path) -> None:
    """PNG: expected tokens per step, step time and tokens/s against tree size."""
    import matplotlib  # heavy

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy

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


__all__ = ["DEFAULT_STOPS", "stop_candidates", "build_tree", "save_tree", "plot_tree"]
