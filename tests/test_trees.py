"""Data-driven token trees (hydraspec.trees, `hydraspec build-tree`) and dynamic trees
(hydraspec.drafters.dynamic): growth arithmetic, replay against the engine, tree.json, exactness and
losslessness."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import tiny
from hydraspec import HydraspecError, SpeculativeGenerator, make_drafter
from hydraspec.drafters.draft_model import DraftModelDrafter
from hydraspec.drafters.dynamic import DynamicDraftModelDrafter, DynamicHeadDrafter, grow_dynamic
from hydraspec.drafters.heads import HeadDrafter
from hydraspec.heads import build_heads
from hydraspec.sampling import Sampling
from hydraspec.tree import bfs_paths, load_tree_spec, shape_of
from hydraspec.trees.build import build_tree
from hydraspec.trees.calibrate import Calibration, draft_ranks, greedy_sequences, head_ranks
from hydraspec.trees.grow import (
    acceptance_table,
    drafted_nodes,
    expected_tokens,
    grow_medusa,
    grow_simulate,
    replay,
    replay_steps,
)

PROMPT = [5, 9, 2, 7, 7, 1]


def noisy_heads(model, kind, num_heads=3, scale=0.05, seed=0):
    torch.manual_seed(seed)
    heads = build_heads(kind, model, num_heads=num_heads)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * scale)
    return heads


# ---- growth arithmetic ------------------------------------------------------------------------------


def test_medusa_growth_on_a_hand_computed_example():
    # a[d, i]: P(rank-i proposal at depth d is right)
    a = np.array([[0.6, 0.2, 0.1],
                  [0.5, 0.3, 0.0]])
    order, exp = grow_medusa(a, 5)
    # path probabilities: [0] .6, [0,0] .3, [1] .2, [0,1] .18, [1,0] .1 = [2] .1 (tie: shorter/lower first)
    assert order == [[0], [0, 0], [1], [0, 1], [1, 0]]
    assert exp == pytest.approx([1.6, 1.9, 2.1, 2.28, 2.38])
    assert expected_tokens([[0], [1], [0, 0]], a) == pytest.approx(1 + 0.6 + 0.2 + 0.3)
    # depth is bounded by the number of measured depths: nothing deeper than 2 is ever added
    order, _ = grow_medusa(a, 9)
    assert max(len(p) for p in order) == 2 and len(order) == 9
    # every prefix of the growth order is a tree
    for n in range(1, len(order) + 1):
        assert all(len(p) == 1 or p[:-1] in order[:n] for p in order[:n])


def test_acceptance_table_counts_ranks():
    cal = Calibration([np.array([[0, 1], [0, 3], [2, 0], [3, 3]])], depth=2, max_rank=3)
    a = acceptance_table(cal)  # rank 3 = "not in the top 3"
    assert a.tolist() == [[0.5, 0.0, 0.25], [0.25, 0.25, 0.0]]


def test_replay_walks_like_the_engine():
    ranks = np.array([[0, 0], [1, 0], [0, 1], [0, 0], [5, 5], [0, 0]])
    tree = {(0,), (0, 0)}
    # p=0 accepts 2 -> p=3 accepts 2 -> p=6 ends
    assert replay_steps(ranks, tree) == [2, 2]
    assert replay_steps(ranks, {(1,)}) == [0, 1, 0, 0, 0]  # p=0:0, p=1:1, p=3:0, p=4:0, p=5:0
    cal = Calibration([ranks], depth=2, max_rank=5)
    assert replay(cal, tree) == pytest.approx(6 / 2)


def test_drafted_nodes_follow_the_replayed_steps():
    """At p=0 the draft model stops after one level (rank 5 = not drafted at depth 1): the step drafts 1
    node and accepts it; the next step is at p=2, drafts both levels and accepts both; then it ends."""
    ranks = np.array([[0, 5], [0, 0], [0, 0], [0, 0]])
    cal = Calibration([ranks], depth=2, max_rank=5, levels=[np.array([1, 2, 2, 2])])
    chain = [[0], [0, 0]]
    assert replay_steps(ranks, set(map(tuple, chain))) == [1, 2]
    assert drafted_nodes(cal, chain) == pytest.approx(1.5)
    assert drafted_nodes(cal, [[0], [1], [0, 0]]) == pytest.approx((2 + 3) / 2)
    assert drafted_nodes(Calibration([ranks], depth=2, max_rank=5), chain) == 2.0  # no stop: whole trees


def test_simulate_sees_correlations_that_medusa_cannot():
    """Half the positions have ranks (0, 0), half (1, 1): the marginals are all 0.5, so under
    independence [0, 1] is as good as [0, 0]; replaying shows [0, 1] is never accepted."""
    r = np.array([[0, 0], [1, 1]] * 20)
    cal = Calibration([r], depth=2, max_rank=4)
    order, exp = grow_simulate(cal, 4)
    assert sorted(map(tuple, order)) == [(0,), (0, 0), (1,), (1, 1)]
    assert exp[-1] == pytest.approx(3.0)  # every step accepts 2
    assert exp == sorted(exp)
    m_order, m_exp = grow_medusa(acceptance_table(cal), 4)
    assert m_exp[-1] == pytest.approx(1 + 0.5 + 0.5 + 0.25 + 0.25)  # independence undercounts
    assert [0, 1] in m_order or [1, 0] in m_order


def test_simulate_with_the_target_as_its_own_draft_model(tok):
    """An identical draft model ranks every greedy token first: the simulated tree is the chain of
    rank 0 and decoding with it accepts (nearly) everything."""
    model = tiny.cached_model("llama", "sdpa", 1)
    seqs = greedy_sequences(model, tok, [PROMPT], 24)
    ranks = draft_ranks(model, seqs, depth=3, max_rank=5)
    # one row per verify step position (24 new tokens); the last rows lose the depths past the budget
    assert ranks[0].shape == (24, 3)
    assert (ranks[0][:-3] == 0).all() and ranks[0][-3:].tolist() == [[0, 0, 5], [0, 5, 5], [5, 5, 5]]
    order, exp = grow_simulate(Calibration(ranks, 3, 5), 3)
    assert order == [[0], [0, 0], [0, 0, 0]]
    assert exp[-1] > 3.5
    gen = SpeculativeGenerator(model, tok, DraftModelDrafter(model, tree=order))
    assert gen.generate(input_ids=PROMPT, max_new_tokens=24).stats.mean_accepted > 3.5


def test_static_draft_tree_stops_where_the_draft_model_is_unsure(tok):
    """With a confidence given, a static draft tree is cut at the first level where the draft model's
    top token is below it under every parent (tiny random models are never confident: only the first
    level is left); greedy output stays plain decoding's. Without one the tree stays whole."""
    model = tiny.cached_model("llama", "sdpa", 1)
    draft = tiny.noisy_copy(model, 0.05)
    tree = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    ref = SpeculativeGenerator(model, tok).generate(input_ids=PROMPT, max_new_tokens=20).token_ids
    sizes = {}
    for conf in (None, 0.999):
        d = DraftModelDrafter(draft, tree=tree, confidence=conf)
        seen = []
        propose = d.propose
        d.propose = lambda states, propose=propose: seen.extend(propose(states)) or seen[-len(states):]
        res = SpeculativeGenerator(model, tok, d).generate(input_ids=PROMPT, max_new_tokens=20)
        assert res.token_ids == ref, conf
        sizes[conf] = {len(t.tokens) for t in seen}
    assert sizes[None] == {5} and sizes[0.999] == {2}
    with pytest.raises(HydraspecError, match="confidence"):
        DraftModelDrafter(draft, tree=tree, confidence=1.5)


