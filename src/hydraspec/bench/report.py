"""Output files of a benchmark: results.json, results.md, speedup.png, answers/<method>.jsonl."""
from __future__ import annotations

import json
import re
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
import transformers

from .. import __version__, backend
from . import stats


def machine_info(dtype: str, device: str) -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": backend.cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hydraspec": __version__,
        "dtype": dtype,
        "device": device,
        "gpu": None,
        "command": list(sys.argv),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    elif os.environ.get("HYDRASPEC_PREPACK", "1") != "0":
        info["cpu_kernel"] = backend.describe()  # which native build ran: the CPU model alone does not tell
    return info


def machine_line(m: dict) -> str:
    parts = [m.get("platform", "?"), f"CPU: {m.get('cpu', '?')} ({m.get('cores', '?')} cores)"]
    if m.get("gpu"):
        parts.append(f"GPU: {m['gpu']}")
    parts += [f"torch {m.get('torch')}", f"transformers {m.get('transformers')}", f"hydraspec {m.get('hydraspec')}",
              f"dtype {m.get('dtype')}", f"device {m.get('device')}"]
    if m.get("cpu_kernel"):
        parts.append(f"CPU kernel {m['cpu_kernel']}")
    return " | ".join(parts)


def command_line(argv) -> str:
    return " ".join(shlex.quote(str(a)) for a in argv)


