"""Draft heads: module shapes and init, checkpoints, and exact greedy decoding with head drafters."""
import copy
import json

import pytest
import torch

import tiny
from hydraspec import HydraspecError, SpeculativeGenerator, make_drafter
from hydraspec.drafters.heads import HeadDrafter
from hydraspec.heads import build_heads, load_heads, save_heads

TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize("own", [False, True])
def test_fresh_medusa_head_equals_lm_head(own):
    model = tiny.cached_model("llama", "sdpa", 1)
    heads = build_heads("medusa", model, num_heads=3, num_layers=2, own_projection=own)
    h = torch.randn(5, model.config.hidden_size)
    ref = model.lm_head(h)
    for k in range(3):
        torch.testing.assert_close(heads.logits(k, h), ref)


def test_head_shapes_and_parameters():
    model = tiny.cached_model("llama", "sdpa", 1)
    d, v = model.config.hidden_size, model.config.vocab_size
    med = build_heads("medusa", model, num_heads=4)
    hyd = build_heads("hydra", model, num_heads=4, num_layers=2)
    h = torch.randn(6, d)
    for k in range(4):
        assert med.logits(k, h).shape == (6, v)
        assert hyd.logits(k, h, torch.randn(6, k + 1, d)).shape == (6, v)
    # a shared projection is not a parameter of the heads (small checkpoints)
    assert all(p.shape != (v, d) for p in med.parameters())
    own = build_heads("medusa", model, num_heads=2, own_projection=True)
    assert sum(p.shape == (v, d) for p in own.parameters()) == 2


def test_checkpoint_round_trip_and_refusals(tmp_path):
    model = tiny.cached_model("llama", "sdpa", 1)
    heads = build_heads("hydra", model, num_heads=3, num_layers=1)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_heads(heads, tmp_path / "h", base_model="tiny-llama", tree=TREE[:5])
    loaded, cfg = load_heads(tmp_path / "h", model, base_model="tiny-llama")
    assert cfg["default_tree"] == TREE[:5] and cfg["kind"] == "hydra"
    h, e = torch.randn(4, model.config.hidden_size), torch.randn(4, 2, model.config.hidden_size)
    torch.testing.assert_close(loaded.logits(1, h, e), heads.logits(1, h, e))
    with pytest.raises(HydraspecError, match="trained for 'tiny-llama', not 'other-model'"):
        load_heads(tmp_path / "h", model, base_model="other-model")
    other = tiny.make_model("llama", hidden=32, heads=4, kv_heads=2)
    with pytest.raises(HydraspecError, match="this model has hidden 32"):
        load_heads(tmp_path / "h", other)


class OracleHeads(torch.nn.Module):
    """Heads that cheat: they run the target itself on context + path, so their rank-0 guesses are
    the target's own greedy tokens. Used to prove tree filling and verification, not to be fast."""

    def __init__(self, model, kind, num_heads):
        super().__init__()
        self.model, self.kind, self.num_heads = model, kind, num_heads
        self.context: list[int] = []

    def logits(self, k, hidden, path_emb=None):
        rows = hidden.shape[0]
        if self.kind == "medusa":  # path-independent: roll the target out greedily along rank 0
            seq = list(self.context)
            for _ in range(k):
                seq.append(int(tiny.full_logits(self.model, seq)[-1].argmax()))
            return tiny.full_logits(self.model, seq)[-1].expand(rows, -1)
        out = []
        for r in range(rows):
            path = path_emb[r].argmax(-1).tolist()  # one-hot embeddings -> token ids
            out.append(tiny.full_logits(self.model, self.context[:-1] + path)[-1])
        return torch.stack(out)


class OracleDrafter(HeadDrafter):
    def propose(self, states):
        assert len(states) == 1  # the oracle heads read one row's context
        self.heads.context = list(states[0].tokens)
        return super().propose(states)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_head_drafters_are_exact_and_accept_oracle_drafts(kind, tok):
    model = tiny.cached_model("llama", "sdpa", 1)
    prompt = [5, 9, 2, 7, 7, 1]
    ref = SpeculativeGenerator(model, tok).generate(input_ids=prompt, max_new_tokens=20)
    onehot = lambda ids: torch.nn.functional.one_hot(ids, model.config.vocab_size).float()  # noqa: E731
    oracle = OracleDrafter(OracleHeads(model, kind, 4), onehot, TREE)
    res = SpeculativeGenerator(model, tok, oracle).generate(input_ids=prompt, max_new_tokens=20)
    assert res.token_ids == ref.token_ids
    assert res.stats.mean_accepted > 3.0  # the rank-0 chain of depth 4 is right every step
    # real (random) heads: still exact, whatever they propose
    heads = build_heads(kind, model, num_heads=4)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    drafter = make_drafter(kind, heads=heads, embed=model.get_input_embeddings(), tree=TREE)
    res = SpeculativeGenerator(model, tok, drafter).generate(input_ids=prompt, max_new_tokens=20)
    assert res.token_ids == ref.token_ids