def test_replay_models_the_draft_confidence_stop(tok):
    """With the draft model's early stop, the recorded ranks drop the depths it would not draft, and
    replaying a chain matches decoding with `confidence` step by step. The threshold is the median
    top probability of the (tiny, unconfident) draft model, so about half its drafts are cut."""
    model = tiny.cached_model("llama", "sdpa", 1)
    draft = tiny.noisy_copy(model, 0.05)
    depth, n_new = 4, 40
    seqs = greedy_sequences(model, tok, [PROMPT], n_new)
    with torch.inference_mode():
        lg = draft(input_ids=torch.tensor([seqs[0][0]])).logits[0].float()
    conf = float(torch.softmax(lg, -1).max(-1).values.median())
    ranks = draft_ranks(draft, seqs, depth, 10, confidence=conf)
    plain = draft_ranks(draft, seqs, depth, 10)
    assert (ranks[0] == 10).sum() > (plain[0] == 10).sum(), "the threshold must cut some drafts"
    chain = [[0] * (d + 1) for d in range(depth)]
    expect = replay_steps(ranks[0], set(map(tuple, chain)))
    rec = Recorder(DraftModelDrafter(draft, tree=chain, confidence=conf))
    res = SpeculativeGenerator(model, tok, rec).generate(input_ids=PROMPT, max_new_tokens=n_new)
    assert res.token_ids == seqs[0][0][len(PROMPT):]
    assert rec.steps == expect
    assert expect != replay_steps(plain[0], set(map(tuple, chain)))


class Recorder:
    """Wraps a drafter and records the drafts accepted at every step, in order."""

    def __init__(self, inner):
        self.inner, self.steps = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, states):
        return self.inner.propose(states)

    def observe(self, states, verdicts):
        assert len(states) == 1  # one sequence
        self.steps.append(len(verdicts[0].accepted))
        self.inner.observe(states, verdicts)


def trained_eagle(model, seqs, tmp_path, depth):
    """An EAGLE head trained briefly on the sequences themselves (a fresh one accepts nothing)."""
    import json

    from hydraspec.heads import load_heads
    from hydraspec.train import train_heads

    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps({"id": f"s{i}", "prompt_ids": seq[:plen], "answer_ids": seq[plen:]}) + "\n"
                            for i, (seq, plen) in enumerate(seqs)))
    train_heads(model, data, tmp_path / "eagle", kind="eagle", num_heads=depth, epochs=20, lr=1e-2, distill=True,
                heldout=0.0, progress=False, head_options={"intermediate_size": 64}, eagle={"steps": depth},
                cache_bytes=0)
    return load_heads(tmp_path / "eagle", model)[0]


