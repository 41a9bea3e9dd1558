"""Batched speculative decoding on tiny random models: every row of a batch must produce exactly what
that prompt produces alone (and what transformers' greedy generate produces), whatever the other rows'
lengths, drafts and stopping times; sampling stays lossless; oversized batches are refused up front."""
from __future__ import annotations

import contextlib
import functools
import json

import pytest
import torch

import tiny
from hydraspec import HydraspecError, SpeculativeGenerator, make_drafter
from hydraspec.batch import BatchGenerator
from hydraspec.inputs import read_prompt_lines
from hydraspec.memory import cache_bytes
from hydraspec.heads import build_heads

SEED = 1
N_NEW = 16


@functools.lru_cache(maxsize=None)
def draft_model():
    return tiny.noisy_copy(tiny.cached_model("llama", "sdpa", SEED), 0.1, seed=101)


@functools.lru_cache(maxsize=None)
def heads(kind):
    torch.manual_seed(11)
    if kind == "hydra++":  # prefix layer (a cache per row) and a draft vocabulary (index -> token id mapping)
        h = build_heads("hydra", tiny.cached_model("llama", "sdpa", SEED), num_heads=3, prefix_layer=True,
                        vocab_subset=list(range(0, tiny.VOCAB, 2)))
    else:
        h = build_heads(kind, tiny.cached_model("llama", "sdpa", SEED), num_heads=3)
    with torch.no_grad():  # fresh Medusa blocks are the identity; perturb so that heads disagree
        for p in h.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return h


TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]

DRAFTERS = {
    "ar": lambda m: make_drafter("ar"),
    "pld": lambda m: make_drafter("pld", num_tokens=5, min_ngram=1),
    "draft-chain": lambda m: make_drafter("draft", draft_model(), k=3, dynamic=True, max_k=6, confidence=0.0),
    "draft-confident": lambda m: make_drafter("draft", draft_model(), k=4, confidence=0.05),
    "draft-path": lambda m: make_drafter("draft", draft_model(), k=4, confidence=0.2, stop="path"),
    # prompt lookup where it matches, else the draft model (not run on lookup steps; it catches up)
    "pld+draft": lambda m: make_drafter("pld+draft", draft_model(), k=3, confidence=0.0, pld_tokens=5, pld_min_ngram=1),
    "draft-tree": lambda m: make_drafter("draft", draft_model(), widths=[2, 2, 1]),
    "draft-leaves": lambda m: make_drafter("draft", draft_model(), k=3, dynamic=False, confidence=0.0, leaves=2,
                                           leaf_gain=0.0),
    "medusa": lambda m: make_drafter("medusa", heads=heads("medusa"), embed=m.get_input_embeddings(), tree=TREE),
    "hydra": lambda m: make_drafter("hydra", heads=heads("hydra"), embed=m.get_input_embeddings(), tree=TREE),
    "hydra++": lambda m: make_drafter("hydra++", heads=heads("hydra++"), embed=m.get_input_embeddings(), tree=TREE),
    # prompt lookup merged into Hydra++'s tree: each row forks both (the prefix-layer cache, the lookup length)
    "pld+hydra++": lambda m: make_drafter("pld+hydra++", heads=heads("hydra++"), embed=m.get_input_embeddings(),
                                          tree=TREE, pld_tokens=5, pld_min_ngram=1),
}


def ragged_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    long = torch.randint(0, tiny.VOCAB, (57,), generator=g).tolist()
    mid = torch.randint(0, tiny.VOCAB, (9,), generator=g).tolist()
    return [[17], [7, 8, 9, 7, 8, 9, 7, 8, 9, 7], long, mid, [3, 4]]


@contextlib.contextmanager
def eos_set(model, tok, eos):
    tiny.set_eos(model, eos, tok)
    try:
        yield
    finally:
        tiny.set_eos(model, None, tok)


class BatchSizes:
    """Records the batch dimension of every target forward."""

    def __init__(self, model):
        self.sizes, self.shapes, self.verify, self.verify_shapes, self.prefill_shapes = [], [], [], [], []
        self.h = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.sizes.append(int(kwargs["input_ids"].shape[0]))
        self.shapes.append(tuple(kwargs["input_ids"].shape))
        if kwargs.get("logits_to_keep") != 1:  # the batch engine prefills with logits_to_keep=1
            self.verify.append(int(kwargs["input_ids"].shape[0]))
            self.verify_shapes.append(tuple(kwargs["input_ids"].shape))
        else:
            self.prefill_shapes.append(tuple(kwargs["input_ids"].shape))

    def close(self):
        self.h.remove()


def check_row_stats(r, cut_by_eos=False):
    s = r.stats
    assert sum(s.accept_hist) == s.target_forwards
    assert s.new_tokens == len(r.token_ids)
    counted = sum(i * c for i, c in enumerate(s.accept_hist))
    assert counted >= s.new_tokens if cut_by_eos else counted == s.new_tokens


