"""Speculative decoding of one prompt: a one-row call of the engine (hydraspec.engine), with a streamer."""
from __future__ import annotations

import torch

from .adaptive import SIZES, AdaptiveDraft, measure_verify_cost
from .batch import BatchGenerator
from .drafters.base import Drafter
from .engine import Request
from .errors import HydraspecError
from .inputs import check_length, check_sampling, encode_prompt
from .results import GenerationResult
from .sampling import Sampling

__all__ = ["SpeculativeGenerator"]


class SpeculativeGenerator:
    """Lossless speculative decoding for a stock Hugging Face causal LM.

    drafter: a Drafter (None = plain autoregressive decoding through the same engine).
    acceptor: "greedy", "lossless" or "typical"; None picks greedy at temperature 0 and lossless
    speculative sampling otherwise. Only "typical" changes the output distribution.

    Greedy decoding with a drafter whose proposals cost nothing (prompt lookup) proposes under
    hydraspec.adaptive's rule on the CPU: the target's verify cost is measured once per model and machine
    (one forward per size up to the drafter's longest proposal) and each proposal is cut to what the
    sequence's acceptance rate pays for, so lookups that keep missing cost next to nothing. Cutting drafts
    never changes a greedy output. Sampling keeps the drafter's own lengths: which drafts are verified
    decides which random numbers are drawn, and a seed must give the same text on every run.
    ``adaptive=False`` keeps them in greedy decoding too (the same drafts on every run, e.g. to compare
    acceptance step by step).
    """

    def __init__(self, model, tokenizer, drafter: Drafter | None = None, acceptor: str | None = None,
                 typical_epsilon: float = 0.09, typical_alpha: float = 0.3, adaptive: bool = True):
        self.batch = BatchGenerator(model, tokenizer, drafter, acceptor=acceptor, typical_epsilon=typical_epsilon,
                                    typical_alpha=typical_alpha)
        b = self.batch
        self.model, self.tokenizer, self.drafter, self.acceptor = b.model, b.tokenizer, b.drafter, b.acceptor
        self.typical, self.eos = b.typical, b.eos
        self.adaptive = adaptive
        self._rule: AdaptiveDraft | None = None

    def draft_rule(self, temperature: float = 0.0) -> AdaptiveDraft | None:
        """The adaptive rule this generator's single-sequence engines draft under at ``temperature`` (see the
        class docstring), or None: sampling, typical acceptance, and drafters with a forward of their own
        keep the drafter's own length and stop."""
        d = self.drafter
        if (not self.adaptive or d is None or not d.cheap or d.max_nodes < 1 or temperature > 0
                or self.model.device.type != "cpu" or self.acceptor not in (None, "greedy")):
            return None
        if self._rule is None:
            sizes = tuple(n for n in SIZES if n <= d.max_nodes + 1)
            self._rule = AdaptiveDraft(measure_verify_cost(self.model, sizes=sizes), d.max_nodes, cheap=True)
        return self._rule

    def encode(self, prompt, chat: bool = True) -> list[int]:
        """A string or a list of {"role", "content"} messages -> prompt token ids (chat template applied
        when the tokenizer has one)."""
        return encode_prompt(self.tokenizer, prompt, chat)

    @torch.inference_mode()
    def generate(self, prompt=None, *, input_ids: list[int] | None = None, max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop: list[str] | None = None, streamer=None, chat: bool = True) -> GenerationResult:
        """Decode one prompt (a string, a message list, or ``input_ids``). ``streamer`` (transformers'
        streamer interface: put / end) gets the prompt, then each step's kept tokens as they come."""
        if max_new_tokens <= 0:  # before encoding: the cheaper complaint first
            raise HydraspecError(f"max_new_tokens must be positive, got {max_new_tokens}")
        check_sampling(temperature, top_p, top_k)
        ids = list(input_ids) if input_ids is not None else self.encode(prompt, chat=chat)
        check_length(self.model, len(ids), max_new_tokens)
        engine = self.batch.engine(1, len(ids) + max_new_tokens + self.batch.max_nodes + 1,
                                   draft_cap=self.draft_rule(temperature))
        hook = None
        if streamer is not None:
            streamer.put(torch.tensor([ids]))
            hook = lambda req, tokens: streamer.put(torch.tensor(tokens))  # noqa: E731
        req = Request(ids, max_new_tokens, Sampling(temperature, top_k, top_p), seed,
                      [s for s in (stop or []) if s], on_tokens=hook)
        engine.add(req)
        while engine.busy:
            engine.step()
        if streamer is not None:
            streamer.end()
        return req.result

    def generate_batch(self, prompts=None, *, trees: dict | None = None, verify_budget: int | None = None, **kwargs):
        """Decode a list of prompts together (one verify forward per step for the whole batch); see
        hydraspec.batch.BatchGenerator.generate for the arguments. Returns a BatchResult (results in
        input order)."""
        bg = self.batch
        if trees or verify_budget is not None:
            bg = BatchGenerator(self.model, self.tokenizer, self.drafter, acceptor=self.acceptor, trees=trees,
                                verify_budget=verify_budget, typical_epsilon=self.typical["epsilon"],
                                typical_alpha=self.typical["alpha"])
        return bg.generate(prompts, **kwargs)
