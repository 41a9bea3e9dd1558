"""hydraspec bench: statistics, prompt files, resume, and a short end-to-end run on tiny random models."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hydraspec import HydraspecError
from hydraspec.bench import add_parser, load_prompt_file, load_questions, parse_methods, run_bench
from hydraspec.bench import methods as bench_methods
from hydraspec.bench import report, stats

# -- statistics --------------------------------------------------------------------------------------


def _turn(n, wall, fw, ids=None):
    return {"new_tokens": n, "wall_s": wall, "target_forwards": fw,
            "token_ids": ids if ids is not None else list(range(n)),
            "prefill_s": 0.1, "draft_s": 0.0, "verify_s": wall - 0.1, "accept_s": 0.0}


def _rec(method, qid, cat, turns):
    return {"method": method, "question_id": qid, "category": cat, "turns": turns}


A, B = [5, 6, 7, 8], [1, 2, 3, 4, 5, 6]


def _records():
    return [
        _rec("ar", 1, "a", [_turn(10, 2.0, 10)]),
        _rec("ar", 2, "b", [_turn(4, 1.0, 4, A), _turn(6, 1.0, 6, B)]),
        _rec("pld", 1, "a", [_turn(10, 1.0, 5)]),
        _rec("pld", 2, "b", [_turn(4, 0.5, 2, A), _turn(6, 0.75, 3, [1, 2, 9, 4, 5, 6])]),
        _rec("hf-ar", 1, "a", [_turn(10, 2.5, 10)]),  # hf-ar only has question 1
        _rec("hf-pld", 1, "a", [_turn(10, 2.0, None)]),
    ]


def test_first_divergence():
    assert stats.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert stats.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert stats.first_divergence([1, 2], [1, 2, 3]) == 2
    assert stats.first_divergence([], []) is None


def test_summary_numbers():
    s = stats.summarize(_records(), ["ar", "pld", "hf-ar", "hf-pld"], temperature=0.0)
    assert s["reference"] == "ar" and s["categories"] == ["a", "b"]
    ar, pld, hfar, hfpld = (s["table"][m] for m in ("ar", "pld", "hf-ar", "hf-pld"))
    # ar: 20 tokens in 4 s
    assert ar["overall"]["new_tokens"] == 20 and ar["overall"]["tokens_per_s"] == pytest.approx(5.0)
    assert ar["overall"]["mean_accepted"] == pytest.approx(1.0)
    assert ar["overall"]["speedup_vs_ar"] == pytest.approx(1.0)
    # pld: 20 tokens in 2.25 s, 10 forwards
    o = pld["overall"]
    assert o["tokens_per_s"] == pytest.approx(20 / 2.25)
    assert o["mean_accepted"] == pytest.approx(2.0)
    assert o["target_forwards"] == 10 and o["turns"] == 3 and o["questions"] == 2
    assert o["speedup_vs_ar"] == pytest.approx((20 / 2.25) / 5.0)
    assert pld["categories"]["a"]["speedup_vs_ar"] == pytest.approx(2.0)
    assert pld["categories"]["b"]["speedup_vs_ar"] == pytest.approx((10 / 1.25) / (10 / 2.0))
    assert pld["categories"]["b"]["mean_accepted"] == pytest.approx(2.0)
    # over hf-ar only question 1 is shared: 10 tok/s vs 4 tok/s
    assert o["speedup_vs_hf_ar"] == pytest.approx(2.5)
    assert pld["categories"]["b"]["speedup_vs_hf_ar"] is None
    assert hfar["overall"]["speedup_vs_ar"] == pytest.approx(4.0 / 5.0)
    # identical answers: pld's 2nd turn of question 2 differs
    assert (o["identical"], o["compared"]) == (2, 3)
    assert o["identical_share"] == pytest.approx(2 / 3)
    assert pld["categories"]["a"]["identical_share"] == 1.0
    assert pld["categories"]["b"]["identical_share"] == 0.5
    assert ar["overall"]["identical_share"] == 1.0
    # forwards not exposed -> mean accepted None, speeds still known
    assert hfpld["overall"]["mean_accepted"] is None and hfpld["overall"]["target_forwards"] is None
    assert hfpld["overall"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert hfpld["overall"]["verify_s"] == pytest.approx(1.9)
    # later turns: question 2's second turn alone (ar 6 tokens in 1 s, pld in 0.75 s); hf-ar has none
    late = pld["later_turns"]
    assert late["turns"] == 1 and late["tokens_per_s"] == pytest.approx(8.0)
    assert late["speedup_vs_ar"] == pytest.approx(8.0 / 6.0) and hfar["later_turns"] is None


def test_summary_sampling_and_reference_fallback():
    recs = [r for r in _records() if r["method"] != "ar"]
    s = stats.summarize(recs, temperature=0.7, seed=11)
    assert s["reference"] == "hf-ar" and s["seed"] == 11 and not s["greedy"]
    assert s["table"]["pld"]["overall"]["speedup_vs_ar"] is None
    assert s["table"]["pld"]["overall"]["identical_share"] is None  # n/a when sampling
    assert s["methods"] == ["pld", "hf-ar", "hf-pld"]


def test_annotate_turns_and_context():
    recs = [
        _rec("ar", 1, "a", [_turn(3, 1.0, 3, [1, 2, 3]), _turn(2, 1.0, 2, [4, 5])]),
        _rec("pld", 1, "a", [_turn(3, 1.0, 2, [1, 7, 3]), _turn(2, 1.0, 1, [4, 5])]),
    ]
    ann = {r["method"]: r for r in stats.annotate(recs, "ar")}
    t0, t1 = ann["pld"]["turns"]
    assert (t0["same_as_ref"], t0["diverge_at"], t0["context_differs"]) == (False, 1, False)
    assert (t1["same_as_ref"], t1["diverge_at"], t1["context_differs"]) == (True, None, True)
    assert t0["ref_method"] == "ar" and ann["ar"]["turns"][0]["same_as_ref"] is True


def test_dedupe_keeps_last():
    recs = [_rec("ar", 1, "a", [_turn(1, 1.0, 1)]), _rec("ar", 1, "a", [_turn(2, 1.0, 2)])]
    assert [r["turns"][0]["new_tokens"] for r in stats.dedupe(recs)] == [2]


# -- prompt files ----------------------------------------------------------------------------------


def _write(path: Path, lines) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    return path


def test_prompt_file_parsing(tmp_path):
    p = _write(tmp_path / "mix.jsonl", [
        {"question_id": 7, "category": "", "turns": ["hi"], "reference": ["x"]},
        "",
        {"question_id": 8, "category": "math", "turns": ["one", "two"]},
        {"question_id": 9, "category": "math", "turns": ["three"]},
        {"turns": ["no id"]},
    ])
    qs = load_prompt_file(p)
    assert [q.question_id for q in qs] == [7, 8, 9, 3]
    assert [q.category for q in qs] == ["mix", "math", "math", "mix"]
    assert qs[1].turns == ("one", "two")
    assert [q.question_id for q in load_questions([p], limit=1)] == [7, 8]
    assert [q.question_id for q in load_questions([p], categories=["math"])] == [8, 9]
    q2 = _write(tmp_path / "other.jsonl", [{"question_id": 7, "turns": ["again"]}])
    both = load_questions([p, q2])
    assert [q.question_id for q in both] == ["mix-7", "mix-8", "mix-9", "mix-3", "other-7"]
    assert both[-1].category == "other"
    with pytest.raises(HydraspecError, match="known: mix, math"):
        load_questions([p], categories=["nope"])


@pytest.mark.parametrize("bad, message", [
    ("{not json", "line 3: not valid JSON"),
    ('{"question_id": 2}', "line 3: missing 'turns'"),
    ('{"question_id": 2, "turns": []}', "line 3: 'turns' is empty"),
    ('{"question_id": 2, "turns": "hello"}', "line 3: 'turns' must be a list of strings"),
    ('{"question_id": 2, "turns": ["a", 5]}', "line 3: 'turns' must be a list of strings"),
    ('[1, 2]', "line 3: expected a JSON object"),
    ('{"question_id": 1, "turns": ["dup"]}', "line 3: duplicate question_id 1 \\(first on line 1\\)"),
])
def test_prompt_file_errors(tmp_path, bad, message):
    p = _write(tmp_path / "bad.jsonl", ['{"question_id": 1, "turns": ["ok"]}', "", bad])
    with pytest.raises(HydraspecError, match=message) as e:
        load_prompt_file(p)
    assert "bad.jsonl" in str(e.value)


def test_missing_prompt_file(tmp_path):
    with pytest.raises(HydraspecError, match="cannot read prompt file"):
        load_prompt_file(tmp_path / "nope.jsonl")


def test_methods_registry_and_args():
    assert parse_methods("ar, pld,ar") == ["ar", "pld"]
    with pytest.raises(HydraspecError, match="unknown method 'beam'; known: ar, draft, pld, .*eagle.*hf-ar, hf-assisted, hf-pld, llamacpp-ar"):
        parse_methods("ar,beam")
    args = _parse(["--model", "m", "--prompts", "x.jsonl", "--out", "o"])
    assert args.methods == "ar,pld,hf-ar,hf-pld" and args.max_new_tokens == 128 and args.seed == 0
    assert args.func is not None and args.dtype == "bfloat16" and args.device == "auto"
    with pytest.raises(HydraspecError, match="only used by the auto, medusa, hydra and eagle methods"):
        run_bench(_parse(["--model", "m", "--prompts", "x.jsonl", "--out", "o", "--heads", "h"]))
    with pytest.raises(HydraspecError, match="medusa need --heads"):
        run_bench(_parse(["--model", "m", "--prompts", "x.jsonl", "--out", "o", "--methods", "ar,medusa"]))
    with pytest.raises(HydraspecError, match="need --draft-model"):
        run_bench(_parse(["--model", "m", "--prompts", "x.jsonl", "--out", "o", "--methods", "ar,hf-assisted,draft"]))


# -- end to end on tiny random models ------------------------------------------------------------

WORDS = ("the cat sat on the mat . a dog ran in the park and the cat saw the dog . "
         "what is two plus two ? tell me more about it please").split()


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
    vocab = {w: i for i, w in enumerate(specials + sorted(set(WORDS)))}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  additional_special_tokens=["<|user|>", "<|assistant|>"])
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return tok


def _model(vocab: int, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tiny():
    tok = _tokenizer()
    models = {"tiny": (_model(len(tok), 0), tok), "tiny-draft": (_model(len(tok), 1), tok)}
    calls = []

    def loader(name, dtype, device):
        calls.append(name)
        return models[name]

    loader.calls = calls
    return loader


@pytest.fixture
def prompts(tmp_path):
    return _write(tmp_path / "tiny.jsonl", [
        {"question_id": 0, "category": "", "turns": ["the cat sat on the mat . the cat"]},
        "",
        {"question_id": 1, "category": "chat", "turns": ["what is two plus two ?", "tell me more about it please"]},
    ])


def _parse(argv):
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd"))
    return p.parse_args(["bench", *argv])


def _bench_args(prompts, out, methods, *extra):
    return _parse(["--model", "tiny", "--methods", methods, "--prompts", str(prompts), "--max-new-tokens", "8",
                   "--dtype", "float32", "--device", "cpu", "--out", str(out), *extra])


def test_end_to_end(tiny, prompts, tmp_path):
    out = tmp_path / "run"
    args = _bench_args(prompts, out, "ar,pld,hf-ar,hf-pld,draft,hf-assisted", "--draft-model", "tiny-draft")
    assert run_bench(args, loader=tiny) == 0
    for name in ("records.jsonl", "results.json", "results.md", "speedup.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "speedup.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((out / "results.json").read_text())
    keys = {"platform", "cpu", "cores", "torch", "transformers", "hydraspec", "dtype", "device", "command"}
    assert keys <= set(data["machine"])
    assert data["machine"]["device"] == "cpu"
    s = data["summary"]
    assert s["methods"] == ["ar", "pld", "hf-ar", "hf-pld", "draft", "hf-assisted"]
    assert s["categories"] == ["tiny", "chat"]
    for m in ("pld", "draft"):
        assert s["table"][m]["overall"]["identical_share"] == 1.0, m
        assert s["table"][m]["overall"]["compared"] == 3
    assert s["table"]["hf-ar"]["overall"]["mean_accepted"] == 1.0
    assert s["table"]["hf-pld"]["overall"]["mean_accepted"] is None
    assert len(data["records"]) == 12
    rec = next(r for r in data["records"] if r["method"] == "pld" and r["question_id"] == 1)
    assert len(rec["turns"]) == 2 and rec["turns"][1]["same_as_ref"] is True
    assert all(1 <= t["new_tokens"] <= 8 for r in data["records"] for t in r["turns"])
    md = (out / "results.md").read_text()
    assert "| pld |" in md and "Speedup over hf-ar" in md and "Command:" in md
    for m in s["methods"]:
        rows = [json.loads(x) for x in (out / "answers" / f"{m}.jsonl").read_text().splitlines()]
        assert [r["question_id"] for r in rows] == [0, 1]
        ch = rows[1]["choices"][0]
        assert ch["index"] == 0 and len(ch["turns"]) == len(ch["new_tokens"]) == len(ch["wall_time"]) == 2
        assert len(ch["accept_lengths"]) == 2


def test_prefix_cache_reads_only_the_new_turn_and_changes_no_answer(tiny, prompts, tmp_path):
    """--prefix-cache: a second turn starts from the first turn's prompt and answer (per method), and every
    answer is the one read from scratch."""
    def answers(out):
        data = json.loads((out / "results.json").read_text())
        return {(r["method"], r["question_id"]): r["turns"] for r in data["records"]}
    plain, cached = tmp_path / "plain", tmp_path / "cached"
    assert run_bench(_bench_args(prompts, plain, "ar,pld"), loader=tiny) == 0
    assert run_bench(_bench_args(prompts, cached, "ar,pld", "--prefix-cache", "1000"), loader=tiny) == 0
    a, b = answers(plain), answers(cached)
    assert {k: [t["token_ids"] for t in v] for k, v in a.items()} == {k: [t["token_ids"] for t in v] for k, v in b.items()}
    for m in ("ar", "pld"):
        first, second = b[(m, 1)]
        assert first["cached_tokens"] == 0 and second["cached_tokens"] >= first["prompt_tokens"]
        assert all(t["cached_tokens"] == 0 for t in a[(m, 1)])


def test_resume_after_interrupt(tiny, prompts, tmp_path, monkeypatch):
    out = tmp_path / "resume"
    real = bench_methods.EngineRunner.generate
    calls = {"n": 0, "stop_at": 7}

    def counting(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == calls["stop_at"]:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(bench_methods.EngineRunner, "generate", counting)
    # 2 warm-ups, question 0 (ar, pld), question 1 turn 1 (ar, pld), then the 7th call is interrupted
    with pytest.raises(KeyboardInterrupt):
        run_bench(_bench_args(prompts, out, "ar,pld"), loader=tiny)
    lines = (out / "records.jsonl").read_text().splitlines()
    assert len(lines) == 3  # settings + (ar, 0) + (pld, 0)
    with open(out / "records.jsonl", "a") as f:  # a record cut off mid-write
        f.write('{"method": "ar", "question_id": 1, "cat')

    calls.update(n=0, stop_at=-1)
    assert run_bench(_bench_args(prompts, out, "ar,pld"), loader=tiny) == 0
    assert calls["n"] == 2 + 4  # warm-ups + two turns of question 1 for both methods
    recs = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()[1:]]
    assert sorted((r["method"], r["question_id"]) for r in recs) == [("ar", 0), ("ar", 1), ("pld", 0), ("pld", 1)]
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert summary["table"]["pld"]["overall"]["identical_share"] == 1.0

    calls.update(n=0)
    n_loads = len(tiny.calls)
    assert run_bench(_bench_args(prompts, out, "ar,pld"), loader=tiny) == 0
    assert calls["n"] == 0 and len(tiny.calls) == n_loads  # nothing left: no model loaded, nothing generated
    assert len((out / "records.jsonl").read_text().splitlines()) == 5

    with pytest.raises(HydraspecError, match="different settings.*max_new_tokens"):
        run_bench(_bench_args(prompts, out, "ar,pld", "--max-new-tokens", "16"), loader=tiny)
    with pytest.raises(HydraspecError, match="'pld' answers made with"):
        run_bench(_bench_args(prompts, out, "ar,pld", "--pld-tokens", "4"), loader=tiny)


def test_head_methods_in_the_bench(tiny, prompts, tmp_path):
    from hydraspec.heads import build_heads, save_heads

    model, _ = tiny("tiny", "float32", "cpu")
    save_heads(build_heads("medusa", model, num_heads=2), tmp_path / "m", base_model="tiny", tree=[[0], [1], [0, 0]])
    out = tmp_path / "heads-run"
    args = _bench_args(prompts, out, "ar,medusa", "--heads", str(tmp_path / "m"))
    assert run_bench(args, loader=tiny) == 0
    s = json.loads((out / "results.json").read_text())["summary"]
    assert s["table"]["medusa"]["overall"]["identical_share"] == 1.0
    md = (out / "results.md").read_text()  # no hf-ar in the run: no table of n/a against it
    assert "| medusa |" in md and "Speedup over hf-ar" not in md
    # several trees side by side: NAME@TREE variants, each recorded with its own tree
    (tmp_path / "t.json").write_text(json.dumps({"paths": [[0], [0, 0]]}))
    out2 = tmp_path / "trees-run"
    methods = f"ar,medusa@default,medusa@{tmp_path / 't.json'},medusa@dynamic"
    assert run_bench(_bench_args(prompts, out2, methods, "--heads", str(tmp_path / "m"), "--tree-nodes", "4",
                                 "--tree-depth", "2"), loader=tiny) == 0
    data = json.loads((out2 / "results.json").read_text())
    for m in methods.split(",")[1:]:
        assert data["summary"]["table"][m]["overall"]["identical_share"] == 1.0, m
    recs = [json.loads(x) for x in (out2 / "records.jsonl").read_text().splitlines()]
    trees = {r["method"]: r["settings"]["tree"] for r in recs[1:] if r["method"] != "ar"}
    assert trees["medusa@default"] is None and trees["medusa@dynamic"] == "dynamic"
    assert trees[f"medusa@{tmp_path / 't.json'}"] == str(tmp_path / "t.json")
    assert len(list((out2 / "answers").glob("*.jsonl"))) == 4
    with pytest.raises(HydraspecError, match="only methods that take a tree"):
        parse_methods("ar,pld@dynamic")


def test_skip_leaves_out_the_first_questions(tiny, tmp_path):
    """--skip N drops the first N questions of each category (those kept for calibration or training)."""
    p = _write(tmp_path / "four.jsonl", [{"question_id": i, "category": "c", "turns": [f"the cat {i} sat"]}
                                          for i in range(4)])
    out = tmp_path / "skip"
    assert run_bench(_bench_args(p, out, "ar", "--skip", "2", "--limit", "1"), loader=tiny) == 0
    data = json.loads((out / "results.json").read_text())
    assert [r["question_id"] for r in data["records"]] == [2]
    assert json.loads((out / "records.jsonl").read_text().splitlines()[0])["settings"]["skip"] == 2
    with pytest.raises(HydraspecError, match="--skip"):
        run_bench(_bench_args(p, tmp_path / "bad", "ar", "--skip", "-1"), loader=tiny)


def test_the_chat_categories_are_pooled_where_a_run_has_them():
    """The chat categories (writing, roleplay, ...) are also summed together: tokens over time of them all, over
    ar and over the best llama.cpp method; a run with fewer than two of them has no such row."""
    recs = [_rec("ar", 1, "writing", [_turn(10, 2.0, 10)]), _rec("ar", 2, "qa", [_turn(10, 1.0, 10)]),
            _rec("ar", 3, "math", [_turn(10, 1.0, 10)]),
            _rec("pld", 1, "writing", [_turn(10, 1.0, 5)]), _rec("pld", 2, "qa", [_turn(10, 1.0, 5)]),
            _rec("pld", 3, "math", [_turn(10, 0.1, 1)]),
            _rec("llamacpp-ar", 1, "writing", [_turn(10, 4.0, None)]),
            _rec("llamacpp-ar", 2, "qa", [_turn(10, 2.0, None)]),
            _rec("llamacpp-ar", 3, "math", [_turn(10, 1.0, None)])]
    s = stats.summarize(recs, ["ar", "pld", "llamacpp-ar"])
    chat = s["table"]["pld"]["chat"]
    assert chat["tokens_per_s"] == pytest.approx(10.0)  # 20 tokens in 2 s: math is left out
    assert chat["speedup_vs_ar"] == pytest.approx(10.0 / (20 / 3.0))
    assert chat["speedup_vs_best_llamacpp"] == pytest.approx(10.0 / (20 / 6.0))
    assert chat["mean_accepted"] == pytest.approx(2.0)
    assert "## The chat categories pooled" in report.markdown(s, {}, {})
    one = stats.summarize([r for r in recs if r["category"] != "qa"], ["ar", "pld"])
    assert "chat" not in one["table"]["pld"] and "chat categories" not in report.markdown(one, {}, {})


def test_methods_take_turns_at_going_first():
    """On every other question our methods answer in the reverse order (and the peers' after them, also
    reversed), each turn of a question in the same order; every answer is stored under its own method."""
    from types import SimpleNamespace

    from hydraspec.bench.runner import answer_all, turn_order

    calls, stored = [], []
    store = SimpleNamespace(append=stored.append, records=stored, path="x")
    qs = [SimpleNamespace(question_id=i, category="c", source="s", turns=["hi", "more"]) for i in range(3)]

    def answer(m, q, t, messages, max_new):
        calls.append((q.question_id, t, m))
        return SimpleNamespace(text=f"{m}{q.question_id}{t}", to_dict=lambda: {"new_tokens": 1})

    args = SimpleNamespace(turns=None, max_new_tokens=4)
    answer_all(args, store, [(q, ["ar", "pld"]) for q in qs], answer)
    assert calls == [(0, 0, "ar"), (0, 0, "pld"), (0, 1, "ar"), (0, 1, "pld"),
                     (1, 0, "pld"), (1, 0, "ar"), (1, 1, "pld"), (1, 1, "ar"),
                     (2, 0, "ar"), (2, 0, "pld"), (2, 1, "ar"), (2, 1, "pld")]
    assert sorted((r["question_id"], r["method"]) for r in stored) == [(i, m) for i in range(3) for m in ("ar", "pld")]
    ms = ["ar", "llamacpp-ar", "auto", "llamacpp-ngram-mod"]  # ours first, each group reversed on odd questions
    assert turn_order(ms, 0) == ["ar", "auto", "llamacpp-ar", "llamacpp-ngram-mod"]
    assert turn_order(ms, 1) == ["auto", "ar", "llamacpp-ngram-mod", "llamacpp-ar"]