@pytest.mark.parametrize("method", list(DRAFTERS))
def test_greedy_rows_equal_batch_of_one(method, tok):
    model = tiny.cached_model("llama", "sdpa", SEED)
    prompts = ragged_prompts()
    gen = SpeculativeGenerator(model, tok, DRAFTERS[method](model), adaptive=False)  # the drafter's own lengths
    alone_res = [gen.generate(input_ids=p, max_new_tokens=N_NEW) for p in prompts]
    alone = [a.token_ids for a in alone_res]
    for p, a in zip(prompts, alone):
        assert a == tiny.hf_greedy(model, p, N_NEW)
    spy = BatchSizes(model)
    try:
        res = gen.generate_batch(input_ids=prompts, max_new_tokens=N_NEW)
    finally:
        spy.close()
    assert len(res) == len(prompts)
    for i, (r, a) in enumerate(zip(res, alone)):
        assert r.token_ids == a, f"{method}: row {i} (prompt of {len(prompts[i])} tokens) differs from batch 1"
        assert r.prompt_ids == prompts[i] and r.finish_reason == "length"
        check_row_stats(r)
        # the same drafts as alone (drafter state kept per row), so the same acceptance, step by step
        assert r.stats.accept_hist == alone_res[i].stats.accept_hist, (method, i)
    # one exact-length prefill per prompt (none for a one-token prompt), then one forward per step for the
    # whole batch
    assert sorted(spy.prefill_shapes) == sorted((1, len(p) - 1) for p in prompts if len(p) > 1)
    assert spy.verify[0] == len(prompts)
    assert res.target_forwards == len(spy.verify)
    assert res.target_forwards == max(r.stats.target_forwards for r in res)
    if method == "ar":
        assert res.target_forwards == N_NEW
    elif method.startswith("draft"):
        assert res.target_forwards < N_NEW  # drafts were accepted in the batch


@pytest.mark.parametrize("method", ["pld", "draft-chain", "medusa"])
def test_verify_budget_cuts_drafts_not_outputs(method, tok):
    """With a budget of 8 tokens per verify forward over 4 rows, every row drafts at most 1 node, so a
    verify forward holds at most 4 x 2 tokens; outputs stay those of batch 1."""
    model = tiny.cached_model("llama", "sdpa", SEED)
    prompts = ragged_prompts()[:4]
    gen = SpeculativeGenerator(model, tok, DRAFTERS[method](model))
    alone = [gen.generate(input_ids=p, max_new_tokens=N_NEW).token_ids for p in prompts]
    spy = BatchSizes(model)
    try:
        res = gen.generate_batch(input_ids=prompts, max_new_tokens=N_NEW, batch_size=4, verify_budget=8)
    finally:
        spy.close()
    assert [r.token_ids for r in res] == alone
    verify_widths = [shape[1] for shape in spy.verify_shapes]
    assert max(verify_widths) <= 2  # pending token + at most one draft node per row
    for r in res:
        assert len(r.stats.accept_hist) <= 3  # at most 2 tokens per step
    with pytest.raises(HydraspecError, match="verify_budget"):
        gen.generate_batch(input_ids=prompts, max_new_tokens=4, verify_budget=1)


@pytest.mark.parametrize("method", ["pld", "draft-tree", "medusa", "pld+hydra++"])
def test_packed_rows_equal_batch_of_one(method, tok):
    """On the backend's attention the engine verifies every row's tree as one packed sequence (no padding
    nodes); each row still produces what it produces alone, with the same acceptance step by step."""
    model = tiny.cached_model("llama", "hydraspec_cpu", SEED)
    prompts = ragged_prompts()
    gen = SpeculativeGenerator(model, tok, DRAFTERS[method](model), adaptive=False)  # the drafter's own lengths
    alone = [gen.generate(input_ids=p, max_new_tokens=N_NEW) for p in prompts]
    spy = BatchSizes(model)
    try:
        res = gen.generate_batch(input_ids=prompts, max_new_tokens=N_NEW)
    finally:
        spy.close()
    for i, (r, a) in enumerate(zip(res, alone)):
        assert r.token_ids == a.token_ids == tiny.hf_greedy(model, prompts[i], N_NEW), (method, i)
        assert r.stats.accept_hist == a.stats.accept_hist, (method, i)
    # every verify forward of several rows holds their trees as one sequence
    assert spy.verify_shapes[0][0] == 1 and spy.verify_shapes[0][1] >= len(prompts)
    assert all(b == 1 for b, _ in spy.verify_shapes)


@pytest.mark.parametrize("family,attn,seed", [("llama", "eager", 2), ("qwen2", "sdpa", 3), ("mistral", "sdpa", 4),
                                              ("gemma", "sdpa", 5)])
