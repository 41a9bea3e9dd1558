"""Compiled decode steps (hydraspec.cpu.graph): torch.compile over the stock classes with the native kernels as
operators computes the same logits, bit for bit, as the eager step, so every method's answer is unchanged."""
import os

import pytest
import torch

from hydraspec import SpeculativeGenerator, make_drafter

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("HYDRASPEC_SKIP_SLOW") == "1", reason="HYDRASPEC_SKIP_SLOW=1"),
]

PROMPT = " ".join(f"w{i}" for i in (5, 9, 12, 5, 9, 30, 31, 32, 5, 9, 12, 40, 41, 7, 7, 3, 2, 50, 51, 5, 9))


def _graph_or_skip():
    from hydraspec.cpu import graph

    why = graph.available()
    if why is not None:
        pytest.skip(why)
    return graph


def _tiny_gguf_model(path):
    """The one-layer llama GGUF of tests/test_gguf.py at its precision, as load_model builds a GGUF model."""
    from transformers import LlamaConfig

    from hydraspec.backend import fuse_ops
    from hydraspec.cpu.attention import register
    from hydraspec.cpu.gguf_load import build_model

    config = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    model = build_model(path, config, torch.bfloat16, register(), progress=False).eval()
    fuse_ops(model)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A small GGUF model (random weights of five block types) at its precision twice: eager, and with compiled
    steps (compiled once for the module: a one-layer graph compiles in seconds, where SmolLM2's took minutes)."""
    import tiny
    from test_gguf import _write_tiny_llama

    from hydraspec.models import compile_models

    _graph_or_skip()
    torch.set_num_threads(2)
    path = tmp_path_factory.mktemp("graph") / "tiny.gguf"
    _write_tiny_llama(path, ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1"])
    eager, compiled = _tiny_gguf_model(path), _tiny_gguf_model(path)
    compile_models(compiled)  # as loading does: the step graphs compiled now, on a scratch cache
    assert getattr(compiled, "hs_compiled", False) and not getattr(eager, "hs_compiled", False)
    return eager, compiled, tiny.make_tokenizer(64)


@torch.inference_mode()  # as the engine runs the model: the graphs compiled at load apply
def test_compiled_steps_give_the_eager_logits_bit_for_bit(pair):
    """Prefill eagerly, then 12 one-token steps (with and without a mask, as the engine and a draft model call
    them): every step's logits equal the eager model's exactly."""
    from hydraspec.cache import new_cache
    from hydraspec.verify import forward_nodes, tree_mask

    eager, compiled, tok = pair
    ids = torch.tensor(tok(PROMPT).input_ids)
    caches = [new_cache(m, 128) for m in (eager, compiled)]
    nxt = []
    for m, c in zip((eager, compiled), caches):
        lg, _ = forward_nodes(m, c, ids, torch.arange(len(ids)), None, 0, last_only=True)
        nxt.append(lg[-1].argmax())
    assert nxt[0] == nxt[1]
    token = nxt[0]
    for step in range(12):
        pos = torch.tensor([len(ids) + step])
        out = []
        for m, c in zip((eager, compiled), caches):
            if step % 2:  # the engine's calls carry a mask over the cache
                anc = torch.ones(1, 1, dtype=torch.bool)
                lg, _ = forward_nodes(m, c, token.view(1), pos, anc, len(ids) + step)
            else:
                lg, _ = forward_nodes(m, c, token.view(1), pos, None, 0, last_only=True)
            out.append(lg[-1])
        assert torch.equal(out[0], out[1]), step
        token = out[0].argmax()


@torch.inference_mode()
def test_two_compiled_models_of_one_class_each_run_their_own_graphs(pair, tmp_path):
    """A second model of the same class with other weight types (as a draft model beside its target): the
    compiled steps leave out the guards on the modules, yet each model's steps, interleaved, give its own
    eager logits exactly."""
    from test_gguf import _write_tiny_llama

    from hydraspec.cache import new_cache
    from hydraspec.models import compile_models
    from hydraspec.verify import forward_nodes

    path = tmp_path / "other.gguf"
    _write_tiny_llama(path, ["Q8_0", "Q5_1", "Q4_0", "Q5_K"])
    eager2, compiled2 = _tiny_gguf_model(path), _tiny_gguf_model(path)
    compile_models(compiled2)
    eager, compiled, _ = pair
    models = [eager, compiled, eager2, compiled2]
    caches = [new_cache(m, 64) for m in models]
    ids = torch.tensor([1, 5, 9, 33, 2, 7])
    for m, c in zip(models, caches):
        forward_nodes(m, c, ids, torch.arange(len(ids)), None, 0, last_only=True)
    for step in range(6):
        pos = torch.tensor([len(ids) + step])
        out = [forward_nodes(m, c, torch.tensor([3 + step]), pos, None, 0, last_only=True)[0][-1]
               for m, c in zip(models, caches)]
        assert torch.equal(out[0], out[1]) and torch.equal(out[2], out[3]), step
        assert not torch.equal(out[0], out[2])


@torch.inference_mode()  # as the engine runs the model: the graphs compiled at load apply
def test_compiled_verify_forwards_give_the_eager_logits_bit_for_bit(pair, monkeypatch):
    """Forwards of several new tokens (a chain without a mask, a tree under its mask, 2 to MAX_ROWS rows) run
    compiled and give the eager model's logits exactly (and, asked for, its last hidden state); a longer forward
    runs eagerly."""
    from hydraspec.cache import new_cache, set_length
    from hydraspec.cpu import graph
    from hydraspec.cpu.graph import MAX_ROWS
    from hydraspec.verify import forward_nodes

    rows_run = []  # the sizes of the forwards that went through the compiled graph
    run = graph._run
    monkeypatch.setattr(graph, "_run", lambda compiled, past, cache, **kw: rows_run.append(kw["input_ids"].shape[1])
                        or run(compiled, past, cache, **kw))

    eager, compiled, tok = pair
    prompt = torch.tensor(tok(PROMPT + " " + PROMPT).input_ids)
    assert len(prompt) > MAX_ROWS  # so the prefill runs eagerly
    caches = [new_cache(m, 256) for m in (eager, compiled)]
    for m, c in zip((eager, compiled), caches):
        forward_nodes(m, c, prompt, torch.arange(len(prompt)), None, 0, last_only=True)
    L = len(prompt)
    gen = torch.Generator().manual_seed(0)
    for n in (2, 5, 3, MAX_ROWS, 7):
        ids = torch.randint(0, 64, (n,), generator=gen)
        if n % 2:  # a tree: node i hangs under node (i - 1) // 2
            parent = [-1] + [(i - 1) // 2 for i in range(1, n)]
            anc = torch.eye(n, dtype=torch.bool)
            depth = torch.zeros(n, dtype=torch.long)
            for i in range(1, n):
                anc[i] |= anc[parent[i]]
                depth[i] = depth[parent[i]] + 1
        else:  # a chain, under the model's own causal mask
            anc, depth = None, torch.arange(n)
        out = []
        want = n == 5  # draft heads ask for the last hidden state too: the graph that returns it
        for m, c in zip((eager, compiled), caches):
            set_length(c, L)
            out.append(forward_nodes(m, c, ids, L + depth, anc, L, want_hidden=want))
        assert torch.equal(out[0][0], out[1][0]), n
        if want:
            assert torch.equal(out[0][1], out[1][1])
    assert rows_run == [2, 5, 3, MAX_ROWS, 7]  # every one of them ran compiled (the prefill did not)


def test_every_method_answers_as_plain_decoding_with_compiled_steps(pair):
    """With compiled steps and verify forwards and eager prefills mixed in one answer, speculation still
    returns plain decoding's tokens, and those are the eager model's."""
    eager, compiled, tok = pair
    ref = SpeculativeGenerator(eager, tok).generate(PROMPT, max_new_tokens=64, chat=False)
    ar = SpeculativeGenerator(compiled, tok).generate(PROMPT, max_new_tokens=64, chat=False)
    assert ar.token_ids == ref.token_ids
    for drafter in (make_drafter("pld"), make_drafter("draft", draft_model=compiled)):
        res = SpeculativeGenerator(compiled, tok, drafter).generate(PROMPT, max_new_tokens=64, chat=False)
        assert res.token_ids == ref.token_ids, drafter.name


@pytest.mark.parametrize("method", ["pld", "auto"])
def test_an_engine_built_outside_inference_mode_runs_the_graphs_compiled_at_load(pair, method, tmp_path,
                                                                                  monkeypatch):
    """The server builds its engine outside inference mode; its first request must reuse the two graphs
    compiled at load (no compile of a minute or more under a waiting client), and answer as plain decoding.
    ``auto`` measures the verify cost as it is built (before any request), through the same compiled steps."""
    from torch._dynamo.utils import counters

    from hydraspec.batch import BatchGenerator
    from hydraspec.drafters import make_auto
    from hydraspec.engine import Request

    monkeypatch.setenv("HYDRASPEC_HOME", str(tmp_path))  # the verify cost is measured here, not read from disk
    eager, compiled, tok = pair
    ref = SpeculativeGenerator(eager, tok).generate(PROMPT, max_new_tokens=24, chat=False)
    graphs = counters["stats"]["unique_graphs"]
    drafter = make_drafter("pld") if method == "pld" else make_auto(compiled)
    assert counters["stats"]["unique_graphs"] == graphs  # measuring the verify cost compiled nothing
    bg = BatchGenerator(compiled, tok, drafter)
    engine = bg.engine(rows=2, capacity=256)  # as hydraspec serve builds it: no inference mode around it
    ids = SpeculativeGenerator(compiled, tok).encode(PROMPT, chat=False)
    req = Request(ids, 24)
    engine.add(req)
    graphs, captured = counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"]
    while req.result is None:
        engine.step()
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled again
    assert counters["stats"]["calls_captured"] == captured  # (and no frame traced anew)
    assert req.result.token_ids == ref.token_ids


def test_compiled_steps_refuse_what_they_cannot_run_and_leave_the_model_alone():
    """A model not at a GGUF precision is refused with a reason and keeps its forward."""
    import tiny
    from hydraspec.backend import compile_steps

    _graph_or_skip()
    model = tiny.make_model("llama").to(torch.bfloat16)
    forward = model.forward
    why = compile_steps(model)
    assert why and "GGUF" in why
    assert model.forward == forward and not getattr(model, "hs_compiled", False)


def test_no_cxx_compiler_means_a_reason_not_an_error(tmp_path, monkeypatch):
    """Without a C++ compiler the operators are not built: a reason comes back (the steps then run eagerly)."""
    graph = _graph_or_skip()
    monkeypatch.setenv("HYDRASPEC_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    graph.available.cache_clear()
    try:
        why = graph.available()
        assert why is not None and "could not be built" in why
    finally:
        monkeypatch.undo()
        graph.available.cache_clear()
        assert graph.available() is None


def _tiny_w4a8_draft(path):
    """A one-layer llama GGUF (tests/test_gguf.py's) at GGUF precision, re-quantised to w4a8 with its output
    layer cut to 40 of 64 ids: the parts of the CPU default draft, small enough to compile in seconds."""
    from test_gguf import _write_tiny_llama
    from transformers import LlamaConfig

    from hydraspec.backend import fuse_ops
    from hydraspec.cpu.attention import register
    from hydraspec.cpu.gguf_load import build_model
    from hydraspec.draft_vocab import trim_draft_vocab
    from hydraspec.quantize import quantize_draft

    if not path.exists():
        _write_tiny_llama(path, ["Q4_K", "Q6_K", "Q4_1", "Q8_0"], output="Q6_K")
    config = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    model = build_model(path, config, torch.bfloat16, register(), progress=False).eval()
    trim_draft_vocab(model, 40, [])
    quantize_draft(model, "w4a8")
    fuse_ops(model)
    return model


def test_a_compiled_w4a8_draft_drafts_what_the_eager_one_drafts(tmp_path):
    """A w4a8 draft with a cut vocabulary (the CPU default for a GGUF draft) compiled: its one-token steps give
    the eager draft's logits bit for bit."""
    from hydraspec.backend import compile_steps
    from hydraspec.cache import new_cache
    from hydraspec.cpu.quantized import W4A8Linear
    from hydraspec.verify import forward_nodes

    _graph_or_skip()
    torch.set_num_threads(2)
    eager, compiled = _tiny_w4a8_draft(tmp_path / "tiny.gguf"), _tiny_w4a8_draft(tmp_path / "tiny.gguf")
    assert any(isinstance(m, W4A8Linear) for m in compiled.modules())
    assert compile_steps(compiled) is None
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    ids = torch.tensor([1, 5, 9, 33, 2, 7])
    caches = [new_cache(m, 64) for m in (eager, compiled)]
    token = None
    for m, c in zip((eager, compiled), caches):
        lg, _ = forward_nodes(m, c, ids, torch.arange(len(ids)), None, 0, last_only=True)
        token = lg[-1].argmax()
    for step in range(10):
        out = [forward_nodes(m, c, token.view(1), torch.tensor([len(ids) + step]), None, 0, last_only=True)[0][-1]
               for m, c in zip((eager, compiled), caches)]
        assert torch.equal(out[0], out[1]), step
        assert torch.isinf(out[0][40:]).all() and torch.isfinite(out[0][:40]).all()  # the cut head ran
        token = out[0].argmax()
    assert counters["stats"]["unique_graphs"] > graphs  # the steps did run compiled


@torch.inference_mode()
def test_a_target_compiled_with_hidden_states_beside_a_draft_of_its_class_runs_steps_of_any_prompt(tmp_path):
    """A target whose steps also hand out hidden states (for heads) compiled beside a draft model of the same
    class, as `auto` with heads and a draft model loads them: every step compiles as one graph (the hooks that
    capture hidden states, installed inside a graph, broke it, and the resumed half then failed beside the draft
    model's graphs), and one-token steps after prompts of several lengths, with and without the hidden states,
    give the eager logits exactly."""
    from test_gguf import _write_tiny_llama

    from hydraspec.cache import new_cache
    from hydraspec.models import compile_models
    from hydraspec.verify import forward_nodes

    _graph_or_skip()
    torch.set_num_threads(2)
    paths = [tmp_path / "target.gguf", tmp_path / "draft.gguf"]
    _write_tiny_llama(paths[0], ["Q4_K", "Q6_K", "Q8_0"])
    _write_tiny_llama(paths[1], ["Q8_0", "Q4_0", "Q5_K"])
    eager, target, draft = _tiny_gguf_model(paths[0]), _tiny_gguf_model(paths[0]), _tiny_gguf_model(paths[1])
    breaks = torch._dynamo.utils.counters["graph_break"]
    before = sum(breaks.values())
    compile_models(target, draft, hidden=True)
    assert sum(breaks.values()) == before, dict(breaks)  # each step one whole graph
    for n in (3, 7, 12):
        ids = torch.arange(1, n + 1) % 60
        caches = [new_cache(m, 64) for m in (eager, target, draft)]
        for m, c in zip((eager, target, draft), caches):
            forward_nodes(m, c, ids, torch.arange(n), None, 0, last_only=True)
        for step in range(4):
            pos, tok = torch.tensor([n + step]), torch.tensor([(5 * step + n) % 60])
            want = step % 2 == 1
            (ref, h0), (out, h1) = [forward_nodes(m, c, tok, pos, None, 0, want_hidden=want)
                                    for m, c in zip((eager, target), caches[:2])]
            forward_nodes(draft, caches[2], tok, pos, None, 0, last_only=True)
            assert torch.equal(ref, out), (n, step)
            assert not want or torch.equal(h0, h1), (n, step)


def test_the_steps_that_return_hidden_states_leave_out_the_guards_on_the_modules_too(tmp_path, monkeypatch):
    """Both step functions (plain, and returning the hidden states that heads read) are compiled with the guard
    filter that leaves out the guards on the model's modules. torch.compile takes the filter out of the options
    dict it is given; both compiles were handed one dict, so every step of heads and `auto` checked every
    guard on every call."""
    from test_gguf import _write_tiny_llama

    graph = _graph_or_skip()
    if "guard_filter_fn" not in graph.step_options():
        pytest.skip("this torch compiles the steps with every guard")
    path = tmp_path / "tiny.gguf"
    _write_tiny_llama(path, ["Q4_K", "Q8_0"])
    model = _tiny_gguf_model(path)
    compile = torch.compile
    given = []

    def spy(fn, **kw):
        given.append(kw.get("options", {}).get("guard_filter_fn"))
        return compile(fn, **kw)
    monkeypatch.setattr(torch, "compile", spy)
    assert graph.compile_steps(model) is None
    assert given == [graph.module_values_only] * 2