@pytest.mark.parametrize("kind", ["draft", "medusa", "hydra", "eagle"])
def test_offline_replay_matches_the_engine_step_by_step(kind, tok, tmp_path):
    """The recorded ranks use the engine's offsets: replaying a tree offline gives the same accepted
    lengths, step by step, as decoding the same prompt with that tree (wrong offsets would not)."""
    model = tiny.cached_model("llama", "sdpa", 1)
    depth, n_new = 3, 40
    seqs = greedy_sequences(model, tok, [PROMPT], n_new)
    if kind == "draft":
        draft = tiny.noisy_copy(model, 0.3)
        ranks = draft_ranks(draft, seqs, depth, 10)
        make = lambda paths: DraftModelDrafter(draft, tree=paths)  # noqa: E731
    elif kind == "eagle":
        from hydraspec.drafters.eagle import EagleDrafter

        heads = trained_eagle(model, seqs, tmp_path, depth)
        ranks = head_ranks(model, heads, model.get_input_embeddings(), seqs, depth, 10)
        make = lambda paths: EagleDrafter(heads, model.get_input_embeddings(), paths)  # noqa: E731
    else:
        heads = noisy_heads(model, kind, num_heads=depth, scale=0.3)
        ranks = head_ranks(model, heads, model.get_input_embeddings(), seqs, depth, 10)
        make = lambda paths: HeadDrafter(heads, model.get_input_embeddings(), paths)  # noqa: E731
    cal = Calibration(ranks, depth, 10)
    order, _ = grow_simulate(cal, 8)
    expect = replay_steps(ranks[0], set(map(tuple, order)))
    rec = Recorder(make(order))
    res = SpeculativeGenerator(model, tok, rec).generate(input_ids=PROMPT, max_new_tokens=n_new)
    assert res.token_ids == seqs[0][0][len(PROMPT):]
    assert sum(expect) > 2, "the test needs some accepted drafts to mean anything"
    # to the last step, where the engine trims the drafts to its token budget
    assert rec.steps == expect


# ---- tree.json ----------------------------------------------------------------------------------------


def test_tree_json_round_trip_and_validation(tmp_path, tok):
    model = tiny.cached_model("llama", "sdpa", 1)
    heads = noisy_heads(model, "medusa", num_heads=3, scale=0.3)
    res = build_tree(model, tok, prompt_ids=[PROMPT, [3, 4, 5]], prompt_names=["a:1", "a:2"], max_nodes=6,
                     method="medusa", select="none", heads=heads, max_new_tokens=16, log=lambda m: None)
    assert res["nodes"] == 6 and len(res["sizes"]) == 6 and res["calibration"]["prompts"] == ["a:1", "a:2"]
    assert res["measured_on"]["dtype"] == "float32" and res["measured_on"]["batch_size"] == 1
    f = tmp_path / "tree.json"
    f.write_text(json.dumps(res))
    paths = load_tree_spec(str(f))
    assert paths == res["paths"] and len(paths) == 6
    # the tree file is accepted by the drafters and make_drafter
    for drafter in (HeadDrafter(heads, model.get_input_embeddings(), str(f)),
                    make_drafter("medusa", heads=heads, embed=model.get_input_embeddings(), tree=str(f)),
                    make_drafter("medusa", heads=heads, embed=model.get_input_embeddings(), tree=res),
                    DraftModelDrafter(tiny.noisy_copy(model, 0.1), tree=str(f))):
        assert drafter.max_nodes == 6
    # clear errors
    bad = [("[[0], [-1]]", "bad tree path"), ("[[0], [1, 0]]", "has no parent path [1]"),
           ("[[0], [0]]", "appears twice"), ('{"nodes": 3}', "no 'paths'"), ('"x"', "must be a list"),
           ("not json", "neither a JSON file nor JSON")]
    for text, msg in bad:
        with pytest.raises(HydraspecError, match=re.escape(msg)):
            load_tree_spec(text)
    deep = tmp_path / "deep.json"
    deep.write_text(json.dumps({"paths": [[0], [0, 0], [0, 0, 0]]}))
    with pytest.raises(HydraspecError, match="exceeds the number of heads"):
        load_tree_spec(str(deep), max_depth=2)
    with pytest.raises(HydraspecError, match="exceeds the number of heads"):
        make_drafter("medusa", heads=build_heads("medusa", model, num_heads=2), embed=model.get_input_embeddings(),
                     tree=str(deep))
    with pytest.raises(HydraspecError, match="exceeds the number of heads"):
        build_tree(model, tok, prompt_ids=[PROMPT], prompt_names=["x"], heads=heads, depth=4, select="none")


def test_build_tree_measures_and_picks_the_fastest(tok):
    model = tiny.cached_model("llama", "sdpa", 1)
    draft = tiny.noisy_copy(model, 0.1)
    res = build_tree(model, tok, prompt_ids=[PROMPT], prompt_names=["p"], max_nodes=5, method="simulate",
                     select="measure", draft_model=draft, depth=3, max_new_tokens=12, confirm=2, reps=1,
                     log=lambda m: None)
    rows = res["sizes"]
    assert all(r["step_s"] > 0 and r["predicted_tokens_per_s"] > 0 for r in rows)
    measured = [r for r in rows if r["measured_tokens_per_s"] is not None]
    assert len(measured) == 2
    assert res["nodes"] == max(measured, key=lambda r: r["measured_tokens_per_s"])["nodes"]
    assert len(res["paths"]) == res["nodes"] and res["drafter"]["kind"] == "draft"
    base = res["default"]  # the draft model's own adaptive chain, measured the same way
    assert base["tree"] == "the adaptive-length chain" and base["measured_tokens_per_s"] > 0
    assert 1.0 <= base["measured_tokens_per_step"]
    for r in measured:  # the prefill is part of the end-to-end figure only
        assert r["measured_decode_tokens_per_s"] > r["measured_tokens_per_s"] > 0
        assert 1.0 <= r["measured_tokens_per_step"] <= r["depth"] + 1