def test_other_families_and_one_token_prompts(family, attn, seed, tok):
    model = tiny.cached_model(family, attn, seed)
    draft = tiny.noisy_copy(model, 0.1, seed=seed + 100)
    for prompts in (ragged_prompts(), [[5], [9], [33]]):  # the second batch has nothing to prefill
        expect = [tiny.hf_greedy(model, p, 12) for p in prompts]
        for d in (None, make_drafter("pld", num_tokens=4, min_ngram=1), make_drafter("draft", draft, widths=[2, 1])):
            res = SpeculativeGenerator(model, tok, d).generate_batch(input_ids=prompts, max_new_tokens=12)
            assert [r.token_ids for r in res] == expect, (family, d)


@pytest.mark.parametrize("method", ["ar", "pld", "draft-tree", "hydra"])
def test_rows_finish_at_different_times(method, tok):
    """Rows stop on EOS at different steps or on the budget; finished rows leave the batch."""
    model = tiny.cached_model("llama", "sdpa", SEED)
    prompts = ragged_prompts()
    free = SpeculativeGenerator(model, tok).generate_batch(input_ids=prompts, max_new_tokens=N_NEW)
    eos = free[2].token_ids[4]  # row 2 meets this token early; others maybe later or never
    with eos_set(model, tok, eos):
        gen = SpeculativeGenerator(model, tok, DRAFTERS[method](model))
        alone = [gen.generate(input_ids=p, max_new_tokens=N_NEW) for p in prompts]
        expect = [tiny.hf_greedy(model, p, N_NEW) for p in prompts]
        expect = [e[: e.index(eos) + 1] if eos in e else e for e in expect]
        spy = BatchSizes(model)
        try:
            res = gen.generate_batch(input_ids=prompts, max_new_tokens=N_NEW, batch_size=3)
        finally:
            spy.close()
    reasons = [r.finish_reason for r in res]
    assert "eos" in reasons and "length" in reasons, reasons
    assert len({len(r.token_ids) for r in res}) > 1
    for i, (r, a, e) in enumerate(zip(res, alone, expect)):
        assert r.token_ids == a.token_ids == e, f"{method}: row {i}"
        assert r.finish_reason == a.finish_reason
        check_row_stats(r, cut_by_eos=True)
    # 3 rows at a time; when a row finishes a waiting prompt is prefilled into its place while the others
    # go on, and every verify forward runs exactly over the rows still decoding: finished rows cost nothing
    assert spy.verify[0] == 3 and max(spy.sizes) == 3 and res.batches >= 2
    assert (1, 1) in spy.shapes  # the 2-token prompt's prefill, admitted mid-run
    assert sum(spy.verify) == sum(r.stats.target_forwards for r in res)
    assert res.target_forwards == len(spy.verify)
    # all five at once: the batch shrinks as rows finish
    spy = BatchSizes(model)
    try:
        with eos_set(model, tok, eos):
            res5 = gen.generate_batch(input_ids=prompts, max_new_tokens=N_NEW)
    finally:
        spy.close()
    assert [r.token_ids for r in res5] == [r.token_ids for r in res]
    assert spy.verify[0] == 5 and spy.verify[-1] < 5 and spy.verify == sorted(spy.verify, reverse=True)
    assert sum(spy.verify) == sum(r.stats.target_forwards for r in res5)


@pytest.mark.parametrize("method", ["ar", "pld", "hydra"])
def test_kept_hidden_states_equal_a_plain_forward(method, tok):
    """keep_hidden: each result carries the last hidden states of prompt + answer but its last token,
    gathered from the prefill and the accepted paths of the tree forwards; they equal one plain forward
    over the finished sequence, also for rows cut by EOS mid-path and rows admitted mid-run."""
    model = tiny.cached_model("llama", "sdpa", SEED)
    prompts = ragged_prompts()
    free = SpeculativeGenerator(model, tok).generate_batch(input_ids=prompts, max_new_tokens=N_NEW)
    eos = free[2].token_ids[4]
    seen = []
    with eos_set(model, tok, eos):
        gen = BatchGenerator(model, tok, DRAFTERS[method](model))
        res = gen.generate(input_ids=prompts, max_new_tokens=N_NEW, batch_size=3, keep_hidden=True,
                           on_result=lambda i, r: seen.append((i, r.token_ids)))
    assert sorted(seen) == sorted(enumerate(r.token_ids for r in res))  # each row reported once, when done
    assert "eos" in [r.finish_reason for r in res]
    for r in res:
        ids = torch.tensor(r.prompt_ids + r.token_ids)
        with torch.no_grad():
            ref = model(input_ids=ids[None], output_hidden_states=True).hidden_states[-1][0, :-1]
        assert r.hidden_states.shape == ref.shape
        torch.testing.assert_close(r.hidden_states, ref, atol=1e-4, rtol=1e-4)
    plain = gen.generate(input_ids=prompts[:2], max_new_tokens=4)
    assert all(r.hidden_states is None for r in plain)


