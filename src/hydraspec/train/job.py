"""`hydraspec train-heads` as one job: the self-distillation data (prompts from files, docstrings, the model
itself, or text read at prefill speed), generated once by the main process, then the heads trained on it
(:func:`~hydraspec.train.trainer.train_heads`) and reported. :class:`HeadsJob` holds what the command line
gives; :func:`run_heads_job` runs it (also under ``accelerate launch``, one process per device)."""
from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from datetime import timedelta

import torch

from ..bench.prompts import load_questions
from ..drafters.draft_model import check_vocab
from ..errors import HydraspecError
from ..models import default_writer, load_model, resolve_device
from ..options import thread_count
from ..stack import load_models
from .data import answer_prompts, load_answers
from .docprompts import module_prompts
from .selfprompts import self_prompts
from .text_data import write_text_rows
from .fit import train_heads
from .trainer import BaseOutputs

__all__ = ["HeadsJob", "run_heads_job"]


@dataclass
class HeadsJob:
    """What to train and on what (the train-heads options, same names and meanings)."""

    model: str
    out: str
    kind: str
    dtype: str = "bfloat16"
    device: str = "auto"
    quant: str = "none"
    eagle_intermediate: int = 0
    eagle_steps: int = 2
    prompts: list[str] | None = None
    data: str | None = None
    docstring_prompts: int = 0
    self_prompts: int = 0
    self_prompts_model: str | None = None
    answers_model: str | None = "auto"
    text: list[str] | None = None
    text_tokens: int = 200_000
    limit: int | None = None
    skip: int = 0
    batch_size: int = 8
    max_new_tokens: int = 256
    data_method: str = "pld"
    data_only: bool = False
    num_heads: int = 4
    num_layers: int = 1
    epochs: int = 2
    lr: float | None = None  # None: the kind's own (fit.default_lr)
    grad_accum: int = 4
    train_dtype: str = "auto"
    draft_vocab: int = 0
    heldout: float = 0.1
    joint: bool = False
    warmup_epochs: int = 1
    lm_weight: float = 0.01
    base_lr: float | None = None
    cache_gb: float = 4.0
    init: str | None = None

    @classmethod
    def from_args(cls, args) -> "HeadsJob":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def writer(self) -> str | None:
        """Who writes the answers: --answers-model, with auto resolved (see its help); None: the base."""
        if self.answers_model in (None, "none"):
            return None
        if self.answers_model == "auto":
            return default_writer(self.model) if _variant(self)[1] else None
        return self.answers_model

    def reuse(self) -> bool:
        """No new prompts: the answers file is trained on as it is."""
        return not self.prompts and not self.docstring_prompts and not self.self_prompts

    def text_only(self) -> bool:
        """No new prompts and no answers file: the heads learn from --text alone."""
        return self.reuse() and bool(self.text) and not (self.data and os.path.exists(self.data))


@dataclass
class _Run:
    """What the job has so far: the processes, the model, the prompts and where the data is."""

    job: HeadsJob
    reuse: bool = False  # (both as they were when the job started)
    text_only: bool = False
    state: object = None  # accelerate's PartialState under accelerate launch / torchrun, else None
    model: object = None
    tok: object = None
    questions: list = field(default_factory=list)
    pairs: list = field(default_factory=list)
    data: str = ""
    text_tokens: int = 0

    @property
    def is_main(self) -> bool:  # only the main process generates data and reports
        return self.state is None or self.state.is_main_process

    def wait(self) -> None:
        if self.state is not None:
            self.state.wait_for_everyone()


def _check(run: _Run) -> None:
    job = run.job
    if job.epochs < 1 or job.num_heads < 1 or job.num_layers < 1:
        raise HydraspecError("--epochs, --num-heads and --num-layers must be at least 1")
    if job.cache_gb < 0:
        raise HydraspecError("--cache-gb must be 0 or more")
    if run.reuse and not run.text_only and not (job.data and os.path.exists(job.data)):
        raise HydraspecError("give --prompts FILE..., --self-prompts N and/or --docstring-prompts N, or --text PATH... "
                             "(or --data with an existing answers file to train on as it is)")
    if job.text_tokens < 512:
        raise HydraspecError("--text-tokens must be at least 512")
    if run.reuse and job.data_only:
        raise HydraspecError("--data-only needs prompts to answer")
    if job.writer() and not _variant(job)[1]:  # not distilled: the answer tokens are the targets
        raise HydraspecError(f"--answers-model: another model's answers are learnt through the base's own "
                             f"distributions, which --kind {job.kind} does not train on (use hydra++ or eagle)")


