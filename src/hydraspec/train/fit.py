"""The training loop of draft heads (:func:`train_heads`): fresh heads, the optimizer and its schedule, the
base model's cached states, the epochs (each sequence's loss, optimizer steps over the processes' shares),
held-out accuracy, the log and the checkpoints, resumable."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..backend import unpack
from ..errors import HydraspecError
from ..features import features, set_feature_layers
from ..heads import base_fingerprint, build_heads, read_heads_config, save_heads, saved_heads
from .data import load_answers
from .losses import heads_loss
from .sync import Sync
from .trainer import BaseOutputs, accuracy, autocast_dtype, choose_draft_vocab, eval_counts, fused_options, \
    is_heldout, lr_factor, project_hidden, teacher_logits

__all__ = ["train_heads"]


LEARNING_RATES = {"eagle3": 5e-4}  # a kind's peak learning rate where 1e-3 does not suit it (BENCHMARKS.md)


def default_lr(kind: str) -> float:
    """The peak learning rate heads of ``kind`` train at unless told: 1e-3, and 5e-4 for an EAGLE-3 head,
    which at 1e-3 learnt nothing past a unigram on Qwen2.5-Coder-1.5B (BENCHMARKS.md)."""
    return LEARNING_RATES.get(kind, 1e-3)


def train_heads(model, data_path, out_dir, kind: str = "medusa", base_name: str = "", num_heads: int = 4,
                num_layers: int = 1, epochs: int = 1, lr: float | None = None, distill: bool = False,
                heldout: float = 0.1, max_len: int = 1024, seed: int = 0, progress: bool = True,
                prefix_layer: bool = False, extra_config: dict | None = None, draft_vocab: int | None = None,
                cache_bytes: int = 4 << 30, joint: bool = False, warmup_epochs: int = 1, lm_weight: float = 0.01,
                base_lr: float | None = None, train_dtype: str = "auto", accum: int = 1,
                head_options: dict | None = None, eagle: dict | None = None, init=None) -> dict:
    """Train draft heads on the answers in `data_path` and save them (and the training log) in `out_dir`.

    joint=True is Medusa-2: the heads train alone for `warmup_epochs`, then the base model's decoder
    layers train with them (learning rate `base_lr`, default lr / 4, so the heads' is 4x the base's),
    under loss = heads' loss + lm_weight * KL(original base || tuned base) over the answer tokens: with
    self-distilled answers the base is kept close to its own original distribution (Medusa-2 uses
    0.01 then; 0.2 with a plain LM loss on human data). The embeddings and lm_head stay frozen (the
    heads share the lm_head). The tuned base is saved in OUT/base and is the model these heads must
    draft for (their config names it). Needs the base in float32 and the original states of every
    sequence in the base cache.

    The learning rate (its peak `lr`; None: the kind's own, :func:`default_lr`) warms up linearly over the first 3 %
    of the steps and then follows a cosine down to a tenth (:func:`lr_factor`). train_dtype "bfloat16" runs the
    heads' matmuls under bf16 autocast (the parameters and the optimizer stay fp32); "auto" does so where the
    hardware computes bf16 natively (CUDA, or a CPU with AVX512_BF16). The optimizer steps once per `accum`
    sequences (their gradients summed, each sequence's loss weighted 1 / accum; the last step of an epoch may have
    fewer, weighted 1 / their number): an AdamW step over the heads' parameters costs about as much as a sequence's
    forward and backward on a CPU. The heads start from `seed` (and so does the order of the sequences in each
    epoch). head_options: what the kind takes beyond the common sizes (EAGLE: intermediate_size); eagle: the options
    of an EAGLE head's loss (train.losses.eagle_loss). ``init``: a heads checkpoint of ``kind`` to start from instead
    of fresh heads (more data for heads already trained: its shapes and draft vocabulary are kept, and the
    shape options here are not used).

    Under `accelerate launch` with P processes (e.g. ``accelerate launch --multi_gpu --num_processes 2
    -m hydraspec.cli train-heads --device cpu ...``, gloo on the CPU), every process shuffles the sequences
    alike and takes every P-th sequence of each optimizer step's `accum`; the gradients are summed over
    the processes before the step, so training equals one process's with the same `accum` (the global
    batch), up to float rounding. The logged losses and counts are the sums over the processes; the
    held-out evaluation is split over them too. Only the main process writes the log and checkpoints."""
    from accelerate import Accelerator  # heavy

    out = Path(out_dir)
    # a sequence needs an answer token at least 2 places after the prompt, inside max_len, to train on
    rows = [r for r in load_answers(data_path) if r["answer_ids"] and len(r["prompt_ids"]) + 2 <= max_len]
    train = [r for r in rows if not is_heldout(r["id"], heldout)]
    test = [r for r in rows if is_heldout(r["id"], heldout)]
    model.requires_grad_(False)
    acc = Accelerator(cpu=model.device.type == "cpu")
    sync, main = Sync(acc), acc.is_main_process
    progress = progress and main
    if main:
        out.mkdir(parents=True, exist_ok=True)
    if init is not None:
        heads = _init_heads(model, sync, kind, init)
        extra_config = {**(extra_config or {}), "started_from": str(init)}
    else:
        subset = None
        if draft_vocab:
            subset, coverage = choose_draft_vocab(train or rows, draft_vocab, model)
            extra_config = {**(extra_config or {}), "draft_vocab_coverage": round(coverage, 5)}
            if progress:
                print(f"draft vocabulary: {len(subset)} tokens cover {coverage:.2%} of the training answers' tokens")
        heads = _new_heads(model, sync, seed, kind, num_heads=num_heads, num_layers=num_layers,
                           prefix_layer=prefix_layer, vocab_subset=subset, **(head_options or {}))
    tuned = _tuned_base(model, joint, epochs, warmup_epochs)
    run = _Fit(model=model, heads=heads, acc=acc, sync=sync, out=out, tuned=tuned, progress=progress,
               distill=distill, eagle=eagle, lm_weight=lm_weight, max_len=max_len, joint=joint,
               warmup_epochs=warmup_epochs, base_name=base_name, extra_config=extra_config)
    _optimizer(run, default_lr(kind) if lr is None else lr, base_lr, accum, epochs, len(train), train_dtype)
    start_epoch = _resume(run)
    _base_cache(run, data_path, cache_bytes, rows)
    run.sub_idx = heads.subset
    _run_epochs(run, train, test, random.Random(seed), start_epoch, epochs, accum)
    set_feature_layers(model, getattr(heads, "feature_layers", None))  # what the trained heads read when drafting
    return {"train": len(train), "heldout": len(test), "log": str(run.log), "processes": sync.n}


def _run_epochs(run: _Fit, train: list, test: list, rng: random.Random, start_epoch: int, epochs: int,
                accum: int) -> None:
    """The epochs from ``start_epoch``: train, evaluate on ``test``, log and save after each."""
    sync, model = run.sync, run.model
    for _ in range(start_epoch):  # a resumed run goes on with the orders an uninterrupted one would take
        rng.shuffle(list(train))
    for epoch in range(start_epoch, epochs):
        order = list(train)
        rng.shuffle(order)
        both = run.joint and epoch >= run.warmup_epochs
        running, step_losses, kl_sum = _epoch(run, order, accum, both, f"epoch {epoch + 1}/{epochs}")
        counts = eval_counts(run.heads, model, test[sync.rank::sync.n],
                              BaseOutputs(model, max_len=run.max_len) if both else run.base, run.eagle) \
            if test else None
        metrics = accuracy(sync.sum(counts)) if test else []
        base = run.base
        cache = sync.sum(torch.tensor([base.hits, base.misses, base.used - run.cache_start], dtype=torch.float64))
        if run.acc.is_main_process:
            _log_epoch(run, {
                "epoch": epoch + 1, "train_seqs": len(train), "heldout_seqs": len(test), "loss": running,
                "mean_loss": sum(step_losses) / max(1, len(step_losses)), "step_losses": step_losses,
                "processes": sync.n, "heads": metrics,
                "base_cache": {"hits": int(cache[0]), "computed": int(cache[1]), "bytes": run.cache_start + int(cache[2])},
                **({"joint": True, "lm_kl": kl_sum / max(1, len(order))} if both else {})})
            _save(run, epoch, both)
        run.acc.wait_for_everyone()  # the checkpoint and the log are complete before any process goes on


@dataclass
class _Fit:
    """One training run's parts: the model and heads, the processes, the optimizer and schedule, the base
    model's cached states, and what the loss and the checkpoints need."""

    model: torch.nn.Module
    heads: torch.nn.Module
    acc: object
    sync: Sync
    out: Path
    tuned: dict  # name -> parameter of the base trained jointly (Medusa-2); empty otherwise
    progress: bool
    distill: bool
    eagle: dict | None
    lm_weight: float
    max_len: int
    joint: bool
    warmup_epochs: int
    base_name: str
    extra_config: dict | None
    opt: object = None
    sched: object = None
    groups: list = field(default_factory=list)
    params: list = field(default_factory=list)
    amp: torch.dtype | None = None
    base: BaseOutputs | None = None
    cache_start: int = 0
    sub_idx: torch.Tensor | None = None

    @property
    def state_path(self) -> Path:
        return self.out / "train_state.pt"

    @property
    def log(self) -> Path:
        return self.out / "train_log.jsonl"