def test_stop_strings_and_input_order(tok):
    model = tiny.cached_model("llama", "sdpa", SEED)
    prompts = ragged_prompts()
    gen = SpeculativeGenerator(model, tok, DRAFTERS["pld"](model))
    free = [gen.generate(input_ids=p, max_new_tokens=N_NEW) for p in prompts]
    stop = tok.decode(free[1].token_ids[3:5])
    alone = [gen.generate(input_ids=p, max_new_tokens=N_NEW, stop=[stop]) for p in prompts]
    res = gen.generate_batch(input_ids=prompts, max_new_tokens=N_NEW, stop=[stop], batch_size=2)
    assert res[1].finish_reason == "stop"
    for r, a in zip(res, alone):
        assert (r.token_ids, r.text, r.finish_reason) == (a.token_ids, a.text, a.finish_reason)


def test_text_prompts_and_tree_per_batch_size(tok):
    model = tiny.cached_model("llama", "sdpa", SEED)
    texts = ["w5 w6 w7", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12", "w40"]
    d = DRAFTERS["hydra"](model)
    small = [[0]]
    ref_big = SpeculativeGenerator(model, tok, d)
    ref_small = SpeculativeGenerator(model, tok, make_drafter("hydra", heads=heads("hydra"),
                                                              embed=model.get_input_embeddings(), tree=small))
    alone = [ref_big.generate(t, max_new_tokens=10).token_ids for t in texts]
    assert alone == [ref_small.generate(t, max_new_tokens=10).token_ids for t in texts]
    bg = BatchGenerator(model, tok, d, trees={1: TREE, 3: small})
    spy = BatchSizes(model)
    try:
        res = bg.generate(texts, max_new_tokens=10)
        bg.generate(texts[:2], max_new_tokens=10)
    finally:
        spy.close()
    assert [r.token_ids for r in res] == alone
    # 3 active rows verify the one-node tree (pending token + 1 node), fewer rows the big tree
    n_first = res.target_forwards  # verify forwards of the 3-prompt call
    vs = spy.verify_shapes
    assert all(s[1] <= 2 for s in vs[:n_first] if s[0] == 3)
    assert any(s[0] == 3 for s in vs[:n_first])
    assert vs[n_first] == (2, len(TREE) + 1), vs
    with pytest.raises(HydraspecError, match="head"):
        BatchGenerator(model, tok, make_drafter("pld"), trees={2: small})
    # token ids, text and message lists mix in one call; bad calls are refused with a clear error
    ids = tok(texts[0])["input_ids"]
    mixed = ref_big.generate_batch([ids, texts[1], [{"role": "user", "content": texts[2]}]], max_new_tokens=10)
    assert [r.token_ids for r in mixed] == alone
    for bad, match in (("w1 w2", "list of prompts"), ([], "no prompts"), (["w1", "  "], "empty")):
        with pytest.raises(HydraspecError, match=match):
            ref_big.generate_batch(bad, max_new_tokens=4)
    with pytest.raises(HydraspecError, match="context"):
        ref_big.generate_batch(texts, max_new_tokens=10_000)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (1.0, 0), (1.0, 1)])
def test_batched_head_proposals_equal_per_row_proposals(kind, temperature, top_k):
    from hydraspec.drafters.base import DecodeState
    from hydraspec.sampling import Sampling

    model = tiny.cached_model("llama", "sdpa", SEED)
    d = DRAFTERS[kind](model)
    S = Sampling(temperature, top_k, 1.0)  # top-k 1 < 2 siblings: sampled trees get cut
    g = torch.Generator().manual_seed(0)
    hidden = [torch.randn(model.config.hidden_size, generator=g) * 3 for _ in range(4)] + [None]

    def states():
        return [DecodeState(tokens=[i + 1, i + 7], prompt_len=2, sampling=S, hidden=h,
                            generator=torch.Generator().manual_seed(i)) for i, h in enumerate(hidden)]

    one = [d.propose([st])[0] for st in states()]  # each row alone
    many = d.propose(states())  # every row at once
    assert len(many) == len(one) and len(many[-1]) == 0
    if top_k == 1:
        assert all(len(t) < len(TREE) for t in many[:-1])
    for a, b in zip(one, many):
        assert a.parents == b.parents and a.tokens.tolist() == b.tokens.tolist()
        assert (a.q is None) == (b.q is None)
        if a.q is not None:
            torch.testing.assert_close(a.q, b.q)


# ---- sampling ----------------------------------------------------------------------------------


E2E_VOCAB = 24