def _processes(job: HeadsJob):
    """accelerate's PartialState under ``accelerate launch`` / torchrun (set up before the model loads, so that
    a GPU process takes its own GPU; a long timeout, as the other processes wait while the main one generates
    the data), else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import PartialState  # heavy

    return PartialState(cpu=resolve_device(job.device) == "cpu", timeout=timedelta(hours=24))


def _start(run: _Run) -> None:
    """The prompts from files and docstrings, the processes, the model (and the prompts it writes itself)."""
    job = run.job
    run.questions = load_questions(job.prompts, limit=job.limit, skip=job.skip) if job.prompts else []
    run.pairs = [(f"{q.source}-{q.question_id}", q.turns) for q in run.questions]
    if job.docstring_prompts:
        run.pairs += module_prompts(limit=job.docstring_prompts)
    torch.set_num_threads(thread_count())
    run.state = _processes(job)
    run.model, run.tok, _ = load_models(job, progress=run.is_main)
    run.data = job.data or os.path.join(job.out, "answers.jsonl")
    if job.self_prompts and run.is_main:  # prompts the model (or a smaller one with its tokenizer) writes itself
        writer, wtok = (run.model, run.tok) if not job.self_prompts_model else \
            load_model(job.self_prompts_model, dtype=job.dtype, device=job.device, progress=True)
        run.pairs += self_prompts(writer, wtok, job.self_prompts, os.path.join(job.out, "self_prompts.jsonl"),
                                  batch_size=job.batch_size)
        del writer, wtok


def _say_data(run: _Run) -> None:
    job = run.job
    if not run.is_main:
        return
    if run.text_only:
        print("self-distillation data: none (text only)", file=sys.stderr)
    elif run.reuse:
        print(f"self-distillation data: the answers already in {run.data} (no new prompts)", file=sys.stderr)
    else:
        print(f"self-distillation data: {len(run.questions)} prompts from {', '.join(job.prompts or ['-'])}"
              f" + {len(run.pairs) - len(run.questions)} self-written and docstring prompts -> {run.data}",
              file=sys.stderr)


def _answer(run: _Run, cache_bytes: int) -> None:
    """The answers to the prompts (main process; the others wait for the data): the base model's, with its
    states kept from decoding, or --answers-model's, which the base reads in training."""
    job = run.job
    if run.is_main and not run.text_only:
        options = dict(max_new_tokens=job.max_new_tokens, batch_size=job.batch_size, method=job.data_method)
        name = job.writer()
        if name:  # the base reads them in training
            print(f"answers written by {name}, read by {job.model}", file=sys.stderr)
            writer, wtok = load_model(name, dtype=job.dtype, device=job.device, quant="auto", progress=True)
            check_vocab(run.tok, wtok)
            answer_prompts(writer, wtok, run.pairs, run.data, **options)
            del writer, wtok
        else:
            answer_prompts(run.model, run.tok, run.pairs, run.data, **options,
                           base_cache=BaseOutputs.for_data(run.model, run.data, cache_bytes, base_name=job.model))
    run.wait()


def _variant(job: HeadsJob) -> tuple[str, bool, int, bool, dict, dict | None]:
    """(kind, distill, layers, prefix layer, head options, EAGLE loss options) for --kind."""
    kind, distill, layers, prefix = job.kind, False, job.num_layers, False
    head_options, eagle = {}, None
    if kind == "hydra++":
        kind, distill, layers, prefix = "hydra", True, max(layers, 4), True
    if kind in ("eagle", "eagle3"):  # distilled from the base's own distribution, as EAGLE trains
        distill = True
        head_options = {"intermediate_size": job.eagle_intermediate} if job.eagle_intermediate else {}
        eagle = {"steps": job.eagle_steps}
    return kind, distill, layers, prefix, head_options, eagle


