"""Draft heads that keep learning from the answers a server gives (``hydraspec serve --learn DIR``).

Self-distillation as in Medusa-1 and Hydra (Cai et al. 2024, arXiv 2401.10774; Ankner et al. 2024, arXiv
2402.05109): a server's finished answers are its base model's own output, so heads trained on them learn what
verification accepts, at no extra decoding cost: the engine keeps the base's hidden states of every answer
while it decodes, so the heads train on them without a second base forward (answers kept before a restart
are read again, CHUNK tokens a unit). The engine's thread calls :meth:`HeadLearner.work` only while no
request runs or waits, and each call is one unit (a training step on one answer, one held-out answer scored,
or one chunk read), so a request that arrives waits for at most one unit. A candidate copy of the heads trains on every answer
PASSES times; every EVAL_EVERY steps it is scored on held-out answers (a tenth, by id) against the heads in
use, by the accepted length a chain of their top-1 guesses would have had along those answers, and replaces
them when it scores higher. The heads in use are kept in DIR/heads, the candidate and its optimizer in
DIR/learn_state.safetensors, so a restart goes on from there. Both are written in idle time too, a slice of at
most CHUNK_BYTES a unit (hydraspec.serve.chunked_write), at most every HEADS_EVERY_S and STATE_EVERY_S, and
whole at close(). Heads only propose tokens: the output never changes.
"""
from __future__ import annotations

import json
import shutil
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import DynamicCache

try:  # transformers 5: module initialisation skipped inside this context
    from transformers.initialization import no_init_weights
except ImportError:  # elsewhere: weights are drawn and then overwritten
    from contextlib import nullcontext as no_init_weights

from ..backend import eager_forward
from ..cache import cache_kwargs
from ..features import features
from ..heads import base_fingerprint, build_heads, drafting_kernels, heads_config, heads_state, saved_heads
from ..train.data import load_answers
from ..train.losses import heads_loss
from ..train.trainer import BaseOutputs, accuracy, autocast_dtype, eval_counts, fused_options, is_heldout, \
    teacher_logits
from .chunked_write import ChunkedWrite


HELDOUT = 0.1  # the share of answers kept out of training to score the heads on
MAX_HELDOUT = 48  # the most recent held-out answers scored on
WINDOW = 4000  # the most recent answers trained on
PASSES = 2  # times each answer is trained on; then the learner idles until new answers come
EVAL_EVERY = 32  # training steps between scorings
MIN_GAIN = 0.005  # accepted tokens per step the candidate must gain over the heads in use
MAX_LEN = 384  # prompt + answer tokens of one training step (a longer prompt is cut from the front)
CHUNK = 16  # tokens of an answer the base model reads in one unit (answers kept before a restart)
MIN_PROMPT = 64  # prompt tokens kept at least
LR = 1e-3
HEADS_EVERY_S, STATE_EVERY_S = 120.0, 600.0  # the heads in use, and the learning state, written at most this often
MEMO_BYTES = 256 << 20  # the base's states of answers kept in memory, for training and for scoring
HEADS, STATE = "heads", "learn_state.safetensors"


@dataclass
class LearnStats:
    """What /health reports of the learning."""

    answers: int = 0  # answers trained on (the held-out ones apart)
    heldout: int = 0
    steps: int = 0  # training steps taken
    swaps: int = 0  # times the heads in use were replaced
    score: float = 0.0  # the heads in use: accepted draft tokens per step on the held-out answers
    candidate: float = 0.0  # the candidate's, at the last scoring
    longest_unit_s: float = 0.0  # the longest unit of work so far: what a request arriving may wait