@pytest.mark.parametrize("widths", [[2, 2], None], ids=["draft-tree", "draft-chain"])
def test_lossless_sampling_in_a_batch_follows_the_target(widths):
    from scipy.stats import chisquare  # noqa: F401  (test_sampling.gof needs scipy)
    from test_sampling import gof

    from hydraspec.sampling import Sampling

    tok = tiny.make_tokenizer(E2E_VOCAB)
    model = tiny.cached_model("llama", "sdpa", 7, vocab=E2E_VOCAB, hidden=32, layers=1, init_range=0.2)
    prompt = [3, 5, 7, 11]
    other = [2, 9, 4, 1, 1, 6, 8, 13, 2, 2, 19, 5, 4]  # longer rows around it: padding and a ragged cache
    drafter = make_drafter("draft", tiny.noisy_copy(model, 0.5, seed=8), widths=widths, k=2, dynamic=False)
    gen = SpeculativeGenerator(model, tok, drafter)
    S = Sampling(0.7, 5, 1.0)
    p0 = S.probs(tiny.full_logits(model, prompt)[-1])
    p1 = torch.stack([S.probs(tiny.full_logits(model, prompt + [y])[-1]) for y in range(E2E_VOCAB)])
    joint = p0[:, None] * p1
    counts = torch.zeros(E2E_VOCAB, E2E_VOCAB, dtype=torch.long)
    rows = [other] + [prompt] * 40
    forwards = 0
    for call in range(12):
        res = gen.generate_batch(input_ids=rows, max_new_tokens=2, temperature=0.7, top_k=5, seed=1000 * call)
        for r in res[1:]:
            assert len(r.token_ids) == 2
            counts[r.token_ids[0], r.token_ids[1]] += 1
            forwards += r.stats.target_forwards
    n = int(counts.sum())
    assert n < forwards < 2 * n - 0.05 * n, forwards  # drafts were accepted sometimes, not always
    pv = gof(counts, joint)
    assert pv > 1e-3, f"batched sampling does not follow the target (chi-square p = {pv:.2e})"
    # the same check against another prompt's distribution fails: the test has power
    q0 = S.probs(tiny.full_logits(model, other)[-1])
    q1 = torch.stack([S.probs(tiny.full_logits(model, other + [y])[-1]) for y in range(E2E_VOCAB)])
    assert gof(counts, q0[:, None] * q1) < 1e-3
    # seeds: same seed, same rows; row i uses seed + i
    a = gen.generate_batch(input_ids=rows[:3], max_new_tokens=4, temperature=0.7, seed=5)
    b = gen.generate_batch(input_ids=rows[:3], max_new_tokens=4, temperature=0.7, seed=5)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


@pytest.mark.parametrize("method", ["ar", "pld", "draft-chain", "draft-tree", "medusa", "hydra", "hydra++",
                                    "pld+hydra++"])
def test_sampled_rows_equal_batch_of_one_with_the_same_seed(method, tok):
    """Row i of a batch draws from its own generator seeded seed + i, in the same order as a batch-1 run,
    so (up to float rounding of batched forwards) it samples exactly what that run samples."""
    model = tiny.cached_model("llama", "sdpa", SEED)
    prompts = ragged_prompts()
    gen = SpeculativeGenerator(model, tok, DRAFTERS[method](model))
    kw = dict(max_new_tokens=12, temperature=0.8, top_p=0.9)
    alone = [gen.generate(input_ids=p, seed=40 + i, **kw) for i, p in enumerate(prompts)]
    res = gen.generate_batch(input_ids=prompts, seed=40, batch_size=3, **kw)
    for i, (r, a) in enumerate(zip(res, alone)):
        assert r.token_ids == a.token_ids, (method, i)
        assert r.stats.accept_hist == a.stats.accept_hist, (method, i)


def test_typical_acceptance_rows_equal_batch_of_one_with_the_same_seed(tok):
    """Typical acceptance in a batch: row i samples and accepts exactly what a batch-of-one run seeded
    seed + i does."""
    model = tiny.cached_model("llama", "sdpa", SEED)
    prompts = ragged_prompts()
    gen = SpeculativeGenerator(model, tok, DRAFTERS["medusa"](model), acceptor="typical")
    kw = dict(max_new_tokens=8, temperature=0.8)
    alone = [gen.generate(input_ids=p, seed=i, **kw) for i, p in enumerate(prompts)]
    res = gen.generate_batch(input_ids=prompts, seed=0, **kw)
    assert len({tuple(a.token_ids) for a in alone}) > 1  # rows differ: a row answering for another would fail
    for i, (r, a) in enumerate(zip(res, alone)):
        assert len(r.token_ids) == 8
        assert r.token_ids == a.token_ids, i
        assert r.stats.accept_hist == a.stats.accept_hist, i
        check_row_stats(r)


# ---- memory ------------------------------------------------------------------------------------


