"""Prepacked Linear kernels: same numbers as nn.Linear, and decoding stays exact."""
import copy

import pytest
import torch
from torch import nn

import tiny
from hydraspec import SpeculativeGenerator, make_drafter
from hydraspec.kernels import PackedLinear, available, prepack

pytestmark = pytest.mark.skipif(not available(), reason="oneDNN not available")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_packed_linear_matches_linear(dtype, tol):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=True).to(dtype)
    packed = PackedLinear(lin)
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 7, 16):
            x = torch.randn(1, rows, 64, dtype=dtype)
            torch.testing.assert_close(packed(x).float(), lin(x).float(), atol=tol, rtol=tol)


def test_prepacked_model_decodes_exactly(tok):
    model = copy.deepcopy(tiny.cached_model("llama", "sdpa", 1))
    ref = tiny.hf_greedy(model, [4, 8, 15, 16, 23, 42], 16)
    assert prepack(model) == 2 * 7 + 1  # 7 projections per layer + lm_head
    assert isinstance(model.lm_head, PackedLinear)
    for drafter in (make_drafter("ar"), make_drafter("pld"), make_drafter("draft", draft_model=model, widths=[2, 1])):
        res = SpeculativeGenerator(model, tok, drafter).generate(input_ids=[4, 8, 15, 16, 23, 42], max_new_tokens=16)
        assert res.token_ids == ref