def _x(v) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _f(v, digits=2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"


def _label(summary: dict, m: str) -> str:
    """The method's row name; a speculating llama.cpp method that drafted nothing (or did not record its
    drafting) says so, since its figures are not speculation's."""
    lc = summary.get("llamacpp") or {}
    if m in lc.get("no_drafts", ()):
        return f"{m} (NO DRAFTS: decoded plainly)"
    if m in lc.get("not_recorded", ()):
        return f"{m} (drafting not recorded)"
    return m


def _llamacpp_lines(summary: dict) -> list[str]:
    """The best llama.cpp method, and a warning for each speculating one that did not (or may not have)
    drafted; nothing without llama.cpp methods."""
    lc = summary.get("llamacpp") or {}
    if not any(m.startswith("llamacpp-") for m in summary["methods"]):
        return []
    out = []
    best = lc.get("best")
    if best:
        tps = summary["table"][best]["overall"]["tokens_per_s"]
        out.append(f"Best llama.cpp method: **{best}** ({_f(tps, 1)} tokens/s overall).")
    else:
        out.append("Best llama.cpp method: none that counts (see below).")
    for m in lc.get("no_drafts", ()):
        out.append(f"**WARNING: {m}'s server drafted nothing over the whole run: its row is plain decoding, "
                   "not speculation, and it is left out of the best llama.cpp method.**")
    for m in lc.get("not_recorded", ()):
        out.append(f"**WARNING: {m}'s records do not say whether its server drafted (made before drafting was "
                   "recorded): it is left out of the best llama.cpp method; rerun it in a fresh --out.**")
    return [line for o in out for line in (o, "")]


def _draft_table(summary: dict) -> list[str]:
    rows = [m for m in summary["methods"]
            if stats.is_llamacpp_speculation(m) and summary["table"][m]["overall"].get("drafted") is not None]
    if not rows:
        return []
    lines = ["## Drafting reported by llama.cpp's server", "",
             "Draft tokens proposed and accepted over all turns (llama.cpp's /completion timings: draft_n, "
             "draft_n_accepted).", "",
             "| Method | Drafted | Accepted | Accepted share |", "|---|---:|---:|---:|"]
    for m in rows:
        o = summary["table"][m]["overall"]
        d, a = o["drafted"], o.get("draft_accepted") or 0
        lines.append(f"| {_label(summary, m)} | {d} | {a} | {_pct(a / d) if d else 'n/a'} |")
    return lines + [""]


def _table(summary: dict, key: str) -> list[str]:
    cats = summary["categories"]
    ref = summary["reference"]
    ident = f"Identical to {ref}" if ref else "Identical"
    head = ["Method", *cats, "Overall", "Mean accepted", "Tokens/s", ident]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for m in summary["methods"]:
        row = summary["table"][m]
        o = row["overall"]
        cells = [_label(summary, m)] + [_x(row["categories"].get(c, {}).get(key)) for c in cats]
        if not summary["greedy"]:
            same = f"n/a (sampling, seed {summary.get('seed')})"
        elif m == ref:
            same = "reference"
        else:
            same = _pct(o["identical_share"])
        cells += [_x(o[key]), _f(o["mean_accepted"]), _f(o["tokens_per_s"], 1), same]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _later_table(summary: dict) -> list[str]:
    rows = [(m, summary["table"][m].get("later_turns")) for m in summary["methods"]]
    if not any(c for _, c in rows):
        return []
    lines = ["## Later turns (second and after)", "", "Each later turn re-sends the conversation so far.", "",
             "| Method | Tokens/s | Over ar | Mean accepted |", "|---|---:|---:|---:|"]
    for m, c in rows:
        if c:
            lines.append(f"| {_label(summary, m)} | {_f(c['tokens_per_s'], 1)} | {_x(c.get('speedup_vs_ar'))} | "
                         f"{_f(c['mean_accepted'])} |")
    return lines + [""]


def _chat_table(summary: dict) -> list[str]:
    rows = [(m, summary["table"][m].get("chat")) for m in summary["methods"]]
    if not any(c for _, c in rows):
        return []
    cats = [c for c in summary["categories"] if c in stats.CHAT]
    lines = ["## The chat categories pooled", "", f"{', '.join(cats)}: new tokens over wall time of them all.", "",
             "| Method | Tokens/s | Over ar | Over the best llama.cpp method | Mean accepted |",
             "|---|---:|---:|---:|---:|"]
    for m, c in rows:
        if c:
            lines.append(f"| {_label(summary, m)} | {_f(c['tokens_per_s'], 1)} | {_x(c.get('speedup_vs_ar'))} | "
                         f"{_x(c.get('speedup_vs_best_llamacpp'))} | {_f(c['mean_accepted'])} |")
    return lines + [""]


def _speed_table(summary: dict) -> list[str]:
    lines = ["| Method | TTFT s | Decode tok/s | Overall tok/s |", "|---|---:|---:|---:|"]
    for m in summary["methods"]:
        o = summary["table"][m]["overall"]
        lines.append(f"| {_label(summary, m)} | {_f(o.get('ttft_s'), 3)} | {_f(o.get('decode_tokens_per_s'), 1)} | "
                     f"{_f(o['tokens_per_s'], 1)} |")
    return lines


def markdown(summary: dict, machine: dict, settings: dict) -> str:
    t = summary["temperature"]
    decoding = "greedy" if summary["greedy"] else f"temperature {t}, seed {summary.get('seed')}"
    best_lc = (summary.get("llamacpp") or {}).get("best")
    out = [
        "# hydraspec bench",
        "",
        f"Machine: {machine_line(machine)}",
        "",
        f"Command: `{command_line(machine.get('command', []))}`",
        "",
        f"Model: `{settings.get('model')}`"
        + (f", draft `{settings['draft_model']}`" if settings.get("draft_model") else "")
        + f"; max {settings.get('max_new_tokens')} new tokens; {decoding}.",
        "",
        "Speedup = tokens/s over the same questions relative to the baseline; mean accepted = new tokens per "
        "target forward (n/a where transformers does not expose it).",
        "",
        *_llamacpp_lines(summary),
        "## Speedup over ar (hydraspec plain decoding)",
        "",
        *_table(summary, "speedup_vs_ar"),
        "",
        *([
            "## Speedup over hf-ar (transformers generate)",
            "",
            *_table(summary, "speedup_vs_hf_ar"),
            "",
        ] if "hf-ar" in summary["methods"] else []),
        *([
            "## Speedup over llamacpp-ar (llama.cpp plain decoding, same GGUF file)",
            "",
            *_table(summary, "speedup_vs_llamacpp_ar"),
            "",
        ] if "llamacpp-ar" in summary["methods"] else []),
        *([
            f"## Speedup over the best llama.cpp method ({best_lc})",
            "",
            "The fastest llama.cpp method overall, the same one in every category.",
            "",
            *_table(summary, "speedup_vs_best_llamacpp"),
            "",
        ] if best_lc else []),
        *_draft_table(summary),
        *_chat_table(summary),
        *_later_table(summary),
        "## Time to first token and decoding speed",
        "",
        "TTFT = mean seconds to the first new token (reading the prompt); decode = tokens/s after it.",
        "",
        *_speed_table(summary),
        "",
        "## Tokens/s and mean accepted per category",
        "",
    ]
    cats = summary["categories"]
    head = ["Method", *[f"{c} tok/s" for c in cats], *[f"{c} accepted" for c in cats]]
    out += ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for m in summary["methods"]:
        row = summary["table"][m]["categories"]
        cells = [_label(summary, m)] + [_f(row.get(c, {}).get("tokens_per_s"), 1) for c in cats] + \
                [_f(row.get(c, {}).get("mean_accepted")) for c in cats]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(summary: dict, path: Path) -> None:
    """Grouped bars: one group per category (+ overall), one bar per method: speedup over ar (else over
    hf-ar, else tokens/s)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional
    from matplotlib.figure import Figure  # optional

    methods, cats = summary["methods"], summary["categories"] + ["overall"]
    table = summary["table"]

    def get(m, c, key):
        row = table[m]["overall"] if c == "overall" else table[m]["categories"].get(c, {})
        return row.get(key)

    key, label = "tokens_per_s", "tokens/s"
    for k, lab in (("speedup_vs_ar", "speedup over ar"), ("speedup_vs_hf_ar", "speedup over hf-ar")):
        if any(get(m, "overall", k) is not None for m in methods):
            key, label = k, lab
            break
    fig = Figure(figsize=(min(16.0, max(6.0, 0.35 * len(cats) * max(1, len(methods)) + 3)), 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(cats))]
        ys = [get(m, c, key) or 0.0 for c in cats]
        ax.bar(xs, ys, width, label=m)
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels(cats, rotation=20, ha="right")
    ax.set_ylabel(label)
    if key != "tokens_per_s":
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_title(f"hydraspec bench: {label}")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def answers(records, method: str, model_id: str) -> list[dict]:
    """Spec-Bench style answer rows; accept_lengths holds each turn's mean accepted tokens per forward
    (None where the method does not expose forwards)."""
    rows = []
    for r in records:
        if r["method"] != method:
            continue
        turns = r["turns"]
        rows.append({
            "question_id": r["question_id"],
            "category": r["category"],
            "answer_id": f"{method}-{r['question_id']}",
            "model_id": model_id,
            "choices": [{
                "index": 0,
                "turns": [t["text"] for t in turns],
                "new_tokens": [t["new_tokens"] for t in turns],
                "wall_time": [t["wall_s"] for t in turns],
                "accept_lengths": [t.get("mean_accepted") for t in turns],
            }],
            "tstamp": r.get("tstamp"),
        })
    return rows


def write_all(out: Path, records, summary: dict, machine: dict, settings: dict, annotated) -> dict:
    out = Path(out)
    (out / "answers").mkdir(parents=True, exist_ok=True)
    data = {"settings": settings, "machine": machine, "summary": summary, "records": annotated}
    paths = {"json": out / "results.json", "md": out / "results.md", "png": out / "speedup.png"}
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, paths["json"])
    paths["md"].write_text(markdown(summary, machine, settings), encoding="utf-8")
    plot(summary, paths["png"])
    base = Path(str(settings.get("model", "model")).rstrip("/")).name or "model"
    for m in summary["methods"]:
        p = out / "answers" / f"{re.sub(r'[^A-Za-z0-9+._@-]', '_', m)}.jsonl"  # NAME@path/tree.json: one file
        with open(p, "w", encoding="utf-8") as f:
            for row in answers(records, m, f"{base}-{m}"):
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        paths[f"answers/{m}"] = p
    return paths
