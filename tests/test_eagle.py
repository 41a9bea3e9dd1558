"""EAGLE and EAGLE-3 heads: the drafter's cached, tree-masked forwards equal the head run afresh on each
draft's own sequence; training's guesses at depth k equal what drafting at depth k computes; drafting is
exact; checkpoints round-trip; training lowers the loss; EAGLE-3 heads load back in the speculators format."""
import math

import pytest
import torch

import tiny
from hydraspec import HydraspecError, SpeculativeGenerator, make_drafter
from hydraspec.cache import SpecCache
from hydraspec.drafters.base import DecodeState
from hydraspec.drafters.eagle import EagleDrafter
from hydraspec.features import features
from hydraspec.heads import build_heads, load_heads, save_heads
from hydraspec.sampling import Sampling

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]


KINDS = ["eagle", "eagle3"]


def _head(model, kind="eagle", **kw):
    return tiny.noisy_heads(model, kind, **kw)


@torch.no_grad()
def _features(model, ids):
    out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return features(model, out.hidden_states)[0], out.logits[0]


@torch.no_grad()
def _fresh(heads, embed, feats, toks):
    """The head's guess at the last of the pairs (feats[j], e(toks[j])), run afresh with a causal mask (an
    EAGLE-3 head's joined target layers fused first: the pairs after them hold its own outputs)."""
    feats = [heads.fc(f.to(heads.dtype)) if f.shape[-1] != heads.hidden else f for f in feats]
    return heads.step(torch.stack(feats), embed(torch.tensor(toks)), torch.arange(len(toks)))[-1]


@torch.no_grad()
def _reference_tree(heads, embed, feats, toks, paths):
    """Each node's token from the head run afresh on committed pairs + the node's own path: rank r of the
    parent's guess (a slow, obviously right drafter)."""
    out = {}
    for path in sorted(paths, key=len):
        f, t = list(feats), list(toks)
        y = _fresh(heads, embed, f, t)
        for i in range(1, len(path)):  # walk down: each drafted token becomes a pair with its parent's guess
            f.append(y)
            t.append(out[tuple(path[:i])])
            y = _fresh(heads, embed, f, t)
        order = heads.token_ids(heads.logits(0, y[None])[0].topk(path[-1] + 1).indices)
        out[tuple(path)] = int(order[path[-1]])
    return out


@pytest.mark.parametrize("capacity", [0, 32])  # a growing cache; slots written in place (the length known)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_drafted_tree_equals_fresh_runs_of_each_path(family, kind, capacity):
    model = tiny.cached_model(family, "sdpa", 1)
    embed = model.get_input_embeddings()
    heads = _head(model, kind, intermediate_size=40)
    drafter = EagleDrafter(heads, embed, TREE)
    seq = [5, 9, 2, 7, 7, 1, 3]
    hidden, _ = _features(model, seq)
    # step 1: the prompt seq[:5] committed, seq[5] pending; step 2: two more tokens committed
    state = DecodeState(tokens=seq[:6], prompt_len=5, sampling=Sampling(), new_hidden=hidden[:5], hidden=hidden[4],
                        capacity=capacity)
    for end in (5, 7):
        if end == 7:
            state.tokens, state.new_hidden, state.hidden = seq + [4], hidden[5:7], hidden[6]
        tree, = drafter.propose([state])
        ref = _reference_tree(heads, embed, list(hidden[:end]), state.tokens[1:end + 1], TREE)
        from hydraspec.tree import parents_from_paths

        parents, _ = parents_from_paths(TREE)
        assert tree.parents == parents
        got = {}
        for i, path in enumerate(TREE):
            got[tuple(path)] = int(tree.tokens[i])
        assert got == ref
        cache = drafter.rows.of(state).cache
        assert cache.get_seq_length() == end  # the tree's entries were dropped
        assert isinstance(cache, SpecCache) == (capacity > 0)
    assert len(set(got.values())) > 2  # the head guesses different tokens at different nodes