def test_build_tree_confirms_with_the_draft_confidence_stop(tok):
    """With a draft confidence the confirmed trees decode as `--draft-confidence` would: a tiny random
    draft model is never confident, so every step verifies only the first level (<= 2 tokens a step),
    and the replay predicts that cut (the draft model equals the target, so without it it would expect
    up to 4); the value is recorded in tree.json."""
    model = tiny.cached_model("llama", "sdpa", 1)
    res = build_tree(model, tok, prompt_ids=[PROMPT], prompt_names=["p"], max_nodes=4, method="simulate",
                     select="measure", draft_model=tiny.noisy_copy(model, 0.0), depth=3, max_new_tokens=12,
                     confirm=4, reps=1, draft_confidence=0.999, log=lambda m: None)
    assert res["drafter"]["confidence"] == 0.999
    confirmed = [r for r in res["sizes"] if r.get("measured_tokens_per_step") is not None]
    assert len(confirmed) == 4
    assert all(r["measured_tokens_per_step"] == r["expected_tokens_per_step"] == 2.0 for r in confirmed)
    # the draft time is charged for what the replay drafts: the first level of each tree only
    first_level = {r["nodes"]: sum(len(p) == 1 for p in res["order"][: r["nodes"]]) for r in res["sizes"]}
    assert all(r["drafted_nodes"] == first_level[r["nodes"]] for r in res["sizes"])
    t1 = res["sizes"][0]["draft_s"]
    assert all(r["draft_s"] == t1 for r in res["sizes"] if first_level[r["nodes"]] == 1)


def test_build_tree_prediction_matches_decoding_with_an_exact_drafter(tok):
    """A draft model equal to the target is always right: replay and real decoding both accept the
    whole chain, depth + 1 tokens per step (12 new tokens = 3 steps of 4)."""
    model = tiny.cached_model("llama", "sdpa", 1)
    res = build_tree(model, tok, prompt_ids=[PROMPT], prompt_names=["p"], max_nodes=3, method="simulate",
                     select="measure", draft_model=tiny.noisy_copy(model, 0.0), depth=3, max_new_tokens=12,
                     confirm=3, reps=1, log=lambda m: None)
    by_n = {r["nodes"]: r for r in res["sizes"]}
    assert by_n[3]["expected_tokens_per_step"] == by_n[3]["measured_tokens_per_step"] == 4.0
    assert by_n[1]["expected_tokens_per_step"] == by_n[1]["measured_tokens_per_step"] == 2.0


def test_build_tree_per_batch_size_feeds_batch_trees(tok, tmp_path):
    """--batch-sizes: a tree per batch size, chosen by B x expected tokens / (verify at B rows + draft);
    the tree.json's by_batch is what --batch-trees reads."""
    from hydraspec.inputs import load_batch_trees
    from hydraspec.trees.measure import time_batch_verify

    model = tiny.cached_model("llama", "sdpa", 1)
    draft = tiny.noisy_copy(model, 0.1)
    res = build_tree(model, tok, prompt_ids=[PROMPT], prompt_names=["p"], max_nodes=5, method="simulate",
                     select="measure", draft_model=draft, depth=3, max_new_tokens=12, confirm=1, reps=1,
                     batch_sizes=[1, 4], log=lambda m: None)
    assert set(res["by_batch"]) == {"1", "4"} and res["by_batch"]["1"] == res["paths"]
    n4 = len(res["by_batch"]["4"])  # one path per node
    assert res["by_batch"]["4"] == bfs_paths(res["order"][:n4])
    for r in res["sizes"]:
        b4 = r["by_batch"]["4"]
        assert b4["verify_s"] > 0
        assert b4["predicted_tokens_per_s"] == pytest.approx(
            4 * r["expected_tokens_per_step"] / (b4["verify_s"] + r["draft_s"]), rel=1e-3)
    best4 = max(res["sizes"], key=lambda r: r["by_batch"]["4"]["predicted_tokens_per_s"])
    assert best4["nodes"] == n4
    f = tmp_path / "tree.json"
    f.write_text(json.dumps(res))
    assert load_batch_trees(str(f)) == {1: res["paths"], 4: res["by_batch"]["4"]}
    # the batch timing runs B rows of a tree forward (and leaves the cache as it found it)
    t = time_batch_verify(model, res["order"], PROMPT * 3, len(PROMPT), [1, 3], 2, reps=1)
    assert set(t) == {1, 3} and all(v > 0 for v in t.values())


# ---- dynamic trees --------------------------------------------------------------------------------------


def test_grow_dynamic_keeps_the_most_probable_nodes():
    V = 6
    root = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02]))
    child = torch.log(torch.tensor([0.9, 0.05, 0.02, 0.01, 0.01, 0.01]))

    def expand(d, nodes, paths, parents):
        return child.expand(len(nodes), V)

    parents, ranks, tokens = grow_dynamic(root, expand, nodes=4, depth=3, topk=2)
    # scores: t0 .5, t0>0 .45, t0>0>0 .405, t1 .3, t1>0 .27, ...
    assert parents == (-1, -1, 0, 2) and tokens == [0, 1, 0, 0] and ranks == (0, 1, 0, 0)
    shape_of(parents)  # a valid BFS tree


class Counting:
    def __init__(self, inner):
        self.inner, self.sizes = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, states):
        trees = self.inner.propose(states)
        self.sizes.extend((len(t), int(shape_of(t.parents).depth.max()) + 1 if len(t) else 0) for t in trees)
        return trees