def _add_text(run: _Run) -> None:
    """--text read at prefill speed (the base's own distributions are the targets), alone or appended to the
    answers in one training file."""
    job, out = run.job, run.job.out
    text = os.path.join(out, "text.jsonl")
    if run.is_main:
        run.text_tokens = write_text_rows(run.tok, job.text, text, job.text_tokens, progress=True)
        if run.text_only:
            run.data = text
        else:  # answers and text in one training file
            mixed = os.path.join(out, "train.jsonl")
            with open(mixed, "w") as f:
                for path in (run.data, text):
                    f.write(open(path).read())
            run.data = mixed
    if run.state is not None:
        run.state.wait_for_everyone()
        run.data = text if run.text_only else os.path.join(out, "train.jsonl")


def _used(run: _Run) -> dict:
    """What the heads were trained on, for their config.json."""
    job = run.job
    text_used = {"paths": [os.path.basename(str(p)) for p in job.text or []], "tokens": run.text_tokens}
    if run.text_only:
        used = {"train_text": text_used, "variant": job.kind}
    elif run.reuse:  # what the answers file holds, by prompt source
        answered = Counter(str(r["id"]).split(".")[0].rsplit("-", 1)[0] for r in load_answers(run.data))
        used = {"train_prompts": {"answers_file": os.path.basename(run.data), "answers_by_source": dict(answered)},
                "variant": job.kind}
    else:
        used = {"train_prompts": {"files": [os.path.basename(p) for p in job.prompts or []],
                                  "skip_per_category": job.skip, "limit_per_category": job.limit,
                                  "questions": len(run.questions), "self_prompts": job.self_prompts,
                                  "docstring_prompts": job.docstring_prompts, "answers_model": job.writer()},
                "variant": job.kind}
    if job.text and not run.text_only:
        used["train_text"] = text_used
    return used


def _report(run: _Run, res: dict, kind: str, t0: float, t_data: float) -> None:
    job, out = run.job, run.job.out
    if job.joint:
        run.tok.save_pretrained(os.path.join(out, "base"))
    print(f"data generation {t_data / 60:.1f} min, training {(time.perf_counter() - t0 - t_data) / 60:.1f} min",
          file=sys.stderr)
    last = [json.loads(x) for x in open(res["log"])][-1]
    for h in last["heads"]:
        print(f"head {h['head']}: held-out top-1 {h['top1']:.3f}, top-5 {h['top5']:.3f} over {h['n']} targets")
    if job.joint:
        print(f"heads and the tuned base saved in {out}; use them with --model {os.path.join(out, 'base')} "
              f"--method {kind} --heads {out}")
    else:
        method = "eagle" if kind == "eagle3" else kind  # an EAGLE-3 head drafts as EAGLE heads do
        print(f"heads saved in {out}; use them with --method {method} --heads {out}")


def run_heads_job(job: HeadsJob) -> int:
    """Generate the data and train the heads as ``job`` asks; 0 when done (raises HydraspecError)."""
    run = _Run(job, reuse=job.reuse(), text_only=job.text_only())
    try:
        return _run_job(run)
    finally:  # under accelerate launch, gloo's threads end before the process does (else it may abort at exit)
        if run.state is not None:
            run.state.destroy_process_group()


def _run_job(run: _Run) -> int:
    job = run.job
    _check(run)
    _start(run)
    _say_data(run)
    if job.batch_size < 1:
        raise HydraspecError("--batch-size must be at least 1")
    t0 = time.perf_counter()
    cache_bytes = int(job.cache_gb * (1 << 30))
    _answer(run, cache_bytes)
    t_data = time.perf_counter() - t0
    if job.data_only:
        if run.is_main:
            print(f"data generation {t_data / 60:.1f} min; answers in {run.data}", file=sys.stderr)
        return 0
    kind, distill, layers, prefix, head_options, eagle = _variant(job)
    if job.text:
        distill = True
        _add_text(run)
    res = train_heads(run.model, run.data, job.out, kind=kind, base_name=job.model, num_heads=job.num_heads,
                      num_layers=layers, epochs=job.epochs, lr=job.lr, distill=distill, heldout=job.heldout,
                      prefix_layer=prefix, extra_config=_used(run), draft_vocab=job.draft_vocab or None,
                      cache_bytes=cache_bytes, joint=job.joint, warmup_epochs=job.warmup_epochs,
                      lm_weight=job.lm_weight, base_lr=job.base_lr, train_dtype=job.train_dtype,
                      accum=job.grad_accum, head_options=head_options, eagle=eagle, init=job.init)
    if run.is_main:  # the main process saved everything and reports
        _report(run, res, kind, t0, t_data)
    return 0