def test_memory_statement_and_refusal(tok):
    model = tiny.cached_model("llama", "sdpa", SEED)
    prompts = ragged_prompts()
    cfg = model.config
    per_slot = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    gen = SpeculativeGenerator(model, tok)
    res = gen.generate_batch(input_ids=prompts, max_new_tokens=8)
    capacity = max(map(len, prompts)) + 8 + 0 + 1
    assert res.cache_bytes == cache_bytes(model, len(prompts), capacity) == len(prompts) * capacity * per_slot
    spy = BatchSizes(model)
    try:
        with pytest.raises(HydraspecError, match=r"a batch of 5 needs .* of KV cache"):
            gen.generate_batch(input_ids=prompts, max_new_tokens=8, memory_limit=res.cache_bytes // 2)
        # against the real free memory: 1024 rows x 2M positions x 384 bytes = 768 GiB
        big = tiny.cached_model("llama", "sdpa", SEED, max_pos=1 << 22)
        with pytest.raises(HydraspecError, match="batch-size"):
            BatchGenerator(big, tok).generate(input_ids=[[1]] * 1024, max_new_tokens=1 << 21)
    finally:
        spy.close()
    assert spy.sizes == []  # refused before any work
    # smaller batches fit where the big one does not
    ok = gen.generate_batch(input_ids=prompts, max_new_tokens=8, batch_size=2, memory_limit=res.cache_bytes // 2)
    assert [r.token_ids for r in ok] == [r.token_ids for r in res]


# ---- command line ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = tiny.make_model("llama", seed=0)
    tk = tiny.make_tokenizer()
    target.save_pretrained(root / "target")
    tk.save_pretrained(root / "target")
    tiny.noisy_copy(target, 0.05).save_pretrained(root / "draft")
    tk.save_pretrained(root / "draft")
    return root


def test_cli_prompt_file_batch_size(saved, tmp_path, capsys):
    from hydraspec.cli import main

    texts = ["w5 w6 w7", " ".join(f"w{i % 90 + 1}" for i in range(40)), "w9", "w1 w2 w3 w1 w2"]
    f = tmp_path / "prompts.txt"
    f.write_text(texts[0] + "\n" + json.dumps({"prompt": texts[1]}) + "\n\n" + texts[2] + "\n"
                 + json.dumps(texts[3]) + "\n")
    assert read_prompt_lines(str(f)) == texts
    common = ["generate", "--model", str(saved / "target"), "--dtype", "float32", "--max-new-tokens", "12", "--json"]
    single = []
    for t in texts:
        assert main(common + ["--prompt", t]) == 0
        single.append(json.loads(capsys.readouterr().out)["token_ids"])
    for method in (["--method", "pld"], ["--method", "draft", "--draft-model", str(saved / "draft")]):
        assert main(common + ["--prompt-file", str(f), "--batch-size", "3", *method]) == 0
        out = capsys.readouterr()
        rows = [json.loads(line) for line in out.out.splitlines()]
        assert [r["index"] for r in rows] == [0, 1, 2, 3]
        assert [r["token_ids"] for r in rows] == single
        assert all(r["new_tokens"] == 12 for r in rows)
        assert "KV cache" in out.err and "tokens/s" in out.err
    # --stream with a batch: per-row deltas as JSON lines while decoding, then the results
    assert main(common + ["--prompt-file", str(f), "--batch-size", "3", "--method", "pld", "--stream"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    deltas, results = [x for x in lines if "delta" in x], [x for x in lines if "token_ids" in x]
    assert [r["token_ids"] for r in results] == single
    for r in results:
        assert "".join(d["delta"] for d in deltas if d["index"] == r["index"]) == r["text"]
    assert len(deltas) > len(results)  # several steps per row, streamed as they came
    assert main(common + ["--prompt", texts[0], "--batch-size", "2", "--method", "pld"]) == 0  # one prompt
    assert json.loads(capsys.readouterr().out)["token_ids"] == single[0]
    assert main(common + ["--prompt-file", str(f), "--batch-size", "0"]) == 2
    assert "--batch-size must be at least 1" in capsys.readouterr().err
    # head drafting with a tree per batch size through the CLI
    from hydraspec.heads import save_heads
    from hydraspec.models import load_model

    m, _ = load_model(str(saved / "target"), dtype="float32", device="cpu")
    save_heads(build_heads("hydra", m, num_heads=2), tmp_path / "heads", base_model=str(saved / "target"),
               tree=[[0], [0, 0], [1]])
    trees = tmp_path / "trees.json"
    trees.write_text(json.dumps({"1": [[0], [1], [0, 0], [1, 0]], "2": [[0]]}))
    assert main(common + ["--prompt-file", str(f), "--batch-size", "2", "--method", "hydra", "--heads",
                          str(tmp_path / "heads"), "--batch-trees", str(trees)]) == 0
    assert [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()] == single
    assert main(common + ["--prompt-file", str(f), "--batch-size", "2", "--method", "hydra", "--heads",
                          str(tmp_path / "heads"), "--batch-trees", '{"x": [[0]]}']) == 2
    assert "keys must be batch sizes" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert main(common + ["--prompt-file", str(empty), "--batch-size", "2"]) == 2
    assert "holds no prompts" in capsys.readouterr().err


# ---- bench -------------------------------------------------------------------------------------


def test_bench_batch_sizes(tmp_path, tok):
    import argparse

    from hydraspec.bench import add_parser, run_bench
    from hydraspec.heads import save_heads

    model = tiny.make_model("llama", seed=3)
    tiny.set_eos(model, 95)  # an EOS that random rows may or may not meet; hf-ar needs a pad id
    models = {"tiny": (model, tok), "tiny-draft": (tiny.noisy_copy(model, 0.1), tok)}

    def loader(name, dtype, device):
        return models[name]

    save_heads(build_heads("hydra", model, num_heads=2), tmp_path / "h", base_model="tiny", tree=[[0], [1], [0, 0]])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "c",
                                             "turns": [" ".join(f"w{(7 * i + j) % 90 + 1}" for j in range(2 + 5 * i))]})
                                 for i in range(5)))
    out = tmp_path / "bench"
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd"))
    args = p.parse_args(["bench", "--model", "tiny", "--methods", "ar,pld,draft,hydra,hf-ar", "--draft-model",
                         "tiny-draft", "--heads", str(tmp_path / "h"), "--prompts", str(prompts),
                         "--max-new-tokens", "10", "--dtype", "float32", "--device", "cpu", "--out", str(out),
                         "--batch-sizes", "1,2,4", "--batch-trees", '{"1": [[0], [1], [0, 0]], "3": [[0]]}'])
    assert run_bench(args, loader=loader) == 0
    data = json.loads((out / "batch_results.json").read_text())
    rows = data["rows"]
    assert [(r["method"], r["batch_size"]) for r in rows] == [(m, b) for m in ("ar", "pld", "draft", "hydra", "hf-ar")
                                                              for b in (1, 2, 4)]
    for r in rows:
        assert r["prompts"] == 5 and r["new_tokens"] > 0 and r["tokens_per_s"] > 0 and r["mean_latency_s"] > 0
        assert r["identical_to_ar"] == 1.0, r  # every method and batch size gives ar's batch-1 answers
        if r["method"] != "hf-ar":
            assert r["cache_bytes"] > 0
        # ar takes one token per forward and hf-ar counts no forwards; the drafters that draft whatever the
        # clock says (pld follows the cost rule) got draft tokens accepted: the close copy of the target
        # (draft) most of its drafts, the heads some
        want = {"ar": 1.0, "hf-ar": None}
        if r["method"] in want:
            assert r["mean_accepted"] == want[r["method"]], r
        elif r["method"] != "pld":
            assert r["mean_accepted"] > (1.5 if r["method"] == "draft" else 1.0), r
    ar = {r["batch_size"]: r for r in rows if r["method"] == "ar"}
    assert ar[1]["batched_forwards"] > ar[2]["batched_forwards"] > ar[4]["batched_forwards"]
    assert (out / "batch_throughput.png").read_bytes()[:4] == b"\x89PNG"
    assert "| hf-ar | 4 |" in (out / "batch_results.md").read_text()
    args.methods = "ar,hf-pld"
    with pytest.raises(HydraspecError, match="--batch-sizes supports"):
        run_bench(args, loader=loader)
    args.methods, args.batch_sizes = "ar,hydra", "1,x"
    with pytest.raises(HydraspecError, match="comma-separated integers"):
        run_bench(args, loader=loader)