def test_tree_deeper_than_heads_is_refused():
    model = tiny.cached_model("llama", "sdpa", 1)
    heads = build_heads("medusa", model, num_heads=2)
    with pytest.raises(HydraspecError, match="exceeds the number of heads"):
        make_drafter("medusa", heads=heads, embed=model.get_input_embeddings(), tree=[[0], [0, 0], [0, 0, 0]])


def test_medusa_format_round_trip(tmp_path):
    from hydraspec.heads.medusa_format import export_medusa, import_medusa

    model = tiny.cached_model("llama", "sdpa", 1)
    heads = build_heads("medusa", model, num_heads=3, num_layers=2)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    export_medusa(heads, tmp_path / "fd", base_model="tiny-llama")
    names = set(__import__("safetensors.torch").torch.load_file(str(tmp_path / "fd" / "medusa_lm_head.safetensors")))
    assert {"0.0.linear.weight", "0.1.linear.bias", "2.2.weight"} <= names
    back, cfg = import_medusa(tmp_path / "fd", model)
    assert cfg["base_model"] == "tiny-llama" and back.own_projection
    h = torch.randn(4, model.config.hidden_size)
    for k in range(3):
        torch.testing.assert_close(back.logits(k, h), heads.logits(k, h))
    other = tiny.make_model("llama", hidden=32, heads=4, kv_heads=2)
    with pytest.raises(HydraspecError, match="this model has hidden 32"):
        import_medusa(tmp_path / "fd", other)