@pytest.mark.parametrize("kind", ["draft", "medusa", "hydra"])
def test_dynamic_trees_are_exact_in_greedy_mode(kind, tok):
    model = tiny.cached_model("llama", "sdpa", 1)
    ref = SpeculativeGenerator(model, tok).generate(input_ids=PROMPT, max_new_tokens=30).token_ids
    if kind == "draft":
        inner = make_drafter("draft", draft_model=tiny.noisy_copy(model, 0.1), tree="dynamic", tree_nodes=10,
                             tree_depth=4, tree_topk=3)
        assert isinstance(inner, DynamicDraftModelDrafter)
    else:
        inner = make_drafter(kind, heads=noisy_heads(model, kind, 4), embed=model.get_input_embeddings(),
                             tree="dynamic", tree_nodes=10, tree_depth=4, tree_topk=3)
        assert isinstance(inner, DynamicHeadDrafter)
    d = Counting(inner)
    res = SpeculativeGenerator(model, tok, d).generate(input_ids=PROMPT, max_new_tokens=30)
    assert res.token_ids == ref
    assert all(n <= 10 and depth <= 4 for n, depth in d.sizes) and max(n for n, _ in d.sizes) == 10


def test_dynamic_tree_with_a_perfect_drafter_accepts_its_whole_depth(tok):
    model = tiny.cached_model("llama", "sdpa", 1)
    d = make_drafter("draft", draft_model=model, tree="dynamic", tree_nodes=4, tree_depth=4, tree_topk=1)
    res = SpeculativeGenerator(model, tok, d).generate(input_ids=PROMPT, max_new_tokens=30)
    assert res.stats.mean_accepted == pytest.approx(5.0, abs=0.5)


def test_dynamic_tree_refuses_depth_beyond_heads():
    model = tiny.cached_model("llama", "sdpa", 1)
    with pytest.raises(HydraspecError, match="exceeds the number of heads"):
        make_drafter("hydra", heads=build_heads("hydra", model, num_heads=2), embed=model.get_input_embeddings(),
                     tree="dynamic", tree_depth=3)


# ---- lossless sampling with dynamic trees ------------------------------------------------------------------


E2E_VOCAB = 24


class NoisyOracleHydra(torch.nn.Module):
    """Hydra-like heads that run the target on context + path and add a fixed noise vector per head: a
    drafter close to, but not equal to, the target (random tiny heads hardly ever agree with it)."""

    kind = "hydra"

    def __init__(self, model, num_heads, scale=1.0, seed=6):
        super().__init__()
        self.model, self.num_heads, self.context = model, num_heads, []
        g = torch.Generator().manual_seed(seed)
        self.noise = torch.randn(num_heads, model.config.vocab_size, generator=g) * scale

    def logits(self, k, hidden, path_emb=None):
        rows = [tiny.full_logits(self.model, self.context[:-1] + path_emb[r].argmax(-1).tolist())[-1]
                for r in range(hidden.shape[0])]
        return torch.stack(rows) + self.noise[k]


class OracleDynamic(DynamicHeadDrafter):
    def propose_one(self, state):
        self.heads.context = list(state.tokens)
        return super().propose_one(state)


class GreedyWithQ(OracleDynamic):
    """WRONG on purpose: proposes the top tokens but reports the warped q as if they had been drawn."""

    def propose_one(self, state):
        s = state.sampling
        tree = super().propose_one(type(state)(tokens=state.tokens, prompt_len=state.prompt_len,
                                               sampling=Sampling(), hidden=state.hidden))
        h, pending = state.hidden, state.tokens[-1]
        rows = []
        for i in range(len(tree)):
            path = [int(tree.tokens[j]) for j in shape_of(tree.parents).path_to(i)][:-1]
            rows.append(s.probs(self._logits(len(path), h, pending, [path])[0]))
        return type(tree)(tree.tokens, tree.parents, torch.stack(rows) if rows else None)


def _two_token_counts(gen, prompt, n, sampling):
    counts = torch.zeros(E2E_VOCAB, E2E_VOCAB, dtype=torch.long)
    forwards = 0
    for seed in range(n):
        r = gen.generate(input_ids=prompt, max_new_tokens=2, seed=seed, **sampling)
        counts[r.token_ids[0], r.token_ids[1]] += 1
        forwards += r.stats.target_forwards
    return counts, forwards


@pytest.mark.parametrize("kind", ["draft", "hydra"])
def test_dynamic_trees_keep_the_target_distribution(kind, tok):
    from test_sampling import PASS_P, gof

    tok = tiny.make_tokenizer(E2E_VOCAB)
    model = tiny.cached_model("llama", "sdpa", 7, vocab=E2E_VOCAB, hidden=32, layers=1, init_range=0.2)
    sampling = dict(temperature=0.7, top_k=5)
    prompt, n = [3, 5, 7, 11], 500
    if kind == "draft":
        drafter = make_drafter("draft", draft_model=tiny.noisy_copy(model, 0.5, seed=8), tree="dynamic",
                               tree_nodes=6, tree_depth=2, tree_topk=3)
    else:
        heads = NoisyOracleHydra(model, 2)
        onehot = lambda ids: torch.nn.functional.one_hot(ids, E2E_VOCAB).float()  # noqa: E731
        drafter = OracleDynamic(heads, onehot, nodes=6, depth=2, topk=3)
    S = Sampling(0.7, 5)
    p0 = S.probs(tiny.full_logits(model, prompt)[-1])
    p1 = torch.stack([S.probs(tiny.full_logits(model, prompt + [y])[-1]) for y in range(E2E_VOCAB)])
    joint = p0[:, None] * p1
    counts, forwards = _two_token_counts(SpeculativeGenerator(model, tok, drafter), prompt, n, sampling)
    assert n < forwards < 1.95 * n, forwards  # drafts were accepted some of the time, not always
    pv = gof(counts, joint)
    assert int(counts[joint <= 0].sum()) == 0
    assert pv > PASS_P, f"dynamic-tree output does not follow the target (chi-square p = {pv:.2e})"


