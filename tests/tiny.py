"""Tiny random causal LMs and a matching word-level tokenizer, built in-process (no downloads).

Every model is float32, 1-2 layers, hidden 32-64, vocab 64-128, so a forward costs a few milliseconds
on one CPU core. Weights come from a fixed seed, so every test sees the same model every run.
"""
from __future__ import annotations

import copy

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "gemma": (GemmaConfig, GemmaForCausalLM),
}

VOCAB = 96


def make_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: id i <-> the word "w{i}". No special tokens, so no EOS until one is set."""
    words = {f"w{i}": i for i in range(vocab)}
    tk = Tokenizer(WordLevel(words, unk_token="w0"))
    tk.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def make_model(family: str = "llama", *, attn: str = "sdpa", seed: int = 0, vocab: int = VOCAB,
               hidden: int = 48, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               init_range: float = 0.02, max_pos: int = 512):
    """A tiny randomly initialised causal LM of the given family, in eval mode, with no EOS anywhere
    (config, generation config) so generation runs to max_new_tokens unless a test sets one."""
    cfg_cls, model_cls = FAMILIES[family]
    kw = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
        initializer_range=init_range, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        tie_word_embeddings=False,
    )
    if family == "gemma":
        kw["head_dim"] = hidden // heads
    cfg = cfg_cls(**kw)
    if attn == "hydraspec_cpu":
        from hydraspec.cpu.attention import register

        register()
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    set_eos(model, None)
    return model


def set_eos(model, eos: int | None, tokenizer=None) -> None:
    """Put `eos` (or nothing) everywhere hydraspec.inputs.eos_ids and model.generate look."""
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.generation_config.bos_token_id = None
    # generate() wants a pad id when there is an EOS; any id works for batch size 1
    model.generation_config.pad_token_id = eos if eos is not None else 0
    if tokenizer is not None:
        if eos is None:
            tokenizer.eos_token = None
        else:
            tokenizer.eos_token = f"w{eos}"
            assert tokenizer.eos_token_id == eos


@torch.no_grad()
def noisy_copy(model, scale: float, seed: int = 1234):
    """A copy of `model` with N(0, scale * std(w)) noise added to every weight: a draft model that
    agrees with the target often but not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    for p in draft.parameters():
        std = float(p.float().std()) if p.numel() > 1 else 1.0
        p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale * max(std, 1e-3))
    return draft.eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference: transformers' own greedy decoding, new tokens only."""
    x = torch.tensor([prompt])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                         min_new_tokens=0, num_beams=1, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of a plain cache-free forward over `ids`."""
    x = torch.tensor([ids])
    return model(input_ids=x, use_cache=False).logits[0].float()


_MODELS: dict = {}


def cached_model(family: str = "llama", attn: str = "sdpa", seed: int = 0, **kw):
    """make_model, built once per process (tests must leave it as they found it, EOS included)."""
    key = (family, attn, seed, tuple(sorted(kw.items())))
    if key not in _MODELS:
        _MODELS[key] = make_model(family, attn=attn, seed=seed, **kw)
    return _MODELS[key]


def cached_models() -> list:
    return list(_MODELS.values())


def noisy_heads(model, kind: str = "eagle", **kw):
    """Heads of ``kind`` on ``model`` with larger weights than the default init: guesses that differ from row
    to row (from torch's global generator)."""
    from hydraspec.heads import build_heads

    heads = build_heads(kind, model, num_heads=4, **kw)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return heads.eval()


def eagle_drafter(model, auto: bool = False):
    """An EAGLE head on ``model`` with weights large enough to guess differently from row to row: drafting
    a small tree alone, or (``auto``) following every step inside ``auto`` on a fixed verify-cost curve."""
    from hydraspec.drafters import auto_heads, make_auto, make_drafter

    torch.manual_seed(0)
    heads, embed = noisy_heads(model), model.get_input_embeddings()
    if auto:
        return make_auto(model, auto_heads(heads, {}, embed), cost={1: 1.0, 2: 1.05, 4: 1.2, 8: 1.6})
    return make_drafter("eagle", heads=heads, embed=embed, tree=[[0], [1], [0, 0]])