class HiddenMemo:
    """The base model's states of answers (``ids``/``hidden`` as BaseOutputs), kept in memory, at most
    ``max_bytes``: the oldest go first."""

    def __init__(self, base: BaseOutputs, max_bytes: int):
        self.base, self.max_bytes, self.used = base, max_bytes, 0
        self.states: OrderedDict = OrderedDict()

    def ids(self, row) -> torch.Tensor:
        return self.base.ids(row)

    def has(self, row) -> bool:
        return row["id"] in self.states

    def hidden(self, row, ids: torch.Tensor) -> torch.Tensor:
        if row["id"] not in self.states:
            self.put(row, self.base.hidden(row, ids))
        return self.states[row["id"]]

    def put(self, row, hidden: torch.Tensor) -> None:
        self.states[row["id"]] = hidden
        self.used += hidden.numel() * hidden.element_size()
        while self.used > self.max_bytes and len(self.states) > 1:
            _, old = self.states.popitem(last=False)
            self.used -= old.numel() * old.element_size()


class ChunkedRead:
    """The base model's states of one answer, read CHUNK tokens a unit, its keys and values kept between
    units: [T - 1, width] as :meth:`BaseOutputs.hidden` gives them."""

    def __init__(self, model, row: dict, ids: torch.Tensor):
        self.model, self.row, self.ids = model, row, ids
        self.cache, self.parts, self.at = DynamicCache(config=model.config), [], 0

    @torch.no_grad()
    def step(self) -> torch.Tensor | None:
        """Read the next chunk; the states once the whole answer is read, else None."""
        end = min(self.at + CHUNK, self.ids.numel())
        out = eager_forward(self.model)(input_ids=self.ids[None, self.at:end], **cache_kwargs(self.model, self.cache),
                                        use_cache=True, output_hidden_states=True, logits_to_keep=1)
        self.parts.append(features(self.model, out.hidden_states)[0])
        self.at = end
        return torch.cat(self.parts)[:-1] if end == self.ids.numel() else None


def chain_score(totals: torch.Tensor) -> float:
    """Accepted draft tokens per step of a chain of the heads' top-1 guesses, from their held-out counts
    (hydraspec.train.trainer.eval_counts): sum over depths of the product of the top-1 rates up to there."""
    score, reach = 0.0, 1.0
    for a in accuracy(totals):
        reach *= a["top1"]
        score += reach
    return score


@dataclass
class Scoring:
    """A scoring in progress, one held-out answer a unit: the answers, the next one, both heads' counts."""

    rows: list
    at: int = 0
    candidate: torch.Tensor | None = None
    live: torch.Tensor | None = None


def clone_heads(heads, model):
    """A float32 copy of ``heads`` with their own weights, sharing the base model's modules (built without
    drawing initial weights where transformers can skip that: they are overwritten at once)."""
    with no_init_weights():
        twin = build_heads(heads.kind, model, heads.num_heads, heads.num_layers, heads.own_projection,
                           vocab_subset=heads.subset).float()
    twin.load_state_dict(heads.state_dict())
    return twin


def head_drafters(drafter) -> list:
    """The head drafters inside ``drafter`` (itself and its twins per batch size, a hybrid's inner drafter, the
    auto method's drafters)."""
    if hasattr(drafter, "heads") and hasattr(drafter, "levels"):
        return [drafter] + [twin for _, twin in getattr(drafter, "by_rows", [])]
    found = []
    for part in list(getattr(drafter, "drafters", {}).values()) + [getattr(drafter, "inner", None)]:
        if part is not None and part is not drafter:
            found += head_drafters(part)
    return found