def _new_heads(model, sync: Sync, seed: int, kind: str, **options):
    """Fresh heads of ``kind`` (float32), the same in every process and every run (from ``seed``)."""
    with torch.random.fork_rng(devices=[model.device.index or 0] if model.device.type == "cuda" else []):
        torch.manual_seed(seed)  # the same fresh heads in every process (and every run)
        heads = build_heads(kind, model, **options).float()
    sync.broadcast(heads.state_dict().values())
    _training_features(model, heads)
    return heads


def _init_heads(model, sync: Sync, kind: str, directory):
    """The heads saved in ``directory`` (float32, dequantised if stored as codes) to train on from there."""
    cfg = read_heads_config(directory)
    if cfg.get("kind") != kind:
        raise HydraspecError(f"--init holds {cfg.get('kind')} heads, not {kind} heads")
    heads = saved_heads(directory, model, cfg).float().to(model.device)
    sync.broadcast(heads.state_dict().values())
    _training_features(model, heads)
    return heads


def _training_features(model, heads) -> None:
    """EAGLE-3 trains on the joined layers and the last state (the teacher's logits): the model hands out both."""
    layers = getattr(heads, "feature_layers", None)
    if layers is not None:
        set_feature_layers(model, layers + [model.config.get_text_config(decoder=True).num_hidden_layers])