def test_single_sequence_prompt_lookup_drafts_under_the_cost_rule(tok):
    """generate() with prompt lookup cuts proposals by the measured verify cost and the acceptance rate:
    where an extra verify token costs a whole forward nothing is drafted; where it is free lookups draft
    as before; the output is plain decoding's either way. Drafters with a forward of their own keep theirs."""
    from hydraspec.adaptive import AdaptiveDraft

    model = tiny.cached_model("llama", "sdpa", SEED)
    prompts = ragged_prompts()
    plain = SpeculativeGenerator(model, tok)
    ref = [plain.generate(input_ids=p, max_new_tokens=N_NEW) for p in prompts]
    gen = SpeculativeGenerator(model, tok, DRAFTERS["pld"](model))
    rule = gen.draft_rule()
    assert isinstance(rule, AdaptiveDraft) and gen.draft_rule() is rule  # measured once
    rule.points = [(1, 1.0), (2, 2.0), (16, 16.0)]  # every verify token costs a full forward
    for p, r in zip(prompts, ref):
        res = gen.generate(input_ids=p, max_new_tokens=N_NEW)
        assert res.token_ids == r.token_ids
        assert res.stats.target_forwards == len(r.token_ids)  # one token per forward: nothing was verified
    rule.points = [(1, 1.0), (16, 1.0)]  # free: prompt lookup drafts
    drafted = [gen.generate(input_ids=p, max_new_tokens=N_NEW) for p in prompts]
    assert [d.token_ids for d in drafted] == [r.token_ids for r in ref]
    assert any(d.stats.target_forwards < len(d.token_ids) for d in drafted)
    def adaptive(g, **kw):
        return isinstance(g.draft_rule(**kw), AdaptiveDraft)

    assert not adaptive(SpeculativeGenerator(model, tok, DRAFTERS["medusa"](model)))
    assert not adaptive(plain)
    assert not adaptive(gen, temperature=0.8)  # sampling: a seed gives the same text on every run
    assert not adaptive(SpeculativeGenerator(model, tok, DRAFTERS["pld"](model), adaptive=False))


