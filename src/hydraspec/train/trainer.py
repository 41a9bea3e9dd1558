"""Training draft heads on a frozen base model (Medusa-1; Hydra with teacher forcing; Hydra++-style
distillation from the base model's own distribution). Built on accelerate, so the same code runs under
`accelerate launch` on several devices."""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import torch
from tqdm import tqdm

from ..heads import build_heads, save_heads
from .data import load_answers
from .losses import heads_loss


def is_heldout(qid, share: float) -> bool:
    h = int(hashlib.sha1(str(qid).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return h < share


@torch.no_grad()
def _base_pass(model, ids: torch.Tensor, want_logits: bool):
    out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False, logits_to_keep=0 if want_logits else 1)
    hidden = out.hidden_states[-1][0]
    return hidden, (out.logits[0] if want_logits else None)


def choose_draft_vocab(rows, size: int, model) -> tuple[list[int], float]:
    """The `size` most frequent tokens of the answers (plus the EOS ids), and the share of answer
    tokens they cover. When the answers hold fewer distinct tokens, the rest are the lowest token ids
    not yet chosen (byte-pair vocabularies number their tokens in merge order, roughly by frequency),
    so that tokens the training answers happen not to use can still be drafted."""
    from collections import Counter

    from ..generator import eos_ids

    vocab = model.config.get_text_config(decoder=True).vocab_size
    counts = Counter(t for r in rows for t in r["answer_ids"] if 0 <= t < vocab)
    keep = [t for t in sorted(eos_ids(model, None)) if 0 <= t < vocab]
    for t, _ in counts.most_common():
        if len(keep) >= size:
            break
        if t not in keep:
            keep.append(t)
    chosen = set(keep)
    for t in range(vocab):
        if len(keep) >= size:
            break
        if t not in chosen:
            keep.append(t)
    total = sum(counts.values())
    covered = sum(counts[t] for t in keep)
    return keep, covered / max(1, total)


def evaluate(heads, model, rows, distill: bool, max_len: int) -> list[dict]:
    embed = model.get_input_embeddings()
    totals = [{"n": 0, "top1": 0, "top5": 0} for _ in range(heads.num_heads)]
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor((r["prompt_ids"] + r["answer_ids"])[:max_len], device=model.device)
            hidden, _ = _base_pass(model, ids, False)
            _, st = heads_loss(heads, heads.prefixed(hidden.float()), ids, len(r["prompt_ids"]), embed=embed)
            for t, s in zip(totals, st):
                for key in t:
                    t[key] += s[key]
    return [{"head": k, "n": t["n"], "top1": t["top1"] / max(1, t["n"]), "top5": t["top5"] / max(1, t["n"])}
            for k, t in enumerate(totals)]


def train_heads(model, data_path, out_dir, kind: str = "medusa", base_name: str = "", num_heads: int = 4,
                num_layers: int = 1, epochs: int = 1, lr: float = 1e-3, distill: bool = False,
                heldout: float = 0.1, max_len: int = 1024, seed: int = 0, progress: bool = True,
                prefix_layer: bool = False, extra_config: dict | None = None, draft_vocab: int | None = None) -> dict:
    from accelerate import Accelerator

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for r in load_answers(data_path) if r["answer_ids"]]
    train = [r for r in rows if not is_heldout(r["id"], heldout)]
    test = [r for r in rows if is_heldout(r["id"], heldout)]
    model.requires_grad_(False)
    acc = Accelerator(cpu=model.device.type == "cpu")
    subset, coverage = None, None
    if draft_vocab:
        subset, coverage = choose_draft_vocab(train or rows, draft_vocab, model)
        extra_config = {**(extra_config or {}), "draft_vocab_coverage": round(coverage, 5)}
        if progress:
            print(f"draft vocabulary: {len(subset)} tokens cover {coverage:.2%} of the training answers' tokens")
    heads = build_heads(kind, model, num_heads=num_heads, num_layers=num_layers, prefix_layer=prefix_layer,
                        vocab_subset=subset).float()
    opt = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=lr)
    heads, opt = acc.prepare(heads, opt)
    state_path, start_epoch = out / "train_state.pt", 0
    if state_path.exists():  # resume
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        acc.unwrap_model(heads).load_state_dict(st["heads"])
        opt.load_state_dict(st["opt"])
        start_epoch = st["epoch"]
    embed = model.get_input_embeddings()
    log = out / "train_log.jsonl"
    rng = random.Random(seed)
    for epoch in range(start_epoch, epochs):
        order = list(train)
        rng.shuffle(order)
        bar = tqdm(order, desc=f"epoch {epoch + 1}/{epochs}", unit="seq", disable=not progress)
        running = 0.0
        for i, r in enumerate(bar):
            ids = torch.tensor((r["prompt_ids"] + r["answer_ids"])[:max_len], device=model.device)
            hidden, teacher = _base_pass(model, ids, distill)
            hm = acc.unwrap_model(heads)
            loss, _ = heads_loss(hm, hm.prefixed(hidden.float()), ids, len(r["prompt_ids"]), embed=embed,
                                 teacher_logits=teacher)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            lv = float(loss.detach())
            running = 0.9 * running + 0.1 * lv if i else lv
            bar.set_postfix(loss=f"{running:.3f}")
        h = acc.unwrap_model(heads)
        metrics = evaluate(h, model, test, distill, max_len) if test else []
        with log.open("a") as f:
            f.write(json.dumps({"epoch": epoch + 1, "train_seqs": len(train), "heldout_seqs": len(test),
                                "loss": running, "heads": metrics}) + "\n")
        save_heads(h, out, base_model=base_name, kind_detail={"distill": distill, "epochs": epoch + 1},
                   **(extra_config or {}))
        torch.save({"heads": h.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1}, state_path)
    return {"train": len(train), "heldout": len(test), "log": str(log)}
