"""What training draft heads on a frozen base model needs (Medusa-1; Hydra with teacher forcing; Hydra++-style
distillation from the base model's own distribution): the held-out split, the base's states and logits (cached
on disk, :class:`BaseOutputs`), the learning-rate schedule, the draft vocabulary, held-out accuracy. The loop
itself is :func:`hydraspec.train.fit.train_heads`, built on accelerate, so the same code runs under
`accelerate launch` on several devices."""
from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import shutil
from collections import Counter
from pathlib import Path

import torch

from ..backend import native_bf16
from ..errors import HydraspecError
from ..features import feature_layers, features
from ..inputs import eos_ids
from .losses import heads_loss


def is_heldout(qid, share: float) -> bool:
    h = int(hashlib.sha1(str(qid).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return h < share


@torch.no_grad()
def _base_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """The base model's features (hydraspec.features: its last hidden states, after its final norm, what
    lm_head reads; joined layers for an EAGLE-3 head) at positions 0 .. T-2 of `ids` [T]: [T - 1, width]. The last token's state is left out: no head target and no
    distillation target reads it (head k at position t predicts token t + k + 2 < T)."""
    out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False, logits_to_keep=1)
    return features(model, out.hidden_states)[0, :-1]


@torch.no_grad()
def teacher_logits(model, hidden: torch.Tensor, subset: torch.Tensor | None = None) -> torch.Tensor:
    """The base model's logits recomputed from its last hidden states [T, dim] (the last dim columns of
    joined features, :func:`_base_hidden`): [T, vocab], or only the draft-vocabulary columns [T, len(subset)]
    (what the distillation loss reads), in float32."""
    dim = model.config.get_text_config(decoder=True).hidden_size
    return project_hidden(model, hidden[..., -dim:], subset)


def project_hidden(model, hidden: torch.Tensor, subset: torch.Tensor | None = None) -> torch.Tensor:
    head = model.get_output_embeddings()
    if hasattr(head, "select"):  # a GGUF lm_head (hydraspec.cpu.gguf): its own kernel, on the rows asked for
        logits = (head if subset is None else head.select(subset))(hidden.to(torch.bfloat16)).float()
        return _softcap(model, logits)
    h = hidden.to(head.weight.dtype)
    if subset is None:
        logits = head(h).float()
    else:
        logits = torch.nn.functional.linear(h, head.weight[subset]).float()
        if getattr(head, "bias", None) is not None:
            logits += head.bias[subset].float()
    return _softcap(model, logits)


def _softcap(model, logits: torch.Tensor) -> torch.Tensor:
    cap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def lr_factor(step: int, total: int, warmup: float = 0.03, floor: float = 0.1) -> float:
    """Learning-rate multiplier at `step` of `total`: linear warm-up, then cosine decay to `floor`."""
    w = max(1, int(total * warmup))
    if step < w:
        return (step + 1) / w
    t = min(1.0, (step - w) / max(1, total - w))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


def fused_options(device: torch.device) -> dict:
    """AdamW's fused kernel where this torch has it for the device (one pass over each parameter)."""
    return {"fused": True} if "fused" in inspect.signature(torch.optim.AdamW).parameters and \
        device.type in ("cpu", "cuda") else {}


def autocast_dtype(device: torch.device, train_dtype: str):
    """The autocast dtype for head training (None: plain fp32)."""
    if train_dtype == "float32":
        return None
    if train_dtype == "bfloat16":
        return torch.bfloat16
    if train_dtype != "auto":
        raise HydraspecError(f"unknown training dtype {train_dtype!r}; use auto, float32 or bfloat16")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    if device.type == "cpu":
        return torch.bfloat16 if native_bf16() else None
    return None


class BaseOutputs:
    """The frozen base model's last hidden states per training sequence ([T - 1, dim], see
    :func:`_base_hidden`), computed once and then reused by every epoch, every training that shares the
    answers file, and the held-out evaluation: the base forward is most of a step's cost for a 1.5B
    model on a CPU. Batched data generation stores the states it computes anyway (:meth:`put`), so
    most sequences never need a separate base forward. Stored under `directory` (one file per
    sequence, in the base model's dtype) up to `max_bytes` in all; sequences past the bound are
    recomputed each time. A cache made by another base model or length limit is cleared.
    Distillation targets are recomputed from these states with the base lm_head (:func:`teacher_logits`),
    so no logits are ever stored."""

    @classmethod
    def for_data(cls, model, data_path, max_bytes: int, max_len: int = 1024, base_name: str = ""):
        """The cache that belongs to an answers file: ANSWERS.base_cache/ beside it."""
        p = Path(data_path)
        return cls(model, p.parent / f"{p.stem}.base_cache", max_bytes, max_len, base_name)

    def __init__(self, model, directory=None, max_bytes: int = 0, max_len: int = 1024, base_name: str = ""):
        if directory is None:
            max_bytes = 0
        self.model, self.max_bytes, self.max_len = model, max_bytes, max_len
        self.dir = Path(directory) if directory is not None else None
        self.used, self.hits, self.misses = 0, 0, 0
        if self.dir is None:
            return
        cfg = model.config.get_text_config(decoder=True)
        meta = {"base": base_name or getattr(model.config, "_name_or_path", ""), "max_len": max_len,
                "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "dtype": str(model.dtype),
                **({"features": list(feature_layers(model))} if feature_layers(model) else {})}
        meta_path = self.dir / "meta.json"
        if self.dir.exists() and (not meta_path.exists() or json.loads(meta_path.read_text()) != meta):
            shutil.rmtree(self.dir.resolve())  # a link (a cache several data files share): what it points to
        if max_bytes > 0:
            self.dir.resolve().mkdir(parents=True, exist_ok=True)
            meta_path.write_text(json.dumps(meta))
        self.used = sum(f.stat().st_size for f in self.dir.glob("*.pt")) if self.dir.exists() else 0

    def ids(self, row) -> torch.Tensor:
        return torch.tensor((row["prompt_ids"] + row["answer_ids"])[: self.max_len], device=self.model.device)

    def _path(self, row, ids: torch.Tensor) -> Path | None:
        if self.dir is None:
            return None
        key = hashlib.sha1(json.dumps([str(row["id"]), ids.tolist()]).encode()).hexdigest()
        return self.dir / f"{key}.pt"

    def hidden(self, row, ids: torch.Tensor) -> torch.Tensor:
        path = self._path(row, ids)
        if path is not None and path.exists():
            self.hits += 1
            return torch.load(path, map_location=self.model.device, weights_only=True)
        self.misses += 1
        hidden = _base_hidden(self.model, ids)
        self.put(row, hidden)
        return hidden

    def has(self, row) -> bool:
        path = self._path(row, self.ids(row))
        return path is not None and path.exists()

    def put(self, row, hidden: torch.Tensor) -> bool:
        """Store `hidden` [T - 1, dim] for `row` if it fits the bound; returns whether it was stored."""
        ids = self.ids(row)
        path = self._path(row, ids)
        size = hidden.numel() * hidden.element_size() + 1024
        if (path is None or self.max_bytes <= 0 or self.used + size > self.max_bytes
                or hidden.shape[0] != ids.numel() - 1 or path.exists()):
            return False
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")  # processes sharing the cache never collide
        torch.save(hidden.detach().to(self.model.dtype).cpu().clone(), tmp)
        tmp.replace(path)  # an interrupted write never leaves a truncated entry
        self.used += size
        return True


def choose_draft_vocab(rows, size: int, model) -> tuple[list[int], float]:
    """The `size` most frequent tokens of the answers (plus the EOS ids), and the share of answer
    tokens they cover. When the answers hold fewer distinct tokens, the rest are the lowest token ids
    not yet chosen (byte-pair vocabularies number their tokens in merge order, roughly by frequency),
    so that tokens the training answers happen not to use can still be drafted."""
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


def eval_counts(heads, model, rows, base: BaseOutputs, eagle: dict | None = None) -> torch.Tensor:
    """Per head (an EAGLE head: per draft depth) [n, top-1 hits, top-5 hits] over `rows`: [heads, 3] (float64,
    so processes can sum them)."""
    embed = model.get_input_embeddings()
    steps = (eagle or {}).get("steps", 2) if heads.method == "eagle" else heads.num_heads
    totals = torch.zeros(steps, 3, dtype=torch.float64)
    with torch.no_grad():
        for r in rows:
            ids = base.ids(r)
            hidden = base.hidden(r, ids)
            _, st = heads_loss(heads, heads.prefixed(hidden.float()), ids, len(r["prompt_ids"]), embed=embed,
                               eagle=eagle)
            totals += torch.tensor([[s["n"], s["top1"], s["top5"]] for s in st], dtype=torch.float64)
    return totals


def accuracy(totals: torch.Tensor) -> list[dict]:
    return [{"head": k, "n": int(n), "top1": float(t1) / max(1, int(n)), "top5": float(t5) / max(1, int(n))}
            for k, (n, t1, t5) in enumerate(totals.tolist())]


def evaluate(heads, model, rows, base: BaseOutputs | None = None, max_len: int = 1024,
             eagle: dict | None = None) -> list[dict]:
    """Held-out top-1 / top-5 accuracy of each head (an EAGLE head: each draft depth) over `rows` (against
    the real answer tokens)."""
    return accuracy(eval_counts(heads, model, rows, base or BaseOutputs(model, max_len=max_len), eagle))