@pytest.mark.parametrize("ys, fit", [([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]), ([1.0, 3.0, 2.0, 4.0], [1.0, 2.5, 2.5, 4.0]),
                                     ([5.0, 1.0, 1.0, 7.0], [7 / 3, 7 / 3, 7 / 3, 7.0])])
def test_verify_cost_sizes_measured_out_of_order_share_their_mean(ys, fit):
    """A forward over more tokens never costs less: the fitted curve is the closest non-decreasing one (a slow
    spell at a small size no longer drags every larger one up to it, nor a fast one every smaller down)."""
    from hydraspec.verify_cost import monotone

    assert monotone(ys) == pytest.approx(fit)


def test_the_learnt_curve_follows_each_sizes_steps_and_carries_the_nearest_ones_to_sizes_not_used():
    """Points measured flat; then one-token steps cost 1.5 and four-token steps 3: the curve learns both sizes,
    a size between them gets a cost between theirs, and sizes beyond them (8, 16) that of four tokens."""
    from hydraspec.verify_cost import LearntCurve

    curve = LearntCurve({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0})
    curve.learn(1, 100.0)  # a compile: not the curve
    assert curve(4) == 1.0
    for i in range(300):
        curve.learn(1, 1.5) if i % 2 else curve.learn(4, 3.0)
    assert curve(1) == pytest.approx(1.5, rel=0.1) and curve(4) == pytest.approx(3.0, rel=0.1)  # pulled a little
    assert curve(1) < curve(2) < curve(4) and curve(8) == curve(16) == pytest.approx(curve(4))


def test_verify_cost_is_measured_once_per_machine(tmp_path, monkeypatch):
    """The measured verify cost is kept on disk under a key of the model and the machine, and a later process
    (here: another model object of the same weights) reads it back instead of timing every size again, after
    checking that one token still costs what the file says; figures that are far off are measured again."""
    from hydraspec import verify_cost

    monkeypatch.setenv("HYDRASPEC_HOME", str(tmp_path))
    model = tiny.cached_model("llama", "sdpa", SEED)
    path = verify_cost.stored_cost_path(model, (1, 2, 4), 16, 1)
    assert path is not None and path.parent == tmp_path / "verify-cost" and not path.exists()
    first = verify_cost.measure_verify_cost(model, sizes=(1, 2, 4), prefix=16, repeats=1)
    assert path.exists() and sorted(first) == [1, 2, 4]
    assert first[1] <= first[2] <= first[4]
    assert verify_cost.stored_cost_path(model, (1, 2, 8), 16, 1) != path  # other sizes: another file
    timed = []
    real, real_still_true = verify_cost.time_sizes, verify_cost.still_true
    monkeypatch.setattr(verify_cost, "time_sizes", lambda *a: timed.append(1) or real(*a))
    monkeypatch.setattr(verify_cost, "still_true", lambda *a: True)
    other = tiny.noisy_copy(model, 0.0, seed=3)  # same shape and layers, not in the per-process memo
    assert verify_cost.measure_verify_cost(other, sizes=(1, 2, 4), prefix=16, repeats=1) == first and not timed
    # figures taken on a busy machine (one token 100 s): the check fails and every size is timed again
    monkeypatch.setattr(verify_cost, "still_true", real_still_true)
    path.write_text(json.dumps({"1": 100.0, "2": 100.0, "4": 100.0}))
    again = verify_cost.measure_verify_cost(tiny.noisy_copy(model, 0.0, seed=4), sizes=(1, 2, 4), prefix=16, repeats=1)
    assert timed and again[4] < 100.0 and json.loads(path.read_text())["4"] == again[4]
    assert not real_still_true(model, {1: 100.0}, 16)
    # an unreadable file is measured again
    path.write_text("not json")
    timed.clear()
    verify_cost.measure_verify_cost(tiny.noisy_copy(model, 0.0, seed=5), sizes=(1, 2, 4), prefix=16, repeats=1)
    assert timed and json.loads(path.read_text())