@pytest.mark.parametrize("broken", [False, True])
def test_dynamic_first_token_marginal_and_negative_control(broken):
    """The first emitted token over many draws: the dynamic Hydra drafter passes, and the same test
    rejects a drafter that proposes the top tokens while reporting q as if it had drawn them."""
    from test_sampling import PASS_P, gof

    tok = tiny.make_tokenizer(E2E_VOCAB)
    model = tiny.cached_model("llama", "sdpa", 7, vocab=E2E_VOCAB, hidden=32, layers=1, init_range=0.2)
    prompt, n = [3, 5, 7, 11], 600  # the lying drafter is rejected at p ~ 1e-44 by 400 draws already
    onehot = lambda ids: torch.nn.functional.one_hot(ids, E2E_VOCAB).float()  # noqa: E731
    drafter = (GreedyWithQ if broken else OracleDynamic)(NoisyOracleHydra(model, 2), onehot, nodes=4, depth=1,
                                                         topk=3)
    gen = SpeculativeGenerator(model, tok, drafter)
    counts = torch.zeros(E2E_VOCAB, dtype=torch.long)
    forwards = 0
    for seed in range(n):  # 2 new tokens: with a budget of 1 the engine would trim every draft away
        r = gen.generate(input_ids=prompt, max_new_tokens=2, seed=seed, temperature=0.7, top_k=5)
        counts[r.token_ids[0]] += 1
        forwards += r.stats.target_forwards
    assert forwards < 1.95 * n  # drafts were accepted
    p0 = Sampling(0.7, 5).probs(tiny.full_logits(model, prompt)[-1])
    pv = gof(counts, p0)
    if broken:
        assert pv < 1e-3, f"the chi-square test failed to catch a drafter that lies about q (p = {pv:.2e})"
    else:
        assert pv > PASS_P, f"dynamic-tree output does not follow the target (chi-square p = {pv:.2e})"


# ---- command line -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = tiny.make_model("llama", seed=0)
    tk = tiny.make_tokenizer()
    target.save_pretrained(root / "target")
    tk.save_pretrained(root / "target")
    tiny.noisy_copy(target, 0.1).save_pretrained(root / "draft")
    tk.save_pretrained(root / "draft")
    calib = root / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [f"w{i} w{i + 3} w{i + 1}"]})
                               for i in range(3)))
    return root


def _run(capsys, *argv):
    from hydraspec.cli import main

    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_build_tree_draft_model_end_to_end(saved, tmp_path, capsys):
    out = tmp_path / "tree.json"
    rc, stdout, err = _run(capsys, "build-tree", "--model", saved / "target", "--dtype", "float32",
                           "--draft-model", saved / "draft", "--prompts", saved / "calib.jsonl", "--max-nodes", 5,
                           "--method", "simulate", "--select", "measure", "--reps", 1, "--confirm", 2,
                           "--max-new-tokens", 16, "--max-depth", 3, "--plot", "--out", out)
    assert rc == 0, err
    assert "calib:0, calib:1, calib:2" in err  # the calibration prompts used are printed...
    d = json.loads(out.read_text())
    assert d["calibration"]["prompts"] == ["calib:0", "calib:1", "calib:2"]  # ...and recorded
    assert d["calibration"]["files"] == [str(saved / "calib.jsonl")]
    for key in ("paths", "sizes", "measured_on", "method", "select", "order"):
        assert key in d
    assert {"machine", "dtype", "batch_size", "device"} <= set(d["measured_on"])
    # no --draft-confidence: the stop is chosen with the tree among the default candidates
    from hydraspec.trees.build import DEFAULT_STOPS

    assert [s["confidence"] for s in d["stops"]] == list(DEFAULT_STOPS)
    assert d["drafter"]["confidence"] in DEFAULT_STOPS
    row = d["sizes"][0]
    for key in ("nodes", "expected_tokens_per_step", "step_s", "predicted_tokens_per_s", "measured_tokens_per_s"):
        assert key in row
    png = tmp_path / "tree.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    common = ["generate", "--model", saved / "target", "--dtype", "float32", "--prompt", "w5 w6 w7",
              "--max-new-tokens", 16, "--json"]
    _, ar, _ = _run(capsys, *common)
    rc, tr, err = _run(capsys, *common, "--method", "draft", "--draft-model", saved / "draft", "--tree", out)
    assert rc == 0, err
    rc, dy, err = _run(capsys, *common, "--method", "draft", "--draft-model", saved / "draft", "--tree", "dynamic",
                       "--tree-nodes", 6, "--tree-depth", 3)
    assert rc == 0, err
    assert json.loads(tr)["token_ids"] == json.loads(dy)["token_ids"] == json.loads(ar)["token_ids"]


