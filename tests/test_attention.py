"""hydraspec.cpu.attention.cpu_attention against transformers' sdpa attention on random inputs."""
from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hydraspec.cpu import kernels
from hydraspec.cpu.attention import MAX_QUERIES, cpu_attention


@pytest.fixture(autouse=True)
def inference():
    """Every call as in decoding, without gradients: with them a call goes to sdpa (the training test turns
    them on)."""
    with torch.no_grad():
        yield


def module(groups: int):
    return types.SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)


def inputs(b, h, hkv, n, L, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, L, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, L, d, generator=g).to(dtype)
    return q, k, v


def tree_bool_mask(b, n, L, seed=0, heads=1):
    """Each query sees a random prefix part plus itself; a few random extra positions hidden."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(b, heads, n, L, generator=g) > 0.3
    for i in range(n):
        m[:, :, i, L - n + i] = True  # itself, so no row is empty
    return m


@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2), (8, 1), (12, 2)])
@pytest.mark.parametrize("n", [1, 3, 17])
def test_matches_sdpa_with_masks(h, hkv, n):
    L = 40
    q, k, v = inputs(2, h, hkv, n, L, seed=h * 100 + n)
    mod = module(h // hkv)
    bool_mask = tree_bool_mask(2, n, L, seed=n)
    add_mask = torch.zeros(bool_mask.shape).masked_fill_(~bool_mask, torch.finfo(torch.float32).min)
    head_mask = tree_bool_mask(2, n, L, seed=n + 1, heads=h)
    for mask in (bool_mask, add_mask, head_mask):
        ref, _ = sdpa_attention_forward(mod, q, k, v, mask, scaling=0.25)
        out, _ = cpu_attention(mod, q, k, v, mask, scaling=0.25)
        assert out.shape == (2, n, h, 16)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_single_query_without_mask_sees_everything():
    q, k, v = inputs(1, 6, 2, 1, 300)
    ref, _ = sdpa_attention_forward(module(3), q, k, v, None)
    out, _ = cpu_attention(module(3), q, k, v, None)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # and it is really attention: changing one value row far back changes the output
    v2 = v.clone()
    v2[0, 0, 3] += 10
    out2, _ = cpu_attention(module(3), q, k, v2, None)
    assert not torch.allclose(out, out2)


def test_bf16_close_to_sdpa():
    q, k, v = inputs(1, 12, 2, 9, 120, d=64, dtype=torch.bfloat16)
    mask = tree_bool_mask(1, 9, 120)
    ref, _ = sdpa_attention_forward(module(6), q.float(), k.float(), v.float(), mask)
    out, _ = cpu_attention(module(6), q, k, v, mask)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_fully_masked_row_gives_zeros_not_nan():
    q, k, v = inputs(2, 4, 2, 3, 10)
    mask = torch.ones(2, 1, 3, 10, dtype=torch.bool)
    mask[1, 0, 2] = False  # a padding query of row 1
    out, _ = cpu_attention(module(2), q, k, v, mask)
    assert torch.isfinite(out).all()
    assert (out[1, 2] == 0).all()


def test_causal_prefill_without_a_mask(monkeypatch):
    """A maskless call of several queries over as many keys is a causal prefill (sdpa's is_causal): the native
    kernel computes it where it is built, equal to sdpa and causal, and the last queries read as a second chunk
    (with the mask transformers gives a chunk, also past MAX_QUERIES) get what the whole prefill gives them;
    past PREFILL_PAIRS it is sdpa's."""
    import hydraspec.cpu.attention as att

    for n in (5, MAX_QUERIES + 1, 150):
        q, k, v = inputs(1, 4, 2, n, n, seed=n)
        ref, _ = sdpa_attention_forward(module(2), q, k, v, None)
        out, _ = cpu_attention(module(2), q, k, v, None)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        v2 = v.clone()
        v2[:, :, 1:] += 5  # causal: the first query ignores every later key
        out2, _ = cpu_attention(module(2), q, k, v2, None)
        assert torch.equal(out2[:, 0], out[:, 0])
        if kernels.fused_lib() is not None:
            m = min(n // 3 + 1, MAX_QUERIES)
            tail, _ = cpu_attention(module(2), q[:, :, n - m:], k, v, att.causal_rows(n, n)[:, :, n - m:])
            torch.testing.assert_close(tail, out[:, n - m:], atol=3e-7, rtol=1e-6)
    calls, real = [], att._native
    monkeypatch.setattr(att, "_native", lambda *a: calls.append(a[3]) or real(*a))
    cpu_attention(module(2), *inputs(1, 4, 2, 100, 100), None)
    assert len(calls) == 1 and torch.equal(calls[0][0, 0], torch.ones(100, 100, dtype=torch.bool).tril())
    calls.clear()
    q, k, v = inputs(1, 4, 2, 100, 160, seed=3)  # a prompt's second chunk, with its mask: the kernel's too
    mask = att.causal_rows(160, 160)[:, :, 60:]
    out, _ = cpu_attention(module(2), q, k, v, mask)
    assert len(calls) == 1
    torch.testing.assert_close(out, sdpa_attention_forward(module(2), q, k, v, mask)[0], atol=1e-5, rtol=1e-5)
    calls.clear()
    monkeypatch.setattr(att, "PREFILL_PAIRS", 100)
    q, k, v = inputs(1, 4, 2, 11, 11)
    out, _ = cpu_attention(module(2), q, k, v, None)  # 121 pairs: sdpa's, the kernel not asked
    torch.testing.assert_close(out, sdpa_attention_forward(module(2), q, k, v, None)[0])
    assert calls == []


def test_training_with_gradients_goes_to_sdpa():
    # the in-place fast path must not run where autograd needs its inputs (a trainable prefix layer)
    q, k, v = inputs(1, 4, 2, 3, 10)
    q.requires_grad_(True)
    mask = tree_bool_mask(1, 3, 10)
    with torch.enable_grad():
        out, _ = cpu_attention(module(2), q, k, v, mask)
        out.sum().backward()
        ref_q = q.detach().clone().requires_grad_(True)
        ref, _ = sdpa_attention_forward(module(2), ref_q, k, v, mask)
        ref.sum().backward()
    torch.testing.assert_close(q.grad, ref_q.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_rows_equal_their_visible_keys_alone(dtype):
    # the padded layout of a batch: row b sees its cache [0, len_b), a gap it never sees, then its own tree
    # nodes; padding query slots see nothing. Each real query's output must equal, bit for bit, the same
    # query attending to just its visible keys (the kernel skips the rest), and padding slots give zeros.
    if kernels.fused_lib() is None:
        pytest.skip("the native attention kernel is not built")
    lengths, sizes, W, h, hkv = [5, 37, 70, 2], [3, 1, 4, 1], 70, 6, 2
    N = max(sizes)
    q, k, v = inputs(len(lengths), h, hkv, N, W + N, d=32, dtype=dtype, seed=7)
    allowed = torch.zeros(len(lengths), N, W + N, dtype=torch.bool)
    for b, (n_b, l_b) in enumerate(zip(sizes, lengths)):
        allowed[b, :n_b, :l_b] = True
        allowed[b, :n_b, W:W + n_b] = torch.tril(torch.ones(n_b, n_b, dtype=torch.bool))
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
    with torch.no_grad():  # as in decoding (with gradients the call goes to sdpa)
        out, _ = cpu_attention(module(h // hkv), q, k, v, mask)
    for b, (n_b, l_b) in enumerate(zip(sizes, lengths)):
        assert (out[b, n_b:] == 0).all()
        for i in range(n_b):
            keys = allowed[b, i].nonzero().squeeze(1)
            with torch.no_grad():
                alone, _ = cpu_attention(module(h // hkv), q[b:b + 1, :, i:i + 1], k[b:b + 1, :, keys],
                                         v[b:b + 1, :, keys], None)
            assert torch.equal(out[b, i], alone[0, 0])


@pytest.mark.parametrize("n", [1, 2, 5])
def test_head_sizes_that_are_not_a_multiple_of_16(n):
    """Head sizes of 8 and 24 (the kernel takes values 8 dimensions at a time), with the query blocks of 8 and
    of 4 rows that 6 query heads a kv head make (n = 1: one of 6 rows; 2: 12 = 8 + 4; 5: 30 = 8 + 8 + 8 + 6)."""
    for d in (8, 24):
        q, k, v = inputs(1, 12, 2, n, 70, d=d, seed=d + n)
        mask = tree_bool_mask(1, n, 70, seed=n)
        ref, _ = sdpa_attention_forward(module(6), q, k, v, mask, scaling=0.3)
        out, _ = cpu_attention(module(6), q, k, v, mask, scaling=0.3)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
