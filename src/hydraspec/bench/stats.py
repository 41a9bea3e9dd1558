"""Benchmark arithmetic: pure functions over plain records, no models.

A record is one (method, question) pair:
    {"method": str, "question_id": int | str, "category": str,
     "turns": [{"new_tokens": int, "wall_s": float, "target_forwards": int | None,
                "token_ids": [int, ...], ...}, ...]}

Definitions (per category and overall, over a method's records):
    tokens/s        = total new tokens / total wall seconds
    mean accepted   = total new tokens / total target forwards (None when a method cannot report forwards)
    ttft            = mean seconds to the first new token (the prompt's forward, prefill_s), per turn
    decode tokens/s = new tokens after each turn's first / (wall seconds - prefill seconds): speed once the
                      prompt is read (None when a method does not report its prefill time)
    speedup over B  = tokens/s of the method / tokens/s of B, both totalled over the questions that both
                      have records for (the same prompts); with identical answers this is B's total time
                      over the method's total time
    identical share = turns whose token ids equal the reference method's for the same question and turn,
                      over the turns the reference has; only meaningful for greedy decoding, so it is None
                      when temperature > 0
    drafted         = draft tokens proposed (and accepted) over the turns that report them (llama.cpp's
                      server does); None when no turn does
    best llama.cpp  = the llamacpp-* method with the most tokens/s overall, leaving out speculating ones
                      (all but llamacpp-ar) that drafted nothing or did not record drafting: those decoded
                      plainly, or cannot be shown not to have
    chat            = the chat categories of Spec-Bench (CHAT) pooled, where a run has two or more of them
"""
from __future__ import annotations

SPLIT_KEYS = ("prefill_s", "draft_s", "verify_s", "accept_s")
BASELINES = ("ar", "hf-ar", "llamacpp-ar")  # speedups are given over each of these present
REFERENCES = ("ar", "hf-ar")  # whose answers the others are compared with, the first present
CHAT = ("writing", "roleplay", "reasoning", "stem", "humanities", "qa")  # Spec-Bench's conversational categories