def test_cli_build_tree_heads_and_errors(saved, tmp_path, capsys):
    from hydraspec.heads import save_heads
    from hydraspec.models import load_model

    model, _ = load_model(str(saved / "target"), dtype="float32", device="cpu")
    save_heads(noisy_heads(model, "hydra", num_heads=2, scale=0.3), tmp_path / "heads",
               base_model=str(saved / "target"))
    out = tmp_path / "t.json"
    base = ["build-tree", "--model", saved / "target", "--dtype", "float32", "--heads", tmp_path / "heads",
            "--prompts", saved / "calib.jsonl", "--max-new-tokens", 12, "--out", out]
    rc, _, err = _run(capsys, *base, "--method", "medusa", "--select", "none", "--max-nodes", 4)
    assert rc == 0, err
    d = json.loads(out.read_text())
    assert d["nodes"] == 4 and d["drafter"]["kind"] == "hydra" and max(len(p) for p in d["paths"]) <= 2
    common = ["generate", "--model", saved / "target", "--dtype", "float32", "--prompt", "w5 w6 w7",
              "--max-new-tokens", 10, "--json"]
    _, ar, _ = _run(capsys, *common)
    rc, hy, err = _run(capsys, *common, "--method", "hydra", "--heads", tmp_path / "heads", "--tree", out)
    assert rc == 0, err
    assert json.loads(hy)["token_ids"] == json.loads(ar)["token_ids"]
    rc, hy, err = _run(capsys, *common, "--method", "hydra", "--heads", tmp_path / "heads", "--tree", "dynamic",
                       "--tree-nodes", 5)
    assert rc == 0, err
    assert json.loads(hy)["token_ids"] == json.loads(ar)["token_ids"]
    # errors: too deep for the heads, a broken tree file, no drafter
    rc, _, err = _run(capsys, *base, "--max-depth", 3, "--select", "none")
    assert rc == 2 and "exceeds the number of heads (2)" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"paths": [[0], [1, 1]]}))
    rc, _, err = _run(capsys, *common, "--method", "hydra", "--heads", tmp_path / "heads", "--tree", bad)
    assert rc == 2 and "has no parent path [1]" in err
    with pytest.raises(SystemExit):
        _run(capsys, "build-tree", "--model", saved / "target", "--prompts", saved / "calib.jsonl", "--out", out)
    assert "one of the arguments --heads --draft-model is required" in capsys.readouterr().err


def test_bench_takes_a_tree_file_and_dynamic_trees(tmp_path):
    import argparse

    from hydraspec.bench import add_parser, run_bench

    tk = tiny.make_tokenizer()
    target = tiny.cached_model("llama", "sdpa", 1)
    models = {"t": (target, tk), "d": (tiny.noisy_copy(target, 0.1), tk)}
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text(json.dumps({"question_id": 0, "category": "c", "turns": ["w1 w2 w3 w4"]}))
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps({"format": "hydraspec-tree", "paths": [[0], [1], [0, 0]]}))
    for spec in ([str(tree)], ["dynamic", "--tree-nodes", "5", "--tree-depth", "3"]):
        p = argparse.ArgumentParser()
        add_parser(p.add_subparsers(dest="cmd"))
        out = tmp_path / f"run-{spec[0][-4:]}"
        args = p.parse_args(["bench", "--model", "t", "--draft-model", "d", "--methods", "ar,draft", "--tree", *spec,
                             "--prompts", str(prompts), "--max-new-tokens", "12", "--dtype", "float32",
                             "--device", "cpu", "--out", str(out)])
        assert run_bench(args, loader=lambda name, dtype, device: models[name]) == 0
        s = json.loads((out / "results.json").read_text())["summary"]
        assert s["table"]["draft"]["overall"]["identical_share"] == 1.0
        assert s["table"]["draft"]["overall"]["mean_accepted"] > 1.0


def test_time_steps_advances_by_the_accepted_path(tok):
    """The draft model's catch-up between steps follows the accepted count: after accepting k nodes of
    a chain it holds prefix + k tokens in its cache, and then feeds only the target's token."""
    from hydraspec.drafters import make_drafter
    from hydraspec.trees.measure import time_steps

    model = tiny.cached_model("llama", "sdpa", 1)
    draft = tiny.noisy_copy(model, 0.1)
    seq = PROMPT + [3, 4, 8, 6, 2, 9, 1, 5, 7, 3, 4, 8, 6, 2, 9, 1]
    order = [[0], [0, 0], [0, 0, 0], [1]]
    made = []

    def make(paths):
        made.append(make_drafter("draft", draft_model=draft, tree=paths))
        return made[-1]

    out = time_steps(model, make, order, seq, len(PROMPT), [3, 4], reps=2, want_hidden=False, accepted={3: 2, 4: 9})
    assert set(out) == {3, 4} and all(v > 0 and d > 0 for v, d in out.values())
    # 3 reps of T3 accepting 2 nodes each: the draft cache grew by 3 tokens per step (2 kept + 1 fed)
    n_cached = [next(iter(d.rows.rows.values()))[1].n_cached for d in made]  # each drafter's one sequence
    assert n_cached[0] == len(PROMPT) + 3 * 2 + 2
    # T4 (BFS: [0], [1], [0,0], [0,0,0]): the rank-0 chain is nodes 0, 2, 3, so 9 is capped at 3 and
    # the sequence grows by 4 per step; the deepest node was never fed to the draft model, so each step
    # keeps 2 cached nodes and feeds 2 tokens: 6 -> 8, 10 -> 12, 14 -> 16
    assert n_cached[1] == len(PROMPT) + 2 * 4 + 2


