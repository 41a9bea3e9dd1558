"""Training draft heads on a frozen base model (Medusa-1; Hydra with teacher forcing; Hydra++-style
distillation from the base model's own distribution). Built on accelerate, so the same code runs under
`accelerate launch` on several devices."""
from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..errors import HydraspecError
from ..heads import base_fingerprint, build_heads, save_heads
from .data import load_answers
from .losses import heads_loss


def is_heldout(qid, share: float) -> bool:
    h = int(hashlib.sha1(str(qid).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return h < share


@torch.no_grad()
def _base_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """The base model's last hidden states (after its final norm: what lm_head reads) at positions
    0 .. T-2 of `ids` [T]: [T - 1, dim]. The last token's state is left out: no head target and no
    distillation target reads it (head k at position t predicts token t + k + 2 < T)."""
    out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False, logits_to_keep=1)
    return out.hidden_states[-1][0, :-1]


@torch.no_grad()
def teacher_logits(model, hidden: torch.Tensor, subset: torch.Tensor | None = None) -> torch.Tensor:
    """The base model's logits recomputed from its last hidden states [T, dim]: [T, vocab], or only the
    draft-vocabulary columns [T, len(subset)] (what the distillation loss reads), in float32."""
    return _project(model, hidden, subset)


def _project(model, hidden: torch.Tensor, subset: torch.Tensor | None = None) -> torch.Tensor:
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
    import math

    w = max(1, int(total * warmup))
    if step < w:
        return (step + 1) / w
    t = min(1.0, (step - w) / max(1, total - w))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


def _fused(device: torch.device) -> dict:
    """AdamW's fused kernel where this torch has it for the device (one pass over each parameter)."""
    import inspect

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
        from ..backend import native_bf16

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
        import shutil

        if directory is None:
            max_bytes = 0
        self.model, self.max_bytes, self.max_len = model, max_bytes, max_len
        self.dir = Path(directory) if directory is not None else None
        self.used, self.hits, self.misses = 0, 0, 0
        if self.dir is None:
            return
        cfg = model.config.get_text_config(decoder=True)
        meta = {"base": base_name or getattr(model.config, "_name_or_path", ""), "max_len": max_len,
                "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "dtype": str(model.dtype)}
        meta_path = self.dir / "meta.json"
        if self.dir.exists() and (not meta_path.exists() or json.loads(meta_path.read_text()) != meta):
            shutil.rmtree(self.dir)
        if max_bytes > 0:
            self.dir.mkdir(parents=True, exist_ok=True)
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
    from collections import Counter

    from ..inputs import eos_ids

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


def _eval_counts(heads, model, rows, base: BaseOutputs, eagle: dict | None = None) -> torch.Tensor:
    """Per head (an EAGLE head: per draft depth) [n, top-1 hits, top-5 hits] over `rows`: [heads, 3] (float64,
    so processes can sum them)."""
    embed = model.get_input_embeddings()
    steps = (eagle or {}).get("steps", 2) if heads.kind == "eagle" else heads.num_heads
    totals = torch.zeros(steps, 3, dtype=torch.float64)
    with torch.no_grad():
        for r in rows:
            ids = base.ids(r)
            hidden = base.hidden(r, ids)
            _, st = heads_loss(heads, heads.prefixed(hidden.float()), ids, len(r["prompt_ids"]), embed=embed,
                               eagle=eagle)
            totals += torch.tensor([[s["n"], s["top1"], s["top5"]] for s in st], dtype=torch.float64)
    return totals


def _accuracy(totals: torch.Tensor) -> list[dict]:
    return [{"head": k, "n": int(n), "top1": float(t1) / max(1, int(n)), "top5": float(t5) / max(1, int(n))}
            for k, (n, t1, t5) in enumerate(totals.tolist())]


def evaluate(heads, model, rows, base: BaseOutputs | None = None, max_len: int = 1024,
             eagle: dict | None = None) -> list[dict]:
    """Held-out top-1 / top-5 accuracy of each head (an EAGLE head: each draft depth) over `rows` (against
    the real answer tokens)."""
    return _accuracy(_eval_counts(heads, model, rows, base or BaseOutputs(model, max_len=max_len), eagle))


class _Sync:
    """What training needs of the processes that `accelerate launch` starts: sums over them, and the
    main process's parameters copied to the others. With one process every call does nothing (and
    changes nothing); with several the calls are collective: every process makes them in the same order.

    No DistributedDataParallel: the heads are called directly (not through a wrapper's forward), the
    gradients of a step's sequences accumulate locally, and :meth:`grads` sums them once per optimizer
    step, in buckets."""

    BUCKET_BYTES = 32 << 20

    def __init__(self, acc):
        self.n = acc.num_processes
        self.rank = acc.process_index
        self.device = acc.device  # where the backend reduces (gloo: the CPU; nccl: this process's GPU)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the processes (in place; returned)."""
        if self.n > 1:
            import torch.distributed as dist

            x = t if t.device == self.device else t.to(self.device)
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
            if x is not t:
                t.copy_(x)
        return t

    def broadcast(self, tensors) -> None:
        """Overwrite `tensors` with the main process's values."""
        if self.n > 1:
            import torch.distributed as dist

            for t in tensors:
                x = t.data if t.device == self.device else t.data.to(self.device)
                dist.broadcast(x, src=0)
                if x is not t.data:
                    t.data.copy_(x)

    def grads(self, params: list[torch.nn.Parameter], stats: torch.Tensor) -> torch.Tensor:
        """Sum the gradients of `params` and the float64 vector `stats` over the processes. A parameter
        that no process has a gradient for keeps none (AdamW then skips it, as one process would); one that
        some processes lack (their share of the step was empty, or never reached it) counts as zeros there.
        Returns the summed `stats`."""
        if self.n == 1:
            return stats
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.float64)
        both = self.sum(torch.cat([stats.to(torch.float64), has]))
        stats, has = both[: stats.numel()], both[stats.numel():]
        grads = []
        for p, h in zip(params, has.tolist()):
            if h > 0:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        bucket, size = [], 0
        for g in grads:
            nbytes = g.numel() * g.element_size()
            if bucket and (g.dtype != bucket[0].dtype or g.device != bucket[0].device
                           or size + nbytes > self.BUCKET_BYTES):
                self._sum_bucket(bucket)
                bucket, size = [], 0
            bucket.append(g)
            size += nbytes
        if bucket:
            self._sum_bucket(bucket)
        return stats

    def _sum_bucket(self, bucket: list[torch.Tensor]) -> None:
        flat = self.sum(torch.cat([g.reshape(-1) for g in bucket]))
        off = 0
        for g in bucket:
            g.copy_(flat[off: off + g.numel()].view_as(g))
            off += g.numel()


def train_heads(model, data_path, out_dir, kind: str = "medusa", base_name: str = "", num_heads: int = 4,
                num_layers: int = 1, epochs: int = 1, lr: float = 1e-3, distill: bool = False,
                heldout: float = 0.1, max_len: int = 1024, seed: int = 0, progress: bool = True,
                prefix_layer: bool = False, extra_config: dict | None = None, draft_vocab: int | None = None,
                cache_bytes: int = 4 << 30, joint: bool = False, warmup_epochs: int = 1, lm_weight: float = 0.01,
                base_lr: float | None = None, train_dtype: str = "auto", accum: int = 1,
                head_options: dict | None = None, eagle: dict | None = None) -> dict:
    """Train draft heads on the answers in `data_path` and save them (and the training log) in `out_dir`.

    joint=True is Medusa-2: the heads train alone for `warmup_epochs`, then the base model's decoder
    layers train with them (learning rate `base_lr`, default lr / 4, so the heads' is 4x the base's),
    under loss = heads' loss + lm_weight * KL(original base || tuned base) over the answer tokens: with
    self-distilled answers the base is kept close to its own original distribution (Medusa-2 uses
    0.01 then; 0.2 with a plain LM loss on human data). The embeddings and lm_head stay frozen (the
    heads share the lm_head). The tuned base is saved in OUT/base and is the model these heads must
    draft for (their config names it). Needs the base in float32 and the original states of every
    sequence in the base cache.

    The learning rate warms up linearly over the first 3 % of the steps and then follows a cosine down
    to a tenth (:func:`lr_factor`). train_dtype "bfloat16" runs the heads' matmuls under bf16 autocast
    (the parameters and the optimizer stay fp32); "auto" does so where the hardware computes bf16
    natively (CUDA, or a CPU with AVX512_BF16). The optimizer steps once per `accum` sequences (their
    gradients summed, each sequence's loss weighted 1 / accum; the last step of an epoch may have fewer,
    weighted 1 / their number): an AdamW step over the heads' parameters costs about as much as a
    sequence's forward and backward on a CPU. The heads start from `seed` (and so does the order of the
    sequences in each epoch). head_options: what the kind takes beyond the common sizes (EAGLE:
    intermediate_size); eagle: the options of an EAGLE head's loss (train.losses.eagle_loss).

    Under `accelerate launch` with P processes (e.g. ``accelerate launch --multi_gpu --num_processes 2
    -m hydraspec.cli train-heads --device cpu ...``, gloo on the CPU), every process shuffles the sequences
    alike and takes every P-th sequence of each optimizer step's `accum`; the gradients are summed over
    the processes before the step, so training equals one process's with the same `accum` (the global
    batch), up to float rounding. The logged losses and counts are the sums over the processes; the
    held-out evaluation is split over them too. Only the main process writes the log and checkpoints."""
    from accelerate import Accelerator

    out = Path(out_dir)
    # a sequence needs an answer token at least 2 places after the prompt, inside max_len, to train on
    rows = [r for r in load_answers(data_path) if r["answer_ids"] and len(r["prompt_ids"]) + 2 <= max_len]
    train = [r for r in rows if not is_heldout(r["id"], heldout)]
    test = [r for r in rows if is_heldout(r["id"], heldout)]
    model.requires_grad_(False)
    acc = Accelerator(cpu=model.device.type == "cpu")
    sync, main = _Sync(acc), acc.is_main_process
    progress = progress and main
    if main:
        out.mkdir(parents=True, exist_ok=True)
    subset, coverage = None, None
    if draft_vocab:
        subset, coverage = choose_draft_vocab(train or rows, draft_vocab, model)
        extra_config = {**(extra_config or {}), "draft_vocab_coverage": round(coverage, 5)}
        if progress:
            print(f"draft vocabulary: {len(subset)} tokens cover {coverage:.2%} of the training answers' tokens")
    with torch.random.fork_rng(devices=[model.device.index or 0] if model.device.type == "cuda" else []):
        torch.manual_seed(seed)  # the same fresh heads in every process (and every run)
        heads = build_heads(kind, model, num_heads=num_heads, num_layers=num_layers, prefix_layer=prefix_layer,
                            vocab_subset=subset, **(head_options or {})).float()
    sync.broadcast(heads.state_dict().values())
    tuned: dict[str, torch.nn.Parameter] = {}
    if joint:
        if model.dtype != torch.float32:
            raise HydraspecError("joint (Medusa-2) training updates the base model: load it in float32")
        if warmup_epochs >= epochs:
            raise HydraspecError(f"joint training needs more epochs ({epochs}) than heads-only warm-up epochs "
                                 f"({warmup_epochs})")
        from ..backend import unpack

        unpack(model)  # prepacked weight copies would go stale once the base trains
        frozen = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
        tuned = {n: p for n, p in model.named_parameters() if id(p) not in frozen}
    groups = [{"params": [p for p in heads.parameters() if p.requires_grad], "lr": lr}]
    if tuned:
        groups.append({"params": list(tuned.values()), "lr": base_lr if base_lr is not None else lr / 4})
    if accum < 1:
        raise HydraspecError("grad_accum must be at least 1")
    opt = torch.optim.AdamW(groups, **_fused(model.device))
    steps_total = max(1, epochs * -(-len(train) // accum))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, steps_total))
    amp = autocast_dtype(model.device, train_dtype)
    state_path, start_epoch = out / "train_state.pt", 0
    if state_path.exists():  # resume
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        heads.load_state_dict(st["heads"])
        opt.load_state_dict(st["opt"])
        start_epoch = st["epoch"]
        if st.get("sched"):
            sched.load_state_dict(st["sched"])
        if st.get("base"):
            with torch.no_grad():
                for n, v in st["base"].items():
                    tuned[n].copy_(v)
    embed = model.get_input_embeddings()
    with acc.main_process_first():  # the main process clears a stale cache and writes its meta; then the others
        base = BaseOutputs.for_data(model, data_path, cache_bytes, max_len, base_name)
    cache_start = base.used
    if sync.n > 1:  # the processes fill one directory: each may add its share of the room left
        base.max_bytes = base.used + max(0, base.max_bytes - base.used) // sync.n
    if joint:  # the original base's states, the KL target, must exist before the base changes
        for r in tqdm(rows[sync.rank::sync.n], desc="original base states", unit="seq", disable=not progress):
            base.hidden(r, base.ids(r))
        acc.wait_for_everyone()
        if not all(base.has(r) for r in rows):
            raise HydraspecError("joint training needs the original base states of every sequence in the base "
                                 "cache; raise --cache-gb")
    sub_idx = heads.subset if subset is not None else None
    params = [p for g in opt.param_groups for p in g["params"]]
    log = out / "train_log.jsonl"
    rng = random.Random(seed)
    for _ in range(start_epoch):  # a resumed run goes on with the orders an uninterrupted one would take
        rng.shuffle(list(train))
    for epoch in range(start_epoch, epochs):
        order = list(train)
        rng.shuffle(order)
        steps = [order[i: i + accum] for i in range(0, len(order), accum)]  # the global batches
        bar = tqdm(total=len(order), desc=f"epoch {epoch + 1}/{epochs}", unit="seq", disable=not progress)
        running, step_losses = 0.0, []
        both = joint and epoch >= warmup_epochs
        for p in tuned.values():
            p.requires_grad_(both)
        kl_sum = 0.0
        for step in steps:
            stats = torch.zeros(2, dtype=torch.float64)  # this process's share of: the step's loss, sum of KLs
            for r in step[sync.rank::sync.n]:
                ids = base.ids(r)
                hidden = base.hidden(r, ids)  # the original base's states (cached)
                teacher = teacher_logits(model, hidden, sub_idx) if distill else None
                kl = None
                if both:  # Medusa-2: the heads read the tuned base, which stays close to the original
                    ans = torch.arange(max(0, len(r["prompt_ids"]) - 1), ids.numel() - 1, device=ids.device)
                    orig = teacher_logits(model, hidden[ans])  # only the answer positions the KL reads
                    out_m = model(input_ids=ids[None], output_hidden_states=True, use_cache=False,
                                  logits_to_keep=1)
                    hidden = out_m.hidden_states[-1][0, :-1]
                    cur = _project(model, hidden[ans])
                    kl = F.kl_div(cur.log_softmax(-1), orig.log_softmax(-1), log_target=True, reduction="batchmean")
                with torch.autocast(model.device.type, dtype=amp, enabled=amp is not None):
                    loss, _ = heads_loss(heads, heads.prefixed(hidden.float()), ids, len(r["prompt_ids"]),
                                         embed=embed, teacher_logits=teacher, eagle=eagle)
                if kl is not None:
                    loss = loss + lm_weight * kl
                    stats[1] += float(kl.detach())
                (loss / len(step)).backward()
                stats[0] += float(loss.detach()) / len(step)
            stats = sync.grads(params, stats)  # every process now holds the whole step's gradients
            opt.step()
            sched.step()
            opt.zero_grad()
            lv = float(stats[0])
            kl_sum += float(stats[1])
            running = 0.9 * running + 0.1 * lv if step_losses else lv
            step_losses.append(lv)
            bar.update(len(step))
            bar.set_postfix(loss=f"{running:.3f}")
        bar.close()
        counts = _eval_counts(heads, model, test[sync.rank::sync.n],
                              BaseOutputs(model, max_len=max_len) if both else base, eagle) if test else None
        metrics = _accuracy(sync.sum(counts)) if test else []
        cache = sync.sum(torch.tensor([base.hits, base.misses, base.used - cache_start], dtype=torch.float64))
        if main:
            with log.open("a") as f:
                f.write(json.dumps({
                    "epoch": epoch + 1, "train_seqs": len(train), "heldout_seqs": len(test), "loss": running,
                    "mean_loss": sum(step_losses) / max(1, len(step_losses)), "step_losses": step_losses,
                    "processes": sync.n, "heads": metrics,
                    "base_cache": {"hits": int(cache[0]), "computed": int(cache[1]),
                                   "bytes": cache_start + int(cache[2])},
                    **({"joint": True, "lm_kl": kl_sum / max(1, len(order))} if both else {})}) + "\n")
            extra = dict(extra_config or {})
            name = base_name
            if joint:  # the heads now belong to the tuned base, saved beside them
                model.save_pretrained(out / "base")
                name = str(out / "base")
                extra["joint"] = {"original_base": base_name, "warmup_epochs": warmup_epochs,
                                  "lm_weight": lm_weight, "base_lr": groups[1]["lr"], "base_dir": "base"}
            save_heads(heads, out, base_model=name, kind_detail={"distill": distill, "epochs": epoch + 1},
                       base_fingerprint=base_fingerprint(model), **extra)
            torch.save({"heads": heads.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch + 1,
                        "base": {n: p.detach().clone() for n, p in tuned.items()} if both else None}, state_path)
        acc.wait_for_everyone()  # the checkpoint and the log are complete before any process goes on
    return {"train": len(train), "heldout": len(test), "log": str(log), "processes": sync.n}
