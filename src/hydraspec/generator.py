"""Speculative decoding of one prompt: a batch of one (hydraspec.batch), with a streamer."""
from __future__ import annotations

import torch

from .batch import BatchGenerator
from .drafters.base import Drafter
from .errors import HydraspecError
from .inputs import encode_prompt
from .policy import DraftPolicy
from .results import GenerationResult

__all__ = ["SpeculativeGenerator"]


class SpeculativeGenerator:
    """Lossless speculative decoding for a stock Hugging Face causal LM.

    drafter: a Drafter (None = plain autoregressive decoding through the same engine).
    acceptor: "greedy", "lossless" or "typical"; None picks greedy at temperature 0 and lossless
    speculative sampling otherwise. Only "typical" changes the output distribution.

    Greedy decoding with a drafter whose proposals cost nothing (prompt lookup) proposes under
    hydraspec.adaptive's rule on the CPU: the target's verify cost is measured once per model and machine
    and each proposal is cut to what the sequence's acceptance rate pays for. Cutting drafts never changes a
    greedy output. ``adaptive=False`` verifies every proposal whole (the same drafts on every run, e.g. to
    compare acceptance step by step).
    """

    def __init__(self, model, tokenizer, drafter: Drafter | None = None, acceptor: str | None = None,
                 typical_epsilon: float = 0.09, typical_alpha: float = 0.3, adaptive: bool = True):
        self.batch = BatchGenerator(model, tokenizer, drafter, acceptor=acceptor, typical_epsilon=typical_epsilon,
                                    typical_alpha=typical_alpha, adaptive=adaptive)
        b = self.batch
        self.model, self.tokenizer, self.drafter, self.acceptor = b.model, b.tokenizer, b.drafter, b.acceptor
        self.typical, self.eos = b.typical, b.eos

    def draft_rule(self, temperature: float = 0.0) -> DraftPolicy:
        """The draft policy one prompt decodes under at ``temperature`` (hydraspec.adaptive.make_policy)."""
        return self.batch.policy(temperature)

    def encode(self, prompt, chat: bool = True) -> list[int]:
        """A string or a list of {"role", "content"} messages -> prompt token ids (chat template applied
        when the tokenizer has one)."""
        return encode_prompt(self.tokenizer, prompt, chat)

    @torch.inference_mode()
    def generate(self, prompt=None, *, input_ids: list[int] | None = None, max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop: list[str] | None = None, streamer=None, chat: bool = True,
                 prediction: list[int] | None = None) -> GenerationResult:
        """Decode one prompt (a string, a message list, or ``input_ids``). ``streamer`` (transformers'
        streamer interface: put / end) gets the prompt, then each step's kept tokens as they come.
        ``prediction``: token ids the answer is expected to mostly repeat (a draft source of the auto method)."""
        if max_new_tokens <= 0:  # before encoding: the cheaper complaint first
            raise HydraspecError(f"max_new_tokens must be positive, got {max_new_tokens}")
        ids = list(input_ids) if input_ids is not None else self.encode(prompt, chat=chat)
        hook = None
        if streamer is not None:
            streamer.put(torch.tensor([ids]))
            hook = lambda i, tokens: streamer.put(torch.tensor(tokens))  # noqa: E731
        res = self.batch.generate(input_ids=[ids], max_new_tokens=max_new_tokens, temperature=temperature,
                                  top_p=top_p, top_k=top_k, seed=seed, stop=stop, on_tokens=hook,
                                  predictions=[prediction] if prediction else None)
        if streamer is not None:
            streamer.end()
        return res[0]

    def generate_batch(self, prompts=None, *, trees: dict | None = None, verify_budget: int | None = None, **kwargs):
        """Decode a list of prompts together (one verify forward per step for the whole batch); see
        hydraspec.batch.BatchGenerator.generate for the arguments. Returns a BatchResult (results in
        input order)."""
        bg = self.batch
        if trees or verify_budget is not None:
            bg = BatchGenerator(self.model, self.tokenizer, self.drafter, acceptor=self.acceptor, trees=trees,
                                verify_budget=verify_budget, typical_epsilon=self.typical["epsilon"],
                                typical_alpha=self.typical["alpha"], adaptive=self.batch.adaptive)
        return bg.generate(prompts, **kwargs)