def test_cli_build_tree_refuses_a_bad_draft_confidence_before_loading(tmp_path, capsys):
    rc, _, err = _run(capsys, "build-tree", "--model", tmp_path / "m", "--draft-model", tmp_path / "d",
                      "--draft-confidence", "0.4,1.5", "--prompts", tmp_path / "p.jsonl", "--out", tmp_path / "t.json")
    assert rc == 2 and "must be in [0, 1)" in err


def test_cli_build_tree_refuses_draft_confidence_with_heads(tmp_path, capsys):
    rc, _, err = _run(capsys, "build-tree", "--model", tmp_path / "m", "--heads", tmp_path / "h",
                      "--draft-confidence", "0.4", "--prompts", tmp_path / "p.jsonl", "--out", tmp_path / "t.json")
    assert rc == 2 and "--draft-confidence applies to a --draft-model only" in err


# ---- the confidence stop chosen with the tree ------------------------------------------------------


def test_stop_candidates_parsing():
    from hydraspec.trees.build import DEFAULT_STOPS, stop_candidates

    assert stop_candidates(None) == [None]
    assert stop_candidates("auto") == list(DEFAULT_STOPS)
    assert stop_candidates("0.4, 0.8,0.4") == [0.4, 0.8]
    assert stop_candidates(0.5) == [0.5] and stop_candidates([0, 0.9]) == [0.0, 0.9]
    for bad in ("1", "x", "", [], [-0.1]):
        with pytest.raises(HydraspecError):
            stop_candidates(bad)


def test_build_tree_grows_and_ranks_a_tree_per_stop(tok):
    """Several stops: a tree grown and predicted for each, "stops" sums them up, and the chosen stop is
    recorded. The draft model equals the target but a tiny random model is never 99.9 % sure: without a
    stop every step accepts the whole 3-level chain (4 tokens), with 0.999 only the first level (2)."""
    model = tiny.cached_model("llama", "sdpa", 1)
    res = build_tree(model, tok, prompt_ids=[PROMPT], prompt_names=["p"], max_nodes=3, method="simulate",
                     select="measure", draft_model=tiny.noisy_copy(model, 0.0), depth=3, max_new_tokens=12,
                     confirm=6, reps=1, draft_confidence=[0.0, 0.999], log=lambda m: None)
    by_stop = {s["confidence"]: s for s in res["stops"]}
    assert set(by_stop) == {0.0, 0.999}
    assert max(r["expected_tokens_per_step"] for r in res["sizes"]) == (4.0 if res["drafter"]["confidence"] == 0.0
                                                                       else 2.0)
    assert by_stop[0.999]["expected_tokens_per_step"] == 2.0 and by_stop[0.999]["drafted_nodes"] == 1.0
    # all six (stop, size) pairs were confirmed; the recorded stop and tree are the fastest measured
    chosen = next(r for r in res["sizes"] if r["nodes"] == res["nodes"])
    assert all(s["measured_tokens_per_s"] <= chosen["measured_tokens_per_s"] for s in res["stops"])
    assert res["default"]["tree"] == "the adaptive-length chain" and "confidence" not in res["default"]


def test_a_tree_json_carries_its_stop_into_decoding(tmp_path):
    from hydraspec.tree import tree_stop

    model = tiny.cached_model("llama", "sdpa", 1)
    spec = {"paths": [[0], [0, 0]], "drafter": {"kind": "draft", "confidence": 0.7}}
    f = tmp_path / "tree.json"
    f.write_text(json.dumps(spec))
    assert tree_stop(f) == tree_stop(str(f)) == tree_stop(spec) == 0.7
    assert DraftModelDrafter(model, tree=str(f)).confidence == 0.7
    assert DraftModelDrafter(model, tree=spec, confidence=0.2).confidence == 0.2  # asked for: wins
    assert DraftModelDrafter(model, tree=[[0], [0, 0]]).confidence == 0.0  # plain paths: no stop
    assert tree_stop({"paths": [[0]], "drafter": {"kind": "hydra"}}) is None
    assert tree_stop("dynamic") is None
    with pytest.raises(HydraspecError, match=r"drafter.confidence must be in \[0, 1\)"):
        tree_stop({"paths": [[0]], "drafter": {"kind": "draft", "confidence": 2}})


def test_trees_side_by_side_keep_their_paths_and_any_breadth_first_cut_keeps_a_prefix_of_each():
    from hydraspec.tree import DraftTree, shape_of, side_by_side

    a = DraftTree(torch.tensor([10, 11, 12]), (-1, 0, 1))  # a chain
    b = DraftTree(torch.tensor([20, 21, 22]), (-1, -1, 0))  # two top nodes, one with a child
    joined, owner = side_by_side([a, b])
    shape = shape_of(joined.with_root())  # raises unless breadth-first

    def paths(t):
        s = shape_of(t.with_root())
        return {tuple(int(t.tokens[j - 1]) for j in s.path_to(i + 1)[1:]) for i in range(len(t))}

    assert paths(joined) == paths(a) | paths(b) and owner.count(0) == 3 and owner.count(1) == 3
    assert shape.depth.tolist() == sorted(shape.depth.tolist())
    for k in range(len(joined) + 1):
        cut = owner[:k]
        for i, t in enumerate((a, b)):
            mine = [int(joined.tokens[j]) for j in range(k) if cut[j] == i]
            assert mine == t.tokens[:len(mine)].tolist()