class HeadLearner:
    """Trains the heads that ``drafters`` (HeadDrafters sharing one heads module) use, from the answers in
    ``directory``/answers.jsonl and those :meth:`add` hands it; see the module doc. ``warm``: do a training
    step's first-time work now, learning nothing (:meth:`_warm`), rather than in the first unit."""

    def __init__(self, model, directory, drafters: list, base_name: str = "", say=print, warm: bool = True):
        self.model, self.dir, self.drafters, self.base_name = model, Path(directory), drafters, base_name
        self.say = say
        model.requires_grad_(False)  # gradients reach the heads only (not the embeddings the heads look up)
        self.candidate = saved_heads(self.dir / HEADS, model).float()
        self.live = clone_heads(self.candidate, model)
        self.opt = torch.optim.AdamW(self.candidate.parameters(), lr=LR, **fused_options(model.device))
        self.amp = autocast_dtype(model.device, "auto")
        base = BaseOutputs(model, None, max_len=MAX_LEN)
        self.memo, self.held = HiddenMemo(base, MEMO_BYTES), HiddenMemo(base, MEMO_BYTES // 4)
        self.pool: deque = deque(maxlen=WINDOW)  # [row, passes]
        self.heldout: deque = deque(maxlen=MAX_HELDOUT)
        self.stats, self.since_eval, self.scoring, self.reading = LearnStats(), 0, None, None
        self.fingerprint, self.chores, self.writes = base_fingerprint(model), deque(), deque()
        self.unsaved, self.written = None, {"heads": float("-inf"), "state": time.monotonic()}
        passes = self._resume()
        if warm:  # (off only to compare with a cold start)
            self._warm()
        for row in load_answers(self.dir / "answers.jsonl") if (self.dir / "answers.jsonl").exists() else []:
            self.add(row, passes.get(row["id"], 0))

    def _resume(self) -> dict:
        """The candidate, its optimizer and the counts of the last run (DIR/learn_state.safetensors); each answer's
        passes."""
        path = self.dir / STATE
        if not path.exists():
            return {}
        tensors = load_file(str(path), device=str(self.model.device))
        with safe_open(str(path), "pt") as f:
            meta = {k: json.loads(v) for k, v in f.metadata().items()}
        self.candidate.load_state_dict({k[len("candidate."):]: v for k, v in tensors.items() if k.startswith("candidate.")})
        opt: dict = {}
        for k, v in tensors.items():
            if k.startswith("opt."):
                _, i, name = k.split(".", 2)
                opt.setdefault(int(i), {})[name] = v
        self.opt.load_state_dict({"state": opt, "param_groups": meta["param_groups"]})
        self.stats = LearnStats(**{**meta["stats"], "answers": 0, "heldout": 0, "longest_unit_s": 0.0})
        return meta["passes"]

    def _warm(self) -> None:
        """A training step's first-time work done before the server starts, on a made-up answer, learning
        nothing (the first real step took five times longer than the next on Qwen2.5-Coder-1.5B)."""
        fresh = not self.opt.state
        ids = torch.arange(3, 3 + MIN_PROMPT, device=self.model.device)
        dim = self.model.config.get_text_config(decoder=True).hidden_size
        hidden = torch.zeros(len(ids) - 1, dim, device=self.model.device)
        with torch.inference_mode(False), torch.enable_grad():
            loss = self._loss(ids, hidden, len(ids) // 2)
            if not loss.requires_grad:
                return
            loss.backward()
            if fresh:
                self._fresh_optimizer_state()
            self.opt.zero_grad()

    def _fresh_optimizer_state(self) -> None:
        """The optimizer's state made now, as its first step would make it: a step with zero gradients and a
        learning rate of 0 (the weights stay as they are), then its step count set back to 0, so the state is
        a fresh one's (zero moments, step 0) and the next step computes what a first step does."""
        lrs = [g["lr"] for g in self.opt.param_groups]
        for g in self.opt.param_groups:
            g["lr"] = 0.0
        for p in self.candidate.parameters():
            if p.grad is not None:
                p.grad.zero_()
        self.opt.step()
        for g, lr in zip(self.opt.param_groups, lrs):
            g["lr"] = lr
        for st in self.opt.state.values():
            if torch.is_tensor(st["step"]):
                st["step"].zero_()
            else:
                st["step"] = 0

    def add(self, row: dict, passes: int = 0, hidden: torch.Tensor | None = None) -> None:
        """A finished answer {"id", "prompt_ids", "answer_ids"}: to the held-out set or the training pool.
        ``hidden``: the base's states at its positions 0 .. T - 2, as the engine kept them while answering
        (then the base need not read it again)."""
        if len(row["answer_ids"]) < 2:
            return
        room = MAX_LEN - min(len(row["answer_ids"]), MAX_LEN - MIN_PROMPT)
        cut = max(0, len(row["prompt_ids"]) - room)  # the answer must fit: its tokens are the targets
        if cut:
            row = {**row, "prompt_ids": row["prompt_ids"][cut:]}
        held = is_heldout(row["id"], HELDOUT)
        if hidden is not None:
            n = self.memo.ids(row).numel() - 1
            if hidden.shape[0] >= cut + n:
                (self.held if held else self.memo).put(row, hidden[cut:cut + n])
        if held:
            self.heldout.append(row)
            self.stats.heldout = len(self.heldout)
        else:
            self.pool.append([row, passes])
            self.stats.answers = len(self.pool)

    def work(self) -> bool:
        """One unit of learning (a chunk of the base's read of an answer, a training step, or one held-out
        answer scored); False when there is nothing to do."""
        t0 = time.perf_counter()
        did = self._unit()
        self.stats.longest_unit_s = round(max(self.stats.longest_unit_s, time.perf_counter() - t0), 4)
        return did

    def _unit(self) -> bool:
        if self.chores:  # what a scoring decided (a swap, a write to start), one a unit
            self.chores.popleft()()
            return True
        if self.writes:  # a slice of a file (before any training step: the state written must not change)
            if self.writes[0].step():
                self.writes.popleft()
            return True
        if self.scoring is not None:
            self._score_next()
            return True
        item = self._next()
        if item is not None and not self.memo.has(item[0]):  # the base reads the answer first, by chunks
            self._read(item[0], self.memo)
            return True
        if item is not None:
            self._train(item)
            if self.since_eval >= EVAL_EVERY and self.heldout:
                self.scoring, self.since_eval = Scoring(list(self.heldout)), 0
            return True
        if self.since_eval and self.heldout:
            self.scoring, self.since_eval = Scoring(list(self.heldout)), 0
            return True
        return False

    def _read(self, row: dict, memo: HiddenMemo) -> None:
        """One chunk of the base model's read of ``row``; its states go to ``memo`` after the last."""
        if self.reading is None or self.reading.row is not row:
            self.reading = ChunkedRead(self.model, row, memo.ids(row))
        with torch.inference_mode(False):
            hidden = self.reading.step()
        if hidden is not None:
            memo.put(row, hidden)
            self.reading = None

    def _next(self):
        """The pool entry with the fewest passes below PASSES, newest first among equals."""
        best = None
        for item in reversed(self.pool):
            if item[1] < PASSES and (best is None or item[1] < best[1]):
                best = item
        return best

    def _loss(self, ids: torch.Tensor, hidden: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """The heads against the base's own distribution along one answer (Hydra++'s loss)."""
        model = self.model
        teacher = teacher_logits(model, hidden, self.candidate.subset)
        with torch.autocast(model.device.type, dtype=self.amp, enabled=self.amp is not None):
            loss, _ = heads_loss(self.candidate, self.candidate.prefixed(hidden), ids, prompt_len,
                                 embed=model.get_input_embeddings(), teacher_logits=teacher)
        return loss

    def _train(self, item: list) -> None:
        """One optimizer step on one answer."""
        row = item[0]
        with torch.inference_mode(False), torch.enable_grad():
            ids = self.memo.ids(row)
            loss = self._loss(ids, self.memo.hidden(row, ids).float(), len(row["prompt_ids"]))
            if loss.requires_grad:  # else no target in reach
                loss.backward()
                self.opt.step()
                self.opt.zero_grad()
        item[1] += 1
        self.stats.steps += 1
        self.since_eval += 1

    def _score_next(self) -> None:
        """Score both heads on the next held-out answer; after the last, swap when the candidate wins."""
        sc = self.scoring
        if not self.held.has(sc.rows[sc.at]):
            self._read(sc.rows[sc.at], self.held)
            return
        row = [sc.rows[sc.at]]
        with torch.inference_mode(False), torch.no_grad():
            cand = eval_counts(self.candidate, self.model, row, self.held)
            live = eval_counts(self.live, self.model, row, self.held)
        sc.candidate = cand if sc.candidate is None else sc.candidate + cand
        sc.live = live if sc.live is None else sc.live + live
        sc.at += 1
        if sc.at < len(sc.rows):
            return
        self.scoring = None
        cand, live = chain_score(sc.candidate), chain_score(sc.live)
        self.stats.candidate, self.stats.score = round(cand, 4), round(live, 4)
        if cand >= live + MIN_GAIN:
            self.chores.append(lambda: self._swap(cand, live))
        if time.monotonic() - self.written["state"] >= STATE_EVERY_S:
            self.chores.append(self.save_state)

    def _swap(self, cand: float, live: float) -> None:
        """The candidate's weights into the heads the drafters use (between steps: this is the engine thread);
        the heads are written later, in slices (_put_heads)."""
        self.live = clone_heads(self.candidate, self.model)
        installed = clone_heads(self.candidate, self.model).to(dtype=self.model.dtype).eval().requires_grad_(False)
        drafting_kernels(installed)
        for d in self.drafters:
            d.heads = installed
        self.stats.swaps += 1
        self.stats.score = round(cand, 4)
        self.unsaved = (self.live, self.stats.steps)  # never changed after this: its write may take several units
        if time.monotonic() - self.written["heads"] >= HEADS_EVERY_S:
            self._put_heads()
        self.say(f"heads updated: {live:.3f} -> {cand:.3f} accepted draft tokens per step on {len(self.heldout)} "
                 f"held-out answers ({self.stats.steps} training steps, {self.stats.answers} answers)")

    def _put_heads(self) -> None:
        """DIR/heads replaced whole: written to DIR/heads.new, then renamed over it (ensure_heads takes back
        DIR/heads.old if a crash falls between the two renames). What a crash left in DIR/heads.new is written
        over, and a write queued behind another one of the heads starts once that one is in place."""
        heads, steps = self.unsaved
        new, old, final = self.dir / f"{HEADS}.new", self.dir / f"{HEADS}.old", self.dir / HEADS

        def swap_in():
            cfg = heads_config(heads, self.base_name, base_fingerprint=self.fingerprint, trained_on=steps)
            (new / "config.json").write_text(json.dumps(cfg, indent=1))
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
            new.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        self.writes.append(ChunkedWrite(new / "heads.safetensors", heads_state(heads), then=swap_in))
        self.unsaved, self.written["heads"] = None, time.monotonic()

    def save_state(self) -> None:
        """The candidate, its optimizer and the counts to be written, in slices, before the next training step."""
        if any(w.path.name == STATE for w in self.writes):
            return
        opt = self.opt.state_dict()
        tensors = {f"candidate.{k}": v for k, v in self.candidate.state_dict().items()}
        tensors.update({f"opt.{i}.{k}": v for i, st in opt["state"].items() for k, v in st.items()})
        meta = {"param_groups": opt["param_groups"], "passes": {row["id"]: n for row, n in self.pool},
                "stats": asdict(self.stats)}
        self.writes.append(ChunkedWrite(self.dir / STATE, tensors, {k: json.dumps(v) for k, v in meta.items()}))
        self.written["state"] = time.monotonic()

    def close(self) -> None:
        """Write what is not on disk yet (the heads in use, the learning state), whole (at shutdown)."""
        if self.unsaved is not None:
            self._put_heads()
        if self.stats.steps:
            self.save_state()
        while self.writes:
            self.writes.popleft().run()
