"""Model families against transformers' own greedy generate, on prompts longer than their sliding windows:
sliding-window layers (Mistral, Phi-3: every layer; Qwen2, Qwen3, Gemma 2, Gemma 3: some), Gemma 2's
soft-capped attention and logits, Qwen3's and Gemma 3's q/k norms. Every method, and rows decoded together,
must give transformers' tokens: a tree mask that forgot the window would not."""
from __future__ import annotations

import functools

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import tiny
from hydraspec import SpeculativeGenerator, make_drafter
from hydraspec.batch import BatchGenerator

WINDOW = 6
N = 20
SHAPE = dict(vocab_size=tiny.VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None, tie_word_embeddings=False)
FAMILIES = {  # name -> (config, model class, attention implementation)
    "mistral": (lambda: MistralConfig(**SHAPE, sliding_window=WINDOW), MistralForCausalLM, "sdpa"),
    "phi3": (lambda: Phi3Config(**SHAPE, sliding_window=WINDOW), Phi3ForCausalLM, "sdpa"),
    "qwen2": (lambda: Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
              Qwen2ForCausalLM, "sdpa"),
    "qwen3": (lambda: Qwen3Config(**SHAPE, head_dim=12, use_sliding_window=True, sliding_window=WINDOW,
                                  max_window_layers=1), Qwen3ForCausalLM, "sdpa"),
    "gemma2": (lambda: Gemma2Config(**SHAPE, head_dim=12, query_pre_attn_scalar=12, sliding_window=WINDOW,
                                    attn_logit_softcapping=20.0, final_logit_softcapping=10.0),
               Gemma2ForCausalLM, "eager"),
    "gemma3": (lambda: Gemma3TextConfig(**SHAPE, head_dim=12, query_pre_attn_scalar=12, sliding_window=WINDOW,
                                        layer_types=["sliding_attention", "full_attention"]),
               Gemma3ForCausalLM, "sdpa"),
}
PROMPTS = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], list(range(3, 3 + 3 * WINDOW)), [5] * 3]


@functools.lru_cache(maxsize=None)
def family(name: str):
    config_fn, cls, attn = FAMILIES[name]
    cfg = config_fn()
    cfg._attn_implementation = attn
    torch.manual_seed(11)
    model = cls(cfg).float().eval()
    tiny.set_eos(model, None)
    return model, tiny.noisy_copy(model, 0.1, seed=12)


def drafters(model, draft):
    return {"ar": make_drafter("ar"), "pld": make_drafter("pld", num_tokens=5, min_ngram=1),
            "draft-chain": make_drafter("draft", draft, k=4, dynamic=False, confidence=0.0),
            "draft-tree": make_drafter("draft", draft, widths=[3, 2, 1])}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_method_gives_transformers_greedy_tokens_past_the_window(name, tok):
    model, draft = family(name)
    for prompt in PROMPTS:
        want = tiny.hf_greedy(model, prompt, N)
        for method, drafter in drafters(model, draft).items():
            got = SpeculativeGenerator(model, tok, drafter).generate(input_ids=prompt, max_new_tokens=N).token_ids
            assert got == want, f"{name} {method} diverges from transformers on {prompt}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_rows_of_different_lengths_together_give_transformers_greedy_tokens(name, tok):
    model, draft = family(name)
    want = [tiny.hf_greedy(model, p, N) for p in PROMPTS]
    for method in ("ar", "draft-tree"):
        bg = BatchGenerator(model, tok, drafters(model, draft)[method])
        got = bg.generate(input_ids=PROMPTS, max_new_tokens=N, chat=False).results
        assert [r.token_ids for r in got] == want, f"{name} {method}"