@pytest.mark.parametrize("kind", KINDS)
def test_training_guesses_equal_drafting_at_each_depth(kind):
    model = tiny.cached_model("llama", "sdpa", 1)
    embed = model.get_input_embeddings()
    heads = _head(model, kind)
    ids = [5, 9, 2, 7, 7, 1, 3, 8, 4, 6]
    hidden, _ = _features(model, ids)
    n = len(ids) - 2
    with torch.no_grad():
        guesses = heads.guesses(hidden[:n], embed(torch.tensor(ids[1:n + 1])), 3)
        for k, g in enumerate(guesses, start=1):
            for j in range(k - 1, n):
                c = j - k + 1  # the draft committed up to pair c, teacher-forced tokens after it
                f, t = list(hidden[:c + 1]), ids[1:c + 2]
                y = _fresh(heads, embed, f, t)
                for m in range(2, k + 1):
                    f.append(y)
                    t.append(ids[c + m])
                    y = _fresh(heads, embed, f, t)
                torch.testing.assert_close(g[j], y, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", ["eagle", "pld+eagle"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_eagle_drafting_is_exact(method, family, kind, tok):
    model = tiny.cached_model(family, "sdpa", 1)
    heads = _head(model, kind)
    for prompt in ([5, 9, 2, 7, 7, 1, 5, 9], [3]):
        ref = SpeculativeGenerator(model, tok).generate(input_ids=prompt, max_new_tokens=24)
        drafter = make_drafter(method, heads=heads, embed=model.get_input_embeddings(), tree=TREE)
        res = SpeculativeGenerator(model, tok, drafter).generate(input_ids=prompt, max_new_tokens=24)
        assert res.token_ids == ref.token_ids


def test_eagle_checkpoint_round_trip_and_refusals(tmp_path):
    model = tiny.cached_model("llama", "sdpa", 1)
    heads = _head(model, intermediate_size=24)
    save_heads(heads, tmp_path / "e", base_model="tiny-llama", tree=TREE)
    loaded, cfg = load_heads(tmp_path / "e", model)
    assert cfg["kind"] == "eagle" and cfg["intermediate_size"] == 24
    assert loaded.layers[0].mlp.gate_proj.out_features == 24
    f, e = torch.randn(5, model.config.hidden_size), torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded.step(f, e, torch.arange(5)), heads.step(f, e, torch.arange(5)))
    with pytest.raises(HydraspecError, match="exceeds the head's draft depth"):
        make_drafter("eagle", heads=loaded, embed=model.get_input_embeddings(), tree=[[0], [0, 0], [0, 0, 0],
                                                                                       [0, 0, 0, 0], [0, 0, 0, 0, 0]])
    with pytest.raises(HydraspecError, match="not 'dynamic'"):
        make_drafter("eagle", heads=loaded, embed=model.get_input_embeddings(), tree="dynamic")
    with pytest.raises(HydraspecError, match="holds eagle heads, not hydra heads"):
        make_drafter("hydra", heads=loaded, embed=model.get_input_embeddings())