def _perturb(module, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_prefix_layer_fresh_identity_and_incremental_equals_full(family):
    from hydraspec.heads.prefix import new_prefix_cache

    model = tiny.cached_model(family, "sdpa", 1)
    heads = build_heads("hydra", model, num_heads=2, num_layers=4, prefix_layer=True)
    h = torch.randn(9, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(heads.prefixed(h), h)  # fresh: identity, so fresh heads equal lm_head
        _perturb(heads.prefix)
        full = heads.prefixed(h)
        assert not torch.allclose(full, h, atol=1e-3)
        cache, start, pieces = new_prefix_cache(), 0, []
        for n in (4, 1, 3, 1):  # prefill, then steps that commit 1..3 tokens each, as in decoding
            pieces.append(heads.prefix(h[start:start + n], start, cache))
            start += n
        torch.testing.assert_close(torch.cat(pieces), full, atol=1e-5, rtol=1e-4)


def test_hydra_plus_plus_drafter_is_exact_and_checkpoint_round_trips(tok, tmp_path):
    model = tiny.cached_model("llama", "sdpa", 1)
    heads = build_heads("hydra", model, num_heads=4, num_layers=4, prefix_layer=True)
    _perturb(heads, 0.05, seed=1)
    save_heads(heads, tmp_path / "hpp", base_model="tiny-llama")
    loaded, cfg = load_heads(tmp_path / "hpp", model)
    assert cfg["prefix_layer"] is True and loaded.prefix is not None
    h = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded.prefixed(h), heads.prefixed(h))
    for prompt in ([5, 9, 2, 7, 7, 1], [3]):  # with a prefill, and with none (one-token prompt)
        ref = SpeculativeGenerator(model, tok).generate(input_ids=prompt, max_new_tokens=20)
        drafter = make_drafter("hydra", heads=loaded, embed=model.get_input_embeddings(), tree=TREE)
        res = SpeculativeGenerator(model, tok, drafter).generate(input_ids=prompt, max_new_tokens=20)
        assert res.token_ids == ref.token_ids


def test_int8_shipped_copy_loads_close_to_the_original_and_stays_exact(tok, tmp_path):
    """copy_heads(..., "int8") stores each matrix as int8 codes with a per-row scale (a quarter of the fp32
    size): loaded back, every weight is within half a code step of the original, and drafting with them is
    still exact."""
    model, heads, loaded, ratio = _copied_heads(tmp_path, "int8", tok)
    assert ratio < 0.35
    for (name, a), b in zip(heads.state_dict().items(), loaded.state_dict().values()):
        if a.is_floating_point() and a.ndim == 2:
            step = a.abs().amax(1, keepdim=True) / 127
            assert ((a - b).abs() <= step / 2 + 1e-6).all(), name


def _copied_heads(tmp_path, dtype: str, tok):
    """Perturbed Hydra heads of a tiny model saved, copied as ``dtype`` and loaded back; checks that drafting
    with the copy is exact. Returns (model, heads, the copy loaded, the copy's size over the fp32 file's)."""
    from hydraspec.heads.checkpoint import copy_heads

    model = tiny.cached_model("llama", "sdpa", 1)
    heads = build_heads("hydra", model, num_heads=4, num_layers=2, prefix_layer=True)
    _perturb(heads, 0.05, seed=2)
    save_heads(heads, tmp_path / "fp32", base_model="tiny-llama")
    copy_heads(tmp_path / "fp32", tmp_path / dtype, dtype)
    size = {n: (tmp_path / n / "heads.safetensors").stat().st_size for n in ("fp32", dtype)}
    loaded, _ = load_heads(tmp_path / dtype, model)
    ref = SpeculativeGenerator(model, tok).generate(input_ids=[5, 9, 2, 7], max_new_tokens=20)
    drafter = make_drafter("hydra", heads=loaded, embed=model.get_input_embeddings(), tree=TREE)
    assert SpeculativeGenerator(model, tok, drafter).generate(input_ids=[5, 9, 2, 7],
                                                              max_new_tokens=20).token_ids == ref.token_ids
    return model, heads, loaded, size[dtype] / size["fp32"]


def test_int4_shipped_copy_keeps_its_codes_when_loaded_and_stays_exact(tok, tmp_path):
    """copy_heads(..., "int4") stores each matrix as 4-bit codes with a scale per row and group of inputs (under
    a fifth of the fp32 size); loaded back, every weight is within half a code step of the original, quantising
    the loaded weights again (as the w4a8 drafting kernels do, from bf16) gives the stored codes, and drafting
    with them is still exact."""
    from safetensors.torch import load_file

    from hydraspec.heads.checkpoint import INT4_SCALE

    model, heads, loaded, ratio = _copied_heads(tmp_path, "int4", tok)
    assert ratio < 0.2
    stored = load_file(str(tmp_path / "int4" / "heads.safetensors"))
    assert any(k.endswith(INT4_SCALE) for k in stored)
    for (name, a), b in zip(heads.state_dict().items(), loaded.state_dict().values()):
        if name + INT4_SCALE in stored:
            scale = stored[name + INT4_SCALE].float()
            group = a.shape[1] // scale.shape[1]
            step = scale.repeat_interleave(group, dim=1)
            assert ((a - b).abs() <= step / 2 + a.abs() / 128 + 1e-6).all(), name
            assert torch.equal(_int4_codes(b, group), stored[name]), name


def _int4_codes(w, group):
    """4-bit codes of ``w`` by the w4a8 draft kernels' rule (absmax / 7 per group of inputs, from bf16), packed
    as copy_heads packs them."""
    g = w.to(torch.bfloat16).float().view(w.shape[0], -1, group)
    q = (torch.round(g / (g.abs().amax(-1, keepdim=True) / 7.0).clamp_min(1e-12)).clamp(-8, 7) + 8).to(torch.uint8)
    q = q.view(w.shape[0], -1, 2)
    return q[..., 0] | (q[..., 1] << 4)


def test_draft_vocabulary_heads_are_exact_greedy_and_lossless_q(tok, tmp_path):
    model = tiny.cached_model("llama", "sdpa", 1)
    v = model.config.vocab_size
    subset = list(range(0, v, 3))
    heads = build_heads("hydra", model, num_heads=3, vocab_subset=subset)
    assert heads.out_vocab == len(subset)
    h = torch.randn(4, model.config.hidden_size)
    e = torch.randn(4, 1, model.config.hidden_size)
    # a fresh head over the subset equals lm_head's rows of the subset
    torch.testing.assert_close(build_heads("medusa", model, num_heads=1, vocab_subset=subset).logits(0, h),
                               model.lm_head(h)[:, subset])
    _perturb(heads, 0.05, seed=2)
    save_heads(heads, tmp_path / "dv", base_model="tiny")
    loaded, cfg = load_heads(tmp_path / "dv", model)
    assert cfg["draft_vocab"] == len(subset) and loaded.subset.tolist() == subset
    torch.testing.assert_close(loaded.logits(0, h, e), heads.logits(0, h, e))
    p = torch.softmax(loaded.logits(0, h, e), -1)
    full = loaded.full_probs(p)
    assert full.shape == (4, v) and torch.allclose(full.sum(-1), torch.ones(4))
    assert full[:, 1].abs().sum() == 0 and torch.equal(full[:, subset], p)
    prompt = [5, 9, 2, 7, 7, 1]
    ref = SpeculativeGenerator(model, tok).generate(input_ids=prompt, max_new_tokens=20)
    drafter = make_drafter("hydra", heads=loaded, embed=model.get_input_embeddings(), tree=TREE[:5])
    res = SpeculativeGenerator(model, tok, drafter).generate(input_ids=prompt, max_new_tokens=20)
    assert res.token_ids == ref.token_ids
    tree, = drafter.propose([__import__("hydraspec.drafters.base", fromlist=["DecodeState"]).DecodeState(
        tokens=prompt, prompt_len=6, sampling=__import__("hydraspec.sampling", fromlist=["Sampling"]).Sampling(0.0, 0, 1.0),
        hidden=h[0], new_hidden=h[:1])])
    assert all(t % 3 == 0 for t in tree.tokens.tolist())  # drafts come from the draft vocabulary only
    with pytest.raises(ValueError, match="distinct token ids"):
        build_heads("medusa", model, vocab_subset=[1, 1, 2])


def test_dynamic_tree_with_prefix_layer_and_draft_vocab_is_exact(tok):
    from hydraspec.drafters.dynamic import DynamicHeadDrafter

    model = tiny.cached_model("llama", "sdpa", 1)
    heads = build_heads("hydra", model, num_heads=3, num_layers=2, prefix_layer=True,
                        vocab_subset=list(range(1, model.config.vocab_size, 2)))
    _perturb(heads, 0.05, seed=4)
    prompt = [5, 9, 2, 7, 7, 1]
    ref = SpeculativeGenerator(model, tok).generate(input_ids=prompt, max_new_tokens=20)
    drafter = DynamicHeadDrafter(heads, model.get_input_embeddings(), nodes=10, depth=3, topk=3)
    res = SpeculativeGenerator(model, tok, drafter).generate(input_ids=prompt, max_new_tokens=20)
    assert res.token_ids == ref.token_ids


class _FixedTree:
    """An inner drafter with a fixed tree, recording what it observes."""

    name, needs_hidden, max_nodes = "fixed", False, 3

    def __init__(self, tokens, parents):
        self.tokens, self.parents, self.seen = tokens, parents, []

    def propose(self, states):
        from hydraspec.tree import DraftTree

        return [DraftTree(torch.tensor(self.tokens), tuple(self.parents)) for _ in states]

    def observe(self, states, verdicts):
        self.seen.extend(list(v.accepted) for v in verdicts)


def test_lookup_hybrid_merges_the_chain_into_the_tree():
    from hydraspec.drafters.base import DecodeState, Verdict
    from hydraspec.drafters.hybrid import LookupHybridDrafter
    from hydraspec.drafters.prompt_lookup import PromptLookupDrafter
    from hydraspec.sampling import Sampling

    inner = _FixedTree([7, 8, 9], [-1, -1, 0])  # 7 -> 9, and 8
    hyb = LookupHybridDrafter(inner, PromptLookupDrafter(num_tokens=3, dynamic=False))
    # context ... 1 2 | 7 9 4 ... 1 2: lookup proposes 7 9 4; 7 and 9 exist in the tree, 4 hangs under 9
    state = DecodeState(tokens=[1, 2, 7, 9, 4, 5, 1, 2], prompt_len=8, sampling=Sampling())
    tree, = hyb.propose([state])
    assert tree.tokens.tolist() == [7, 8, 9, 4] and tree.parents == (-1, -1, 0, 2)
    hyb.observe([state], [Verdict([0, 2, 3], 4)])  # the whole chain was accepted
    assert inner.seen[-1] == [0, 2]
    # a chain that leaves the tree at once: 5 is not a root child, so all its tokens are new nodes
    state = DecodeState(tokens=[3, 5, 6, 3], prompt_len=4, sampling=Sampling())
    hyb.lookup.min_ngram = 1
    tree, = hyb.propose([state])
    assert tree.tokens.tolist() == [7, 8, 5, 9, 6, 3] and tree.parents == (-1, -1, -1, 0, 2, 4)
    hyb.observe([state], [Verdict([2, 4], 6)])
    assert inner.seen[-1] == []
    # sampling: one drafter's tree whole (the lookup chain when there is one)
    state = DecodeState(tokens=[3, 5, 6, 3], prompt_len=4, sampling=Sampling(temperature=0.7))
    assert hyb.propose([state])[0].tokens.tolist() == [5, 6, 3]
    state = DecodeState(tokens=[3, 5, 6, 4], prompt_len=4, sampling=Sampling(temperature=0.7))
    assert hyb.propose([state])[0].tokens.tolist() == [7, 8, 9]


@pytest.mark.parametrize("kind", ["medusa", "hydra", "hydra++"])
def test_lookup_hybrid_drafters_are_exact(kind, tok):
    model = tiny.cached_model("llama", "sdpa", 1)
    prompt = [5, 9, 2, 7, 7, 1, 5, 9, 2]
    ref = SpeculativeGenerator(model, tok).generate(input_ids=prompt, max_new_tokens=24)
    heads = build_heads(kind.rstrip("+"), model, num_heads=4, prefix_layer=kind == "hydra++")
    _perturb(heads)
    drafter = make_drafter(f"pld+{kind}", heads=heads, embed=model.get_input_embeddings(), tree=TREE,
                           pld_tokens=6)
    assert drafter.name == f"pld+{kind.rstrip('+')}" and drafter.max_nodes == len(TREE) + 6
    res = SpeculativeGenerator(model, tok, drafter).generate(input_ids=prompt, max_new_tokens=24)
    assert res.token_ids == ref.token_ids
    # with an oracle inner drafter, the merged tree still accepts the heads' right chains
    onehot = lambda ids: torch.nn.functional.one_hot(ids, model.config.vocab_size).float()  # noqa: E731
    from hydraspec.drafters.hybrid import LookupHybridDrafter

    oracle = LookupHybridDrafter(OracleDrafter(OracleHeads(model, "medusa", 4), onehot, TREE))
    res = SpeculativeGenerator(model, tok, oracle).generate(input_ids=prompt, max_new_tokens=24)
    assert res.token_ids == ref.token_ids and res.stats.mean_accepted > 3.0


def test_heads_know_their_base_by_its_weights(tmp_path):
    """A checkpoint records its base's fingerprint: the same weights load under any name or path (and in
    another dtype), other weights of the same shape are refused with a message that says so."""
    from hydraspec.heads import base_fingerprint, load_heads, save_heads

    model = tiny.cached_model("llama", "sdpa", 1)
    heads = build_heads("hydra", model, num_heads=2)
    save_heads(heads, tmp_path / "h", base_model="tiny-llama", base_fingerprint=base_fingerprint(model))
    load_heads(tmp_path / "h", model, base_model="/some/local/copy/of/tiny-llama")  # same weights, other name
    load_heads(tmp_path / "h", copy.deepcopy(model).to(torch.bfloat16), base_model="x")
    other = tiny.cached_model("llama", "sdpa", 2)  # same shape, other weights
    with pytest.raises(HydraspecError, match="other weights"):
        load_heads(tmp_path / "h", other, base_model="tiny-llama")


def test_generate_auto_takes_the_heads_shipped_for_an_offline_model_and_others_when_asked():
    """The Qwen 1.5B's shipped EAGLE-3 head (4-bit, under 25 MB, its training recorded) is what `generate
    --method auto` drafts with by default; `--heads shipped` names it for serve and bench; --heads none, other
    methods, a draft model and models without shipped heads leave --heads as given."""
    from argparse import Namespace

    from safetensors.torch import load_file

    from hydraspec.errors import HydraspecError
    from hydraspec.heads.checkpoint import INT4_SCALE
    from hydraspec.models import shipped_heads
    from hydraspec.options import resolve_heads_arg

    qwen = "qwen2.5-coder-1.5b-instruct"
    d = shipped_heads(qwen)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["base_model"] == qwen and cfg["kind"] == "eagle3" and cfg["base_fingerprint"]
    assert "train_command" in cfg and "train_prompts" in cfg
    assert (d / "heads.safetensors").stat().st_size < 25e6
    assert any(k.endswith(INT4_SCALE) for k in load_file(str(d / "heads.safetensors")))
    assert shipped_heads("smollm2-135m-instruct") is None and shipped_heads("some/dir") is None

    def heads(cmd="generate", **kw):
        args = Namespace(**{"cmd": cmd, "model": qwen, "heads": None, **kw})
        resolve_heads_arg(args)
        return args.heads

    assert heads(method="auto") == str(d)
    assert heads(method="auto", heads="none") is None
    assert heads(method="auto", heads="mine") == "mine"
    assert heads(method="pld") is None
    assert heads(method="auto", model="smollm2-135m-instruct") is None
    assert heads(method="auto", draft_model="qwen2.5-coder-0.5b-instruct") is None
    assert heads("serve", method="auto") is None and heads("serve", method="auto", heads="shipped") == str(d)
    assert heads("bench", methods="ar,auto") is None and heads("bench", heads=["shipped"]) == [str(d)]
    with pytest.raises(HydraspecError, match="no heads ship"):
        heads("serve", method="auto", heads="shipped", model="smollm2-135m-instruct")
