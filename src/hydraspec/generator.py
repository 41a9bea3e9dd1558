"""The decoding loop: prefill once, then draft -> verify -> accept -> compact, until a stop."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from .accept import ACCEPTORS, Acceptance
from .cache import new_cache, text_config
from .drafters.base import DecodeState, Drafter, NoDrafter
from .errors import HydraspecError
from .sampling import Sampling, sample
from .tree import shape_of
from .verify import check_supported, forward_nodes


@dataclass
class Stats:
    """new_tokens / target_forwards is the mean number of tokens accepted per target forward after
    prefill (plain decoding = 1.00). accept_hist[i] counts forwards that emitted i tokens."""

    new_tokens: int = 0
    target_forwards: int = 0
    accept_hist: list[int] = field(default_factory=lambda: [0])
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    wall_s: float = 0.0
    prompt_tokens: int = 0

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def count(self, emitted: int) -> None:
        while len(self.accept_hist) <= emitted:
            self.accept_hist.append(0)
        self.accept_hist[emitted] += 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mean_accepted"] = round(self.mean_accepted, 4)
        d["tokens_per_s"] = round(self.tokens_per_s, 4)
        return d


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # new tokens only (an EOS that ended the answer included)
    prompt_ids: list[int]
    stats: Stats
    finish_reason: str  # "eos" | "length" | "stop"
    # BatchGenerator.generate(keep_hidden=True): the target's last hidden states at every position of
    # prompt + answer but the last, [len(prompt_ids) + len(token_ids) - 1, dim]
    hidden_states: "torch.Tensor | None" = None


def eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if e is None:
            continue
        ids.update(e if isinstance(e, (list, tuple)) else [e])
    return {int(i) for i in ids if i is not None}


def context_limit(model) -> int | None:
    return getattr(text_config(model), "max_position_embeddings", None)


class SpeculativeGenerator:
    """Lossless speculative decoding for a stock Hugging Face causal LM.

    drafter: a Drafter (None = plain autoregressive decoding through the same engine).
    acceptor: "greedy", "lossless" or "typical"; None picks greedy at temperature 0 and lossless
    speculative sampling otherwise. Only "typical" changes the output distribution.
    """

    def __init__(self, model, tokenizer, drafter: Drafter | None = None, acceptor: str | None = None,
                 typical_epsilon: float = 0.09, typical_alpha: float = 0.3):
        check_supported(model)
        if acceptor is not None and acceptor not in ACCEPTORS:
            raise HydraspecError(f"unknown acceptor '{acceptor}'; known: {', '.join(ACCEPTORS)}")
        self.model, self.tokenizer = model, tokenizer
        self.drafter = drafter or NoDrafter()
        self.acceptor = acceptor
        self.typical = {"epsilon": typical_epsilon, "alpha": typical_alpha}
        self.eos = eos_ids(model, tokenizer)
        self.ctx = context_limit(model)
        cfg = text_config(model)
        self.window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None

    # -- prompts --------------------------------------------------------------------------------
    def encode(self, prompt, chat: bool = True) -> list[int]:
        """A string or a list of {"role", "content"} messages -> prompt token ids. The chat template is
        applied when the tokenizer has one (a plain string becomes one user message)."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise HydraspecError("the prompt is empty")
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = list(prompt)
            if not messages:
                raise HydraspecError("the conversation is empty")
        tok = self.tokenizer
        if chat and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in messages)
        ids = tok(text, add_special_tokens=True)["input_ids"]
        if not ids:
            raise HydraspecError("the prompt encodes to no tokens")
        return list(ids)

    # -- decoding -------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompt=None, *, input_ids: list[int] | None = None, max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop: list[str] | None = None, streamer=None, chat: bool = True) -> GenerationResult:
        if max_new_tokens <= 0:
            raise HydraspecError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if temperature < 0 or not (0 < top_p <= 1) or top_k < 0:
            raise HydraspecError("need temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
        ids = list(input_ids) if input_ids is not None else self.encode(prompt, chat=chat)
        if not ids:
            raise HydraspecError("the prompt is empty")
        total = len(ids) + max_new_tokens
        if self.ctx and total > self.ctx:
            raise HydraspecError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                                 f"model's context of {self.ctx} tokens")
        if self.window and total > self.window:
            raise HydraspecError(f"prompt + max_new_tokens ({total}) exceeds the model's sliding window "
                                 f"({self.window}); tree attention over a sliding window is not supported")

        sampling = Sampling(temperature, top_k, top_p)
        gen = None
        if not sampling.greedy or self.acceptor == "typical":
            gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
        accept_name = self.acceptor or ("greedy" if sampling.greedy else "lossless")
        if sampling.greedy:
            accept_name = "greedy"
        accept = ACCEPTORS[accept_name]

        model, drafter, dev = self.model, self.drafter, self.model.device
        stats = Stats(prompt_tokens=len(ids))
        t_start = time.perf_counter()
        capacity = total + drafter.max_nodes + 1
        cache = new_cache(model, capacity)
        need_hidden = drafter.needs_hidden

        hidden = None
        if len(ids) > 1:  # the last prompt token becomes the first pending token
            pre = torch.tensor(ids[:-1], dtype=torch.long, device=dev)
            _, h = forward_nodes(model, cache, pre, torch.arange(len(ids) - 1, device=dev), None, 0,
                                 want_hidden=need_hidden, last_only=True)
            hidden = h[-1] if h is not None else None
        state = DecodeState(tokens=list(ids), prompt_len=len(ids), sampling=sampling, generator=gen,
                            hidden=hidden, new_hidden=h if hidden is not None else None)
        if streamer is not None:
            streamer.put(torch.tensor([ids]))
        drafter.start(state, capacity)
        stats.prefill_s = time.perf_counter() - t_start

        new: list[int] = []
        finish = "length"
        stop_strings = [s for s in (stop or []) if s]
        while len(new) < max_new_tokens:
            t0 = time.perf_counter()
            tree = drafter.propose(state)
            remaining = max_new_tokens - len(new)
            shape = shape_of(tree.with_root())
            if int(shape.depth[-1]) > remaining - 1:  # no drafting past the token budget
                tree = tree.head(int((shape.depth <= remaining - 1).sum()) - 1)
                shape = shape_of(tree.with_root())
            t1 = time.perf_counter()

            L = cache.length
            node_ids = torch.cat([torch.tensor([state.tokens[-1]]), tree.tokens.cpu()]).to(dev)
            positions = (L + shape.depth).to(dev)
            anc = None if shape.is_chain else shape.ancestors
            logits, hid = forward_nodes(model, cache, node_ids, positions, anc, L, want_hidden=need_hidden)
            t2 = time.perf_counter()

            q = tree.q
            if q is not None and q.shape[-1] != logits.shape[-1]:
                q = fit_vocab(q, logits.shape[-1])
            acc: Acceptance = accept(shape, node_ids.tolist(), logits, q=q, sampling=sampling,
                                     generator=gen, **(self.typical if accept_name == "typical" else {}))
            cache.keep(L, torch.tensor(acc.path, dtype=torch.long, device=dev))
            emitted = node_ids[acc.path[1:]].tolist() + [acc.next_token]
            stats.target_forwards += 1

            # stops: EOS (kept, nothing after it), token budget, stop strings
            cut = len(emitted)
            for i, t in enumerate(emitted):
                if t in self.eos:
                    cut, finish = i + 1, "eos"
                    break
            if len(new) + cut >= max_new_tokens and finish != "eos":
                cut = max_new_tokens - len(new)
            emitted = emitted[:cut]
            new.extend(emitted)
            if stop_strings:
                n_before = len(new) - len(emitted)
                hit = stop_at(self.tokenizer, new, n_before, stop_strings)
                if hit is not None:
                    del new[hit:]
                    emitted = emitted[: max(0, hit - n_before)]
                    finish = "stop"
            stats.count(len(emitted))
            if streamer is not None and emitted:
                streamer.put(torch.tensor(emitted))
            state.tokens.extend(emitted)
            state.hidden = hid[acc.path[-1]] if hid is not None else None
            state.new_hidden = hid[acc.path] if hid is not None else None
            t3 = time.perf_counter()
            drafter.observe(state, [i - 1 for i in acc.path[1:]])
            t4 = time.perf_counter()
            stats.draft_s += (t1 - t0) + (t4 - t3)
            stats.verify_s += t2 - t1
            stats.accept_s += t3 - t2
            if finish != "length" or len(new) >= max_new_tokens:
                break

        if streamer is not None:
            streamer.end()
        stats.new_tokens = len(new)
        stats.wall_s = time.perf_counter() - t_start
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        if finish == "stop":
            text = trim_after_stop(text, stop_strings)
        return GenerationResult(text=text, token_ids=new, prompt_ids=ids, stats=stats, finish_reason=finish)

    def generate_batch(self, prompts=None, *, trees: dict | None = None, verify_budget: int | None = None, **kwargs):
        """Decode a list of prompts together (one verify forward per step for the whole batch); see
        hydraspec.batch.BatchGenerator.generate for the arguments. Returns a BatchResult (results in
        input order)."""
        from .batch import BatchGenerator

        bg = BatchGenerator(self.model, self.tokenizer, self.drafter, acceptor=self.acceptor, trees=trees,
                            verify_budget=verify_budget, typical_epsilon=self.typical["epsilon"], typical_alpha=self.typical["alpha"])
        return bg.generate(prompts, **kwargs)


def fit_vocab(q: torch.Tensor, v: int) -> torch.Tensor:
    if q.shape[-1] > v:
        return q[:, :v]
    return torch.nn.functional.pad(q, (0, v - q.shape[-1]))


def stop_at(tokenizer, new: list[int], n_before: int, stops: list[str]) -> int | None:
    """Smallest token count (> n_before) whose decoded text contains a stop string, or None."""
    if not any(s in tokenizer.decode(new, skip_special_tokens=True) for s in stops):
        return None
    for n in range(n_before + 1, len(new) + 1):
        text = tokenizer.decode(new[:n], skip_special_tokens=True)
        if any(s in text for s in stops):
            return n
    return None


def trim_after_stop(text: str, stops: list[str]) -> str:
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return text[: min(ends)] if ends else text
