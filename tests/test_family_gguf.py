"""Model families as GGUF files: a random model of each family that transformers loads from GGUF, written by
gguf-py's writer under transformers' own tensor names, at several types (Q8_0, Q4_0, F16 in turn).

- The loader holds each weight at the file's precision, and its dequantization equals the tensor that
  transformers' own GGUF loader makes (llama's permuted q/k rows, Gemma's norms stored plus one).
- Plain decoding of those weights through the engine equals transformers' greedy generate, on prompts longer
  than the sliding window (what `--quant none` runs).
- At the file's precision every method, and rows of different lengths decoded together, equal our plain
  decoding at that precision (what every method runs by default).
"""
from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map, load_gguf_checkpoint

import tiny
from hydraspec import SpeculativeGenerator, make_drafter
from hydraspec.batch import BatchGenerator
from hydraspec.cpu.gguf import GGUFLinear
from hydraspec.cpu.gguf_load import build_model

WINDOW = 6
N = 16
TYPES = ["Q8_0", "Q4_0", "F16"]
# every matmul's input a whole number of 32-blocks: hidden 64, head_dim 16
SHAPE = dict(vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None, tie_word_embeddings=False)
TIED = {**SHAPE, "tie_word_embeddings": True}  # Gemma files have no output tensor of their own
FAMILIES = {  # name -> (GGUF architecture, config, model class, attention implementation)
    "llama": ("llama", lambda: LlamaConfig(**SHAPE), LlamaForCausalLM, "sdpa"),
    "phi3": ("phi3", lambda: Phi3Config(**SHAPE, sliding_window=WINDOW), Phi3ForCausalLM, "sdpa"),
    "qwen2": ("qwen2", lambda: Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=WINDOW,
                                           max_window_layers=1), Qwen2ForCausalLM, "sdpa"),
    "qwen3": ("qwen3", lambda: Qwen3Config(**SHAPE, head_dim=16, use_sliding_window=True, sliding_window=WINDOW,
                                           max_window_layers=1), Qwen3ForCausalLM, "sdpa"),
    "gemma2": ("gemma2", lambda: Gemma2Config(**TIED, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                                              attn_logit_softcapping=20.0, final_logit_softcapping=10.0),
               Gemma2ForCausalLM, "eager"),
    "gemma3": ("gemma3", lambda: Gemma3TextConfig(**TIED, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                                                  layer_types=["sliding_attention", "full_attention"]),
               Gemma3ForCausalLM, "sdpa"),
}
PROMPTS = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], list(range(3, 3 + 3 * WINDOW)), [5] * 3]


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of a llama q/k weight (transformers' LlamaTensorProcessor undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def as_stored(arch: str, name: str, w: np.ndarray, cfg) -> np.ndarray:
    """A weight as llama.cpp's converter stores it."""
    if arch == "llama" and ".attn_q." in name:
        return permute(w, cfg.num_attention_heads)
    if arch == "llama" and ".attn_k." in name:
        return permute(w, cfg.num_key_value_heads)
    if arch.startswith("gemma") and "norm.weight" in name:
        return w + 1
    return w


def write_gguf(model, arch: str, path) -> None:
    """``model``'s weights as a GGUF file: matrices in TYPES in turn (whole 32-blocks only), the rest float32."""
    cfg = model.config
    state = model.state_dict()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    mapping = get_gguf_hf_weights_map(model, TensorProcessor())  # GGUF name -> transformers name
    for i, (name, hf) in enumerate(sorted(mapping.items())):
        t = as_stored(arch, name, state[hf].float().numpy(), cfg)
        kind = TYPES[i % len(TYPES)]
        if t.ndim == 2 and t.shape[1] % 32 == 0 and kind != "F16":
            qt = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, gguf.quants.quantize(t, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, t.astype(np.float16 if t.ndim == 2 and kind == "F16" else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@functools.lru_cache(maxsize=None)
def family(name: str, directory: str):
    """(transformers' model with the file's weights, ours at the file's precision, the file) for a family."""
    arch, config_fn, cls, attn = FAMILIES[name]
    cfg = config_fn()
    cfg._attn_implementation = attn
    torch.manual_seed(21)
    path = f"{directory}/{name}.gguf"
    write_gguf(cls(cfg).float().eval(), arch, path)
    ref = cls(cfg).float().eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=ref)["tensors"]
    missing, _ = ref.load_state_dict({k: torch.as_tensor(v).float() for k, v in tensors.items()}, strict=False)
    assert not [k for k in missing if "rotary" not in k and not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    tiny.set_eos(ref, None)
    ours = build_model(path, cfg, torch.float32, attn, progress=False)
    tiny.set_eos(ours, None)
    return ref, ours, tensors


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return str(tmp_path_factory.mktemp("family-gguf"))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_loader_reads_each_family_as_transformers_does(name, directory):
    ref, ours, tensors = family(name, directory)
    bits = set()
    for mod_name, mod in ours.named_modules():
        if isinstance(mod, GGUFLinear):
            want = torch.as_tensor(tensors[f"{mod_name.removesuffix('.table')}.weight"]).float()
            assert torch.equal(mod.dequantized(), want), f"{name} {mod_name}"
            bits.add(mod.bits)
    assert bits == {4, 8}, bits  # Q4_0 and Q8_0 held at their precision (F16 tensors load as float)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_plain_decoding_of_the_files_weights_gives_transformers_tokens(name, directory, tok):
    ref, _, _ = family(name, directory)
    for prompt in PROMPTS:
        got = SpeculativeGenerator(ref, tok).generate(input_ids=prompt, max_new_tokens=N).token_ids
        assert got == tiny.hf_greedy(ref, prompt, N), f"{name} diverges from transformers on {prompt}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_method_at_the_files_precision_gives_our_plain_tokens(name, directory, tok):
    ref, ours, _ = family(name, directory)
    methods = {"pld": make_drafter("pld", num_tokens=5, min_ngram=1),
               "draft-tree": make_drafter("draft", ref, widths=[3, 2, 1])}
    want = [SpeculativeGenerator(ours, tok).generate(input_ids=p, max_new_tokens=N).token_ids for p in PROMPTS]
    for method, drafter in methods.items():
        for prompt, plain in zip(PROMPTS, want):
            got = SpeculativeGenerator(ours, tok, drafter).generate(input_ids=prompt, max_new_tokens=N).token_ids
            assert got == plain, f"{name} {method} on {prompt}"
    together = BatchGenerator(ours, tok, methods["draft-tree"]).generate(input_ids=PROMPTS, max_new_tokens=N,
                                                                        chat=False).results
    assert [r.token_ids for r in together] == want, name
