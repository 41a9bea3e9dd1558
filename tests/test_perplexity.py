"""`hydraspec perplexity`: llama.cpp's chunking and scoring, and the figure on a tiny model against a direct
computation of the same negative log-likelihoods."""
import math

import pytest
import torch

import tiny
from hydraspec import HydraspecError
from hydraspec.bench.perplexity import FINAL, chunk_tokens, perplexity, score


def test_chunks_drop_the_tail_and_take_bos():
    ids = list(range(10, 31))  # 21 tokens
    assert chunk_tokens(ids, 8, None, None) == [ids[:8], ids[8:16]]
    c = chunk_tokens(ids, 8, 1, 1)
    assert c == [[1] + ids[1:8]]
    with pytest.raises(HydraspecError, match="at least 32"):
        chunk_tokens(ids, 16, None, None)


def test_score_is_exp_mean_with_llamacpp_standard_error():
    nll = [0.5, 1.0, 1.5, 2.0]
    p = score(nll, 1)
    assert p.ppl == pytest.approx(math.exp(1.25))
    var = sum(x * x for x in nll) / 4 - 1.25 ** 2
    assert p.stderr == pytest.approx(math.sqrt(var / 3) * math.exp(1.25))
    m = FINAL.search("llama_perplexity: Final estimate: PPL = 2.9289 +/- 0.13139")
    assert m and float(m.group(1)) == 2.9289


def test_tiny_model_perplexity_scores_the_second_half_of_each_chunk(tok):
    model = tiny.cached_model()
    text = " ".join(f"w{i % 7}" for i in range(60))
    ids = tok(text, add_special_tokens=False).input_ids
    ctx = 16
    got = perplexity(model, tok, text, ctx=ctx, progress=False)
    nll = []
    for k in range(len(ids) // ctx):
        chunk = ids[k * ctx:(k + 1) * ctx]
        lp = torch.log_softmax(tiny.full_logits(model, chunk).float(), -1)
        nll += [-lp[j, chunk[j + 1]].item() for j in range(ctx // 2, ctx - 1)]
    assert got.tokens_scored == len(nll) == (len(ids) // ctx) * (ctx - 1 - ctx // 2)
    assert got.ppl == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-4)
