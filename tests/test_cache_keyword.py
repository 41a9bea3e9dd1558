"""The KV cache reaches transformers under the keyword its forwards take (hydraspec.cache.cache_kwargs):
``cache`` from transformers 5.24 on, ``past_key_values`` before it. hydraspec's own forwards (prefill,
verify, the tree and verify-cost timings, the EAGLE and Hydra++ layers, the compiled steps' call) raise no
FutureWarning."""
from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import tiny
from hydraspec.cache import allocate_rows, cache_kwargs, new_cache, prefill_rows, set_length, use_rows
from hydraspec.heads import build_heads
from hydraspec.tree import shape_of
from hydraspec.verify import forward_nodes, verify_rows


class _Old(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=None):
        return past_key_values


class _New(torch.nn.Module):
    def forward(self, input_ids, cache=None, use_cache=None):
        return cache


def test_cache_keyword_follows_the_forward_signature():
    assert cache_kwargs(_Old(), 1) == {"past_key_values": 1}
    assert cache_kwargs(_New(), 2) == {"cache": 2} == cache_kwargs(_New, 2)
    wrapped = _New()
    wrapped.forward = lambda **kw: None  # an instance's own forward (a compiled step's wrapper) is not read
    assert cache_kwargs(wrapped, 3) == {"cache": 3}
    model = tiny.cached_model("llama", "sdpa", 0)
    takes = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    assert cache_kwargs(model, None) == {takes: None}
    # the key is what the model really reads: a forward after a prefill sees the cached prefix
    cache = new_cache(model, 16)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 9, 2]]), **cache_kwargs(model, cache), use_cache=True)
        assert cache.get_seq_length() == 3
        last = model(input_ids=torch.tensor([[7]]), **cache_kwargs(model, cache), use_cache=True).logits[0, -1]
        assert torch.allclose(last, tiny.full_logits(model, [5, 9, 2, 7])[-1], atol=1e-5)


@pytest.fixture
def no_future_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        yield


@pytest.mark.parametrize("attn", ["sdpa", "hydraspec_cpu"])
def test_hydraspec_forwards_raise_no_future_warning(attn, no_future_warning):
    from hydraspec.trees.measure import time_batch_verify

    model = tiny.cached_model("llama", attn, 0)
    with torch.inference_mode():
        cache = new_cache(model, 64)
        allocate_rows(cache, model, 2)
        hidden = prefill_rows(model, cache, 0, [[5, 9, 2, 7], [3, 4]], need_hidden=True)
        assert [h.shape[0] for h in hidden] == [4, 2]
        use_rows(cache, 0, 2)
        chain = shape_of((-1, 0, 1))
        for packed in (True, False):
            logits, _, first = verify_rows(model, cache, [[1, 2, 3], [6, 8, 9]], [chain, chain], [4, 2],
                                           want_hidden=True, packed=packed)
            assert logits.shape[-1] == tiny.VOCAB and len(first) == 2
        one = new_cache(model, 32)
        forward_nodes(model, one, torch.tensor([5, 9, 2]), torch.arange(3), None, 0)
        logits, hid = forward_nodes(model, one, torch.tensor([7, 1]), torch.tensor([3, 4]), chain.ancestors[:2, :2],
                                    3, want_hidden=True)
        assert logits.shape == (2, tiny.VOCAB) and hid.shape[0] == 2
        set_length(one, 0)
    assert set(time_batch_verify(model, [[0], [0, 0]], [5, 9, 2, 7, 1, 3], 4, [1, 2], 2, reps=1)) == {1, 2}


def test_verify_cost_measurement_raises_no_future_warning(no_future_warning, tmp_path, monkeypatch):
    from hydraspec.verify_cost import measure_verify_cost

    monkeypatch.setenv("HYDRASPEC_HOME", str(tmp_path))  # its timings are kept in the home: not the user's
    cost = measure_verify_cost(tiny.make_model("llama", seed=11), sizes=(1, 2), prefix=8, repeats=1)
    assert sorted(cost) == [1, 2]


def test_head_layers_raise_no_future_warning(no_future_warning):
    from transformers import DynamicCache

    model = tiny.cached_model("llama", "sdpa", 0)
    feats = torch.randn(4, model.config.hidden_size)
    with torch.no_grad():
        eagle = build_heads("eagle", model, num_heads=2).eval()
        emb = model.get_input_embeddings()(torch.tensor([5, 9, 2, 7]))
        cache = DynamicCache()
        eagle.step(feats[:3], emb[:3], torch.arange(3), cache=cache)
        eagle.step(feats[3:], emb[3:], torch.arange(3, 4), cache=cache)
        assert cache.get_seq_length() == 4
        hydra = build_heads("hydra", model, num_heads=2, prefix_layer=True).eval()
        prefix_cache = DynamicCache()
        hydra.prefix(feats[:3], 0, prefix_cache)
        hydra.prefix(feats[3:], 3, prefix_cache)
        assert prefix_cache.get_seq_length() == 4
        hydra.prefix(feats, 0, None)


def test_the_compiled_steps_call_passes_the_cache_by_its_keyword(no_future_warning):
    """cpu.graph's call of a compiled forward (run here eagerly) hands the cache over under the model's keyword
    and builds its output with it."""
    from hydraspec.cpu import graph

    model = tiny.cached_model("llama", "sdpa", 0)

    def with_hidden(**kw):
        out = model(**kw, output_hidden_states=True, logits_to_keep=0)
        return out.logits, out.hidden_states[-1]

    with torch.no_grad():
        cache = new_cache(model, 16)
        model(input_ids=torch.tensor([[5, 9, 2]]), **cache_kwargs(model, cache), use_cache=True)
        out = graph._run((model, with_hidden), 3, cache_kwargs(model, cache), input_ids=torch.tensor([[7]]),
                         attention_mask=torch.zeros(1, 1, 1, 4), output_hidden_states=True)
    assert cache.get_seq_length() == 4 and out.hidden_states[0].shape[1] == 1
    assert torch.allclose(out.logits[0, -1], tiny.full_logits(model, [5, 9, 2, 7])[-1], atol=1e-5)