def _log_epoch(run: _Fit, record: dict) -> None:
    with run.log.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _tuned_base(model, joint: bool, epochs: int, warmup_epochs: int) -> dict:
    """Medusa-2: the base's parameters that train with the heads (all but the embeddings and the lm_head)."""
    if not joint:
        return {}
    if model.dtype != torch.float32:
        raise HydraspecError("joint (Medusa-2) training updates the base model: load it in float32")
    if warmup_epochs >= epochs:
        raise HydraspecError(f"joint training needs more epochs ({epochs}) than heads-only warm-up epochs "
                             f"({warmup_epochs})")
    unpack(model)  # prepacked weight copies would go stale once the base trains
    frozen = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return {n: p for n, p in model.named_parameters() if id(p) not in frozen}


def _optimizer(run: _Fit, lr: float, base_lr: float | None, accum: int, epochs: int, n_train: int,
               train_dtype: str) -> None:
    """AdamW over the heads (and the tuned base at its own rate), the schedule, the autocast dtype."""
    run.groups = [{"params": [p for p in run.heads.parameters() if p.requires_grad], "lr": lr}]
    if run.tuned:
        run.groups.append({"params": list(run.tuned.values()), "lr": base_lr if base_lr is not None else lr / 4})
    if accum < 1:
        raise HydraspecError("grad_accum must be at least 1")
    run.opt = torch.optim.AdamW(run.groups, **fused_options(run.model.device))
    steps_total = max(1, epochs * -(-n_train // accum))
    run.sched = torch.optim.lr_scheduler.LambdaLR(run.opt, lambda step: lr_factor(step, steps_total))
    run.amp = autocast_dtype(run.model.device, train_dtype)
    run.params = [p for g in run.opt.param_groups for p in g["params"]]


def _resume(run: _Fit) -> int:
    """The epoch to start from: 0, or where a saved training state left off (heads, optimizer, schedule and
    the tuned base restored)."""
    if not run.state_path.exists():
        return 0
    st = torch.load(run.state_path, map_location="cpu", weights_only=False)
    run.heads.load_state_dict(st["heads"])
    run.opt.load_state_dict(st["opt"])
    if st.get("sched"):
        run.sched.load_state_dict(st["sched"])
    if st.get("base"):
        with torch.no_grad():
            for n, v in st["base"].items():
                run.tuned[n].copy_(v)
    return st["epoch"]


def _base_cache(run: _Fit, data_path, cache_bytes: int, rows: list) -> None:
    """The base model's states of the training sequences, cached on disk beside the data (with joint training
    the original base's states of every sequence, computed now)."""
    acc, sync = run.acc, run.sync
    with acc.main_process_first():  # the main process clears a stale cache and writes its meta; then the others
        base = BaseOutputs.for_data(run.model, data_path, cache_bytes, run.max_len, run.base_name)
    run.base, run.cache_start = base, base.used
    if sync.n > 1:  # the processes fill one directory: each may add its share of the room left
        base.max_bytes = base.used + max(0, base.max_bytes - base.used) // sync.n
    if run.joint:  # the original base's states, the KL target, must exist before the base changes
        for r in tqdm(rows[sync.rank::sync.n], desc="original base states", unit="seq", disable=not run.progress):
            base.hidden(r, base.ids(r))
        acc.wait_for_everyone()
        if not all(base.has(r) for r in rows):
            raise HydraspecError("joint training needs the original base states of every sequence in the base "
                                 "cache; raise --cache-gb")


def _sequence_loss(run: _Fit, r: dict, both: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One sequence's loss (heads' loss, plus lm_weight x the tuned base's KL from the original under joint
    training) and the KL (None without it)."""
    model, base = run.model, run.base
    ids = base.ids(r)
    hidden = base.hidden(r, ids)  # the original base's states (cached)
    teacher = teacher_logits(model, hidden, run.sub_idx) if run.distill else None
    kl = None
    if both:  # Medusa-2: the heads read the tuned base, which stays close to the original
        ans = torch.arange(max(0, len(r["prompt_ids"]) - 1), ids.numel() - 1, device=ids.device)
        orig = teacher_logits(model, hidden[ans])  # only the answer positions the KL reads
        out_m = model(input_ids=ids[None], output_hidden_states=True, use_cache=False, logits_to_keep=1)
        hidden = features(model, out_m.hidden_states)[0, :-1]
        cur = project_hidden(model, hidden[ans])
        kl = F.kl_div(cur.log_softmax(-1), orig.log_softmax(-1), log_target=True, reduction="batchmean")
    with torch.autocast(model.device.type, dtype=run.amp, enabled=run.amp is not None):
        loss, _ = heads_loss(run.heads, run.heads.prefixed(hidden.float()), ids, len(r["prompt_ids"]),
                             embed=model.get_input_embeddings(), teacher_logits=teacher, eagle=run.eagle)
    if kl is not None:
        loss = loss + run.lm_weight * kl
    return loss, kl


def _epoch(run: _Fit, order: list, accum: int, both: bool, desc: str) -> tuple[float, list[float], float]:
    """One pass over ``order`` in optimizer steps of ``accum`` sequences (the global batches, each process
    taking every n-th); returns the running loss, each step's loss and the summed KL."""
    sync = run.sync
    steps = [order[i: i + accum] for i in range(0, len(order), accum)]  # the global batches
    bar = tqdm(total=len(order), desc=desc, unit="seq", disable=not run.progress)
    running, step_losses = 0.0, []
    for p in run.tuned.values():
        p.requires_grad_(both)
    kl_sum = 0.0
    for step in steps:
        stats = torch.zeros(2, dtype=torch.float64)  # this process's share of: the step's loss, sum of KLs
        for r in step[sync.rank::sync.n]:
            loss, kl = _sequence_loss(run, r, both)
            if kl is not None:
                stats[1] += float(kl.detach())
            (loss / len(step)).backward()
            stats[0] += float(loss.detach()) / len(step)
        stats = sync.grads(run.params, stats)  # every process now holds the whole step's gradients
        run.opt.step()
        run.sched.step()
        run.opt.zero_grad()
        lv = float(stats[0])
        kl_sum += float(stats[1])
        running = 0.9 * running + 0.1 * lv if step_losses else lv
        step_losses.append(lv)
        bar.update(len(step))
        bar.set_postfix(loss=f"{running:.3f}")
    bar.close()
    return running, step_losses, kl_sum


def _save(run: _Fit, epoch: int, both: bool) -> None:
    """The heads (config and weights) and the training state after ``epoch`` (main process)."""
    model, out = run.model, run.out
    extra = dict(run.extra_config or {})
    name = run.base_name
    if run.joint:  # the heads now belong to the tuned base, saved beside them
        model.save_pretrained(out / "base")
        name = str(out / "base")
        extra["joint"] = {"original_base": run.base_name, "warmup_epochs": run.warmup_epochs,
                          "lm_weight": run.lm_weight, "base_lr": run.groups[1]["lr"], "base_dir": "base"}
    save_heads(run.heads, out, base_model=name, kind_detail={"distill": run.distill, "epochs": epoch + 1},
               base_fingerprint=base_fingerprint(model), **extra)
    torch.save({"heads": run.heads.state_dict(), "opt": run.opt.state_dict(), "sched": run.sched.state_dict(),
                "epoch": epoch + 1,
                "base": {n: p.detach().clone() for n, p in run.tuned.items()} if both else None}, run.state_path)