@pytest.mark.parametrize("kind", KINDS)
def test_eagle_training_lowers_the_loss(tmp_path, tok, kind):
    """A few epochs on the model's own answers: the loss falls and the first depth guesses better than
    a fresh head on held-in data."""
    import json

    from hydraspec.train import train_heads

    model = tiny.cached_model("llama", "sdpa", 1)
    gen = SpeculativeGenerator(model, tok)
    rows = []
    for i in range(12):
        prompt = [(3 * i + k) % 90 + 1 for k in range(6)]
        rows.append({"id": f"t-{i}", "prompt_ids": prompt,
                     "answer_ids": gen.generate(input_ids=prompt, max_new_tokens=24).token_ids})
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train_heads(model, data, tmp_path / "out", kind=kind, num_heads=3, epochs=12, lr=1e-2, distill=True,
                heldout=0.0, progress=False, head_options={"intermediate_size": 64}, eagle={"steps": 2},
                cache_bytes=0)
    log = [json.loads(x) for x in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    # EAGLE-3's loss is a cross-entropy against the tiny model's nearly flat distribution (its floor, that
    # distribution's entropy, is most of it); EAGLE's is mostly the feature regression
    assert log[-1]["mean_loss"] < (0.7 if kind == "eagle" else 1.0) * log[0]["mean_loss"]
    heads, cfg = load_heads(tmp_path / "out", model)
    assert cfg["kind"] == kind and cfg["intermediate_size"] == 64
    drafter = make_drafter("eagle", heads=heads, embed=model.get_input_embeddings(), tree=[[0], [0, 0]])
    accepted = []
    for r in rows[:4]:
        res = SpeculativeGenerator(model, tok, drafter).generate(input_ids=r["prompt_ids"], max_new_tokens=24)
        assert res.token_ids == r["answer_ids"]
        accepted.append(res.stats.mean_accepted)
    assert sum(accepted) / 4 > 1.3  # trained on these very answers (a fresh head: about 1.0)


def test_min_prob_leaves_out_unlikely_nodes_and_stays_exact(tok):
    """With min_prob, the drafted tree is the full tree's nodes whose path probability under the head (the
    product of its softmax probabilities along the path) reaches the bound, with the same tokens; decoding
    with it is still exact."""
    from hydraspec.tree import parents_from_paths

    model = tiny.cached_model("llama", "sdpa", 1)
    embed = model.get_input_embeddings()
    heads = _head(model)
    seq = [5, 9, 2, 7, 7, 1, 3]
    hidden, _ = _features(model, seq)
    state = DecodeState(tokens=seq[:6], prompt_len=5, sampling=Sampling(), new_hidden=hidden[:5], hidden=hidden[4])
    full = EagleDrafter(heads, embed, TREE)
    tree, = full.propose([state])
    parents, _ = parents_from_paths(TREE)
    # path probabilities from fresh runs of the head along each path
    probs = {}
    for path in sorted(TREE, key=len):
        f, t = list(hidden[:5]), state.tokens[1:6]
        for i in range(len(path) - 1):
            f.append(_fresh(heads, embed, f, t))
            t.append(int(tree.tokens[TREE.index(path[:i + 1])]))
        p = heads.logits(0, _fresh(heads, embed, f, t)[None])[0].float().softmax(-1)
        token = int(tree.tokens[TREE.index(path)])
        probs[tuple(path)] = probs.get(tuple(path[:-1]), 1.0) * float(p[heads.token_ids(torch.arange(p.numel())) == token])
    # the bound sits strictly between two neighbouring distinct path probabilities near the median (their
    # geometric mean), at the widest such gap, so float rounding in the drafter cannot move a node across it
    values = sorted(set(probs.values()))
    middle = range(len(values) // 4, max(len(values) * 3 // 4, len(values) // 4 + 1))
    i = max((i for i in middle if i + 1 < len(values)), key=lambda i: values[i + 1] / values[i])
    assert values[i + 1] / values[i] > 1.01, values
    bound = math.sqrt(values[i] * values[i + 1])
    assert values[i] < bound < values[i + 1]
    pruned = EagleDrafter(heads, embed, TREE, min_prob=bound)
    small, = pruned.propose([state])
    keep = [i for i, path in enumerate(TREE) if all(probs[tuple(path[:j])] >= bound for j in range(1, len(path) + 1))]
    assert 0 < len(keep) < len(TREE)
    assert small.tokens.tolist() == [int(tree.tokens[i]) for i in keep]
    assert all((p < 0 and parents[i] < 0) or keep[p] == parents[i] for i, p in zip(keep, small.parents))
    for prompt in ([5, 9, 2, 7, 7, 1, 5, 9], [3]):
        ref = SpeculativeGenerator(model, tok).generate(input_ids=prompt, max_new_tokens=24)
        drafter = make_drafter("eagle", heads=heads, embed=embed, tree=TREE, min_prob=bound)
        assert SpeculativeGenerator(model, tok, drafter).generate(input_ids=prompt, max_new_tokens=24).token_ids == \
            ref.token_ids


def test_eagle_rows_of_a_batch_each_answer_as_alone(tok):
    """In batched decoding (and so in the server) each row keeps its own EAGLE cache: every row's greedy
    answer equals plain decoding of its prompt alone, while rows come and go."""
    from hydraspec.batch import BatchGenerator

    model = tiny.cached_model("qwen2", "sdpa", 1)
    heads = _head(model)
    prompts = [[5, 9, 2, 7, 7, 1, 5, 9], [3], [8, 8, 4, 2, 6], [11, 12]]
    refs = [SpeculativeGenerator(model, tok).generate(input_ids=p, max_new_tokens=16).token_ids for p in prompts]
    drafter = make_drafter("pld+eagle", heads=heads, embed=model.get_input_embeddings(), tree=TREE)
    res = BatchGenerator(model, tok, drafter).generate(input_ids=prompts, max_new_tokens=16, batch_size=2)
    assert [r.token_ids for r in res] == refs


def test_eagle3_checkpoint_keeps_its_layers_and_sets_the_models_features(tmp_path):
    model = tiny.cached_model("qwen2", "sdpa", 1)
    heads = _head(model, "eagle3", intermediate_size=24, feature_layers=[0, 2])
    save_heads(heads, tmp_path / "e3", base_model="tiny-qwen2", tree=TREE)
    build_heads("medusa", model)  # reads the last state again
    loaded, cfg = load_heads(tmp_path / "e3", model)
    assert cfg["kind"] == "eagle3" and cfg["feature_layers"] == [0, 2] and loaded.method == "eagle"
    hidden, _ = _features(model, [5, 9, 2, 7])
    assert hidden.shape[-1] == 2 * model.config.hidden_size  # the model's forwards now hand out both layers
    e = model.get_input_embeddings()(torch.tensor([9, 2, 7, 1]))
    with torch.no_grad():
        torch.testing.assert_close(loaded.step(hidden, e, torch.arange(4)), heads.step(hidden, e, torch.arange(4)))


def test_eagle3_heads_load_back_in_speculators_with_the_same_logits(tmp_path):
    """Exported in the speculators format and loaded by speculators' own Eagle3DraftModel: its logits at
    each training-time-test step equal the head's guesses at each depth (draft vocabulary mapped by d2t)."""
    pytest.importorskip("speculators")
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from hydraspec.heads.speculators_format import export_speculators

    model = tiny.cached_model("qwen2", "sdpa", 1)
    heads = _head(model, "eagle3", intermediate_size=40, vocab_subset=list(range(80, 20, -2))).float()
    model.save_pretrained(tmp_path / "base")  # the verifier speculators reads the embeddings from
    export_speculators(heads, model, tmp_path / "spec", base_model=str(tmp_path / "base"), dtype=torch.float32)
    cfg = Eagle3SpeculatorConfig.from_pretrained(tmp_path / "spec")
    cfg.transformer_layer_config._attn_implementation = "eager"  # flex attention wants a compiler on a CPU
    spec = Eagle3DraftModel.from_pretrained(tmp_path / "spec", config=cfg).eval()
    assert spec.config.eagle_aux_hidden_state_layer_ids == heads.feature_layers
    assert (spec.d2t + torch.arange(spec.d2t.numel())).tolist() == heads.subset.tolist()
    seq = [5, 9, 2, 7, 7, 1, 3, 8, 4, 6, 2, 9]
    hidden, _ = _features(model, seq)
    n, embed = len(seq) - 1, model.get_input_embeddings()
    toks = torch.tensor(seq[1:])
    got = []
    hook = spec.lm_head.register_forward_hook(lambda m, i, o: got.append(o[0]))
    with torch.no_grad():
        spec(hidden_states=hidden[None, :n].float(), input_ids=toks[None], document_ids=torch.zeros(1, n, dtype=torch.long),
             ttt_steps=3)
        ours = heads.guesses(hidden[:n], embed(toks), 3)
        for k in range(1, 4):  # speculators' step k at row j is the chain from j: our depth k at row j + k - 1
            torch.testing.assert_close(got[k - 1][:n - k + 1], heads.logits(0, ours[k - 1][k - 1:]),
                                       atol=1e-5, rtol=1e-4)
    hook.remove()
    assert got[0].argmax(-1).unique().numel() > 2  # logits that tell tokens apart


def test_heads_loaded_for_drafting_run_on_the_4bit_kernels_and_stay_exact(tmp_path, tok):
    """A bf16 CPU model's heads loaded to draft (``drafting=True``) run their layers as w4a8 (the draft models'
    kernels); their drafts change, the answers do not."""
    from hydraspec.cpu import kernels, quantized
    if kernels.int8_dot_lib() is None:
        pytest.skip("needs the native int8 kernel")
    model = tiny.make_model("qwen2", seed=3).to(torch.bfloat16)
    heads = _head(model, "eagle3", intermediate_size=64, feature_layers=[0, 1])
    save_heads(heads, tmp_path / "e3", base_model="tiny-qwen2", tree=TREE)
    loaded, _ = load_heads(tmp_path / "e3", model, drafting=True)
    kept, _ = load_heads(tmp_path / "e3", model)
    int8_layers = (quantized.W4A8Linear, quantized.W8A8Linear)
    assert sum(isinstance(m, int8_layers) for m in loaded.modules()) == 8  # fc, q/k/v/o, gate/up/down
    assert not any(isinstance(m, int8_layers) for m in kept.modules())
    for prompt in ([5, 9, 2, 7, 7, 1, 5, 9], [3]):
        ref = SpeculativeGenerator(model, tok).generate(input_ids=prompt, max_new_tokens=24)
        drafter = make_drafter("eagle", heads=loaded, embed=model.get_input_embeddings(), tree=TREE)
        res = SpeculativeGenerator(model, tok, drafter).generate(input_ids=prompt, max_new_tokens=24)
        assert res.token_ids == ref.token_ids
    hidden, _ = _features(model, [5, 9, 2, 7])  # the 4-bit layers compute what the bf16 ones do, roughly
    e = model.get_input_embeddings()(torch.tensor([9, 2, 7, 1]))
    with torch.no_grad():
        a, b = loaded.step(hidden, e, torch.arange(4)).float(), kept.step(hidden, e, torch.arange(4)).float()
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.8 and not torch.equal(a, b)


def test_a_following_head_in_auto_reads_every_committed_pair_and_stays_exact(tok):
    """Inside ``auto`` a following EAGLE drafter is asked every step, so its layer has read every committed
    pair whenever it proposes (asked only when chosen, it would skip the pairs of the steps between); the
    answers equal plain decoding's. (A sequence may stop following a head that does not pay on it, as this
    random one does not: that rule is off here, so that every step asks it.)"""
    from hydraspec.drafters import make_auto

    model = tiny.cached_model("qwen2", "sdpa", 1)
    heads = _head(model, "eagle3")
    follower = make_drafter("eagle", heads=heads, embed=model.get_input_embeddings(), tree=[[0]], follow=True)
    assert follower.cheap
    seen, propose_one = [], follower.propose_one

    def spy(row, state):
        tree = propose_one(row, state)
        seen.append((row.fed, len(state.tokens) - 1))
        return tree

    follower.propose_one = spy
    for prompt in ([5, 9, 2, 7, 7, 1, 5, 9], [3]):
        seen.clear()
        ref = SpeculativeGenerator(model, tok).generate(input_ids=prompt, max_new_tokens=24)
        auto = make_auto(model, {"eagle3": follower}, cost={1: 1.0, 16: 1.0})
        auto.row_evidence = float("inf")
        res = SpeculativeGenerator(model, tok, auto).generate(input_ids=prompt, max_new_tokens=24)
        assert res.token_ids == ref.token_ids
        assert len(seen) >= res.stats.target_forwards - 1
        assert all(fed == end for fed, end in seen), seen



def test_a_rotary_table_gives_what_the_rotary_embedding_computes():
    """Drafting heads and compiled steps look cos and sin up in a table kept on the rotary module (grown a block
    at a time) instead of computing them each step: the same values bit for bit at positions across a block's
    edge, in either dtype, for one row or several; under autograd, or with dynamic scaling, no table is kept."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from hydraspec.backend import rotary_at
    from hydraspec.cpu.ops import ROTARY_BLOCK

    def make(**rope):
        return LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32,
                                                max_position_embeddings=4 * ROTARY_BLOCK, **rope))
    rotary = make()
    with torch.no_grad():
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(1, 3, 64, dtype=dtype)
            for start in (0, 5, ROTARY_BLOCK - 2, 2 * ROTARY_BLOCK + 7):
                pos = torch.stack([torch.arange(start, start + 3), torch.arange(start + 1, start + 4)])
                want, got = rotary(x, pos), rotary_at(rotary, x, pos)
                assert all(torch.equal(a, b) for a, b in zip(want, got)), (dtype, start)
            assert rotary.hs_rotary_table[1].shape[0] == 3 * ROTARY_BLOCK and rotary.hs_rotary_table[0][0] == dtype
        dynamic = make(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
        rotary_at(dynamic, torch.randn(1, 1, 64), torch.tensor([[3]]))
        assert not hasattr(dynamic, "hs_rotary_table")
    fresh = make()
    rotary_at(fresh, torch.randn(1, 1, 64), torch.tensor([[3]]))
    assert not hasattr(fresh, "hs_rotary_table")