def first_divergence(a, b) -> int | None:
    """None if the sequences are equal, else the first index where they differ (the shorter one's length
    when one is a prefix of the other)."""
    a, b = list(a), list(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def reference_method(methods) -> str | None:
    """The method whose answers the others are compared with: 'ar' if present, else 'hf-ar', else None."""
    methods = list(methods)
    for m in REFERENCES:
        if m in methods:
            return m
    return None


def dedupe(records) -> list[dict]:
    """One record per (method, question_id): the last one wins, in first-seen order."""
    by_key: dict = {}
    for r in records:
        by_key[(r["method"], r["question_id"])] = r
    return list(by_key.values())


def method_order(records, methods=None) -> list[str]:
    order = list(dict.fromkeys(methods or []))
    for r in records:
        if r["method"] not in order:
            order.append(r["method"])
    return order


def category_order(records) -> list[str]:
    return list(dict.fromkeys(r["category"] for r in records))


def compare_turns(record: dict, ref: dict | None) -> list[dict]:
    """Per turn of `record`: same_as_ref (bool | None without a reference turn), diverge_at (first differing
    token position or None), context_differs (an earlier turn of this conversation already differed from the
    reference, so this turn's prompt differs too and a different answer is legitimate)."""
    out = []
    earlier_differs = False
    ref_turns = ref["turns"] if ref is not None else []
    for i, t in enumerate(record["turns"]):
        if i < len(ref_turns):
            d = first_divergence(t["token_ids"], ref_turns[i]["token_ids"])
            out.append({"same_as_ref": d is None, "diverge_at": d, "context_differs": earlier_differs})
            earlier_differs = earlier_differs or d is not None
        else:
            out.append({"same_as_ref": None, "diverge_at": None, "context_differs": earlier_differs})
    return out


def annotate(records, reference: str | None) -> list[dict]:
    """Copies of `records` whose turns carry ref_method, same_as_ref, diverge_at and context_differs."""
    refs = {r["question_id"]: r for r in records if r["method"] == reference} if reference else {}
    out = []
    for r in records:
        cmp = compare_turns(r, refs.get(r["question_id"]))
        turns = [{**t, "ref_method": reference, **c} for t, c in zip(r["turns"], cmp)]
        out.append({**r, "turns": turns})
    return out


def totals(records) -> dict:
    """Sums over all turns of `records`. target_forwards and split times are None if any turn lacks them."""
    turns = [t for r in records for t in r["turns"]]
    tok = sum(int(t["new_tokens"]) for t in turns)
    wall = sum(float(t["wall_s"]) for t in turns)
    fw_known = all(t.get("target_forwards") is not None for t in turns)
    fw = sum(int(t["target_forwards"]) for t in turns) if fw_known else None
    out = {"questions": len(records), "turns": len(turns), "new_tokens": tok, "wall_s": wall,
           "target_forwards": fw, "tokens_per_s": tokens_per_s(tok, wall), "mean_accepted": mean_accepted(tok, fw)}
    for k in SPLIT_KEYS:
        out[k] = sum(float(t[k]) for t in turns) if all(t.get(k) is not None for t in turns) else None
    pre = out["prefill_s"]
    out["ttft_s"] = pre / len(turns) if pre is not None and turns else None
    decoded = tok - sum(1 for t in turns if int(t["new_tokens"]) > 0)
    out["decode_tokens_per_s"] = tokens_per_s(decoded, wall - pre) if pre is not None else None
    for k in ("drafted", "draft_accepted"):
        known = [int(t[k]) for t in turns if t.get(k) is not None]
        out[k] = sum(known) if known else None
    return out


def tokens_per_s(new_tokens: int, wall_s: float) -> float | None:
    return new_tokens / wall_s if wall_s > 0 else None


def mean_accepted(new_tokens: int, target_forwards: int | None) -> float | None:
    return new_tokens / target_forwards if target_forwards else None


def speedup(records, base_records) -> float | None:
    """tokens/s ratio of `records` over `base_records`, restricted to the question ids both have."""
    mine = {r["question_id"]: r for r in records}
    base = {r["question_id"]: r for r in base_records}
    common = [q for q in mine if q in base]
    if not common:
        return None
    a = totals([mine[q] for q in common])
    b = totals([base[q] for q in common])
    if a["tokens_per_s"] is None or not b["tokens_per_s"]:
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


def identical(records, ref_records) -> tuple[int, int]:
    """(turns identical to the reference, turns compared) over the question/turns both have."""
    refs = {r["question_id"]: r for r in ref_records}
    same = compared = 0
    for r in records:
        ref = refs.get(r["question_id"])
        for c in compare_turns(r, ref):
            if c["same_as_ref"] is not None:
                compared += 1
                same += bool(c["same_as_ref"])
    return same, compared


def cell(records, by_method: dict, reference: str | None, greedy: bool) -> dict:
    """Statistics of one method over one group of records (a category, or all)."""
    out = totals(records)
    qids = {r["question_id"] for r in records}
    for base in BASELINES:
        base_recs = [r for r in by_method.get(base, []) if r["question_id"] in qids]
        out[f"speedup_vs_{base.replace('-', '_')}"] = speedup(records, base_recs) if base_recs else None
    if reference is not None and reference in by_method:
        same, compared = identical(records, [r for r in by_method[reference] if r["question_id"] in qids])
    else:
        same, compared = None, None
    out["identical"], out["compared"] = same, compared
    out["identical_share"] = (same / compared) if (greedy and compared) else None
    return out


def later_turns(records) -> list[dict]:
    """The records of multi-turn questions cut to their turns after the first (a chat's later turns)."""
    return [{**r, "turns": r["turns"][1:]} for r in records if len(r["turns"]) > 1]


def summarize(records, methods=None, temperature: float = 0.0, seed: int | None = None) -> dict:
    """The whole summary: per method, per category and overall. `methods` fixes the row order (methods that
    only appear in `records` follow); the reference for identical answers is 'ar', else 'hf-ar'."""
    records = dedupe(records)
    order = method_order(records, methods)
    present = [m for m in order if any(r["method"] == m for r in records)]
    reference = reference_method(present)
    cats = category_order(records)
    greedy = temperature == 0
    by_method = {m: [r for r in records if r["method"] == m] for m in present}
    table = {}
    for m in present:
        recs = by_method[m]
        table[m] = {
            "categories": {c: cell([r for r in recs if r["category"] == c], by_method, reference, greedy)
                           for c in cats if any(r["category"] == c for r in recs)},
            "overall": cell(recs, by_method, reference, greedy),
        }
    later = {m: later_turns(by_method[m]) for m in present}
    if any(later.values()):  # multi-turn questions: the turns after the first, on their own
        for m in present:
            table[m]["later_turns"] = cell(later[m], later, reference, greedy) if later[m] else None
    llamacpp = llamacpp_summary(table, present)
    best = llamacpp["best"]
    chat = [c for c in cats if c in CHAT]
    for m in present:
        row = table[m]
        if len(chat) > 1:
            row["chat"] = pooled(by_method, m, chat, reference, greedy, best)
        row["overall"]["speedup_vs_best_llamacpp"] = speedup(by_method[m], by_method[best]) if best else None
        for c, cell_ in row["categories"].items():
            base = [r for r in by_method[best] if r["category"] == c] if best else []
            cell_["speedup_vs_best_llamacpp"] = (
                speedup([r for r in by_method[m] if r["category"] == c], base) if base else None)
    return {"reference": reference, "temperature": temperature, "greedy": greedy,
            "seed": None if greedy else seed, "categories": cats, "methods": present, "table": table,
            "llamacpp": llamacpp}


def pooled(by_method: dict, m: str, cats: list[str], reference: str | None, greedy: bool, best: str | None) -> dict:
    """:func:`cell` of method ``m`` over the categories ``cats`` together, with its speedup over the best
    llama.cpp method on them."""
    within = {k: [r for r in recs if r["category"] in cats] for k, recs in by_method.items()}
    out = cell(within[m], within, reference, greedy)
    out["speedup_vs_best_llamacpp"] = speedup(within[m], within[best]) if best else None
    return out


def is_llamacpp_speculation(method: str) -> bool:
    """A llama.cpp baseline that is meant to speculate (every llamacpp-* method but plain llamacpp-ar)."""
    return method.startswith("llamacpp-") and method.partition("@")[0] != "llamacpp-ar"


def llamacpp_summary(table: dict, methods) -> dict:
    """{"best": the fastest llama.cpp method overall that counts (None without one), "no_drafts": speculating
    llama.cpp methods whose server drafted nothing over the run, "not_recorded": those whose records do not
    say (made before drafting was recorded)}. Methods of both lists are left out of "best"."""
    no_drafts, not_recorded, ok = [], [], []
    for m in methods:
        if not m.startswith("llamacpp-"):
            continue
        drafted = table[m]["overall"].get("drafted")
        if is_llamacpp_speculation(m) and drafted is None:
            not_recorded.append(m)
        elif is_llamacpp_speculation(m) and drafted == 0:
            no_drafts.append(m)
        elif table[m]["overall"].get("tokens_per_s") is not None:
            ok.append(m)
    best = max(ok, key=lambda m: table[m]["overall"]["tokens_per_s"], default=None)
    return {"best": best, "no_drafts": no_drafts, "not_recorded": not_recorded}
