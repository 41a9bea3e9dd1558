"""Heads that learn from a server's own answers (hydraspec.serve.learn, `serve --learn`): on a tiny random model,
answers it wrote itself train fresh heads, the better heads replace the ones in use, greedy answers stay the
plain ones, a restart goes on from the saved state, and a real server learns between requests."""
from __future__ import annotations

import json
import time

import httpx
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import tiny
from hydraspec import SpeculativeGenerator, make_drafter
from hydraspec.heads import ensure_heads, load_heads
from hydraspec.serve import chunked_write, learn
from hydraspec.serve.chunked_write import ChunkedWrite
from hydraspec.serve.learn import HeadLearner, head_drafters
from hydraspec.train.trainer import BaseOutputs, eval_counts

SEED = 5


def model_and_tok():
    return tiny.cached_model("llama", "sdpa", SEED), tiny.make_tokenizer()


def answers(n: int) -> list[dict]:
    """The tiny model's own greedy answers to n short prompts, as a server keeps them."""
    model, _ = model_and_tok()
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        prompt = torch.randint(3, tiny.VOCAB, (6,), generator=g).tolist()
        rows.append({"id": f"served-{i}", "prompt_ids": prompt, "answer_ids": tiny.hf_greedy(model, prompt, 40)})
    return rows


def drafter_in(directory):
    model, _ = model_and_tok()
    heads, cfg = load_heads(directory / "heads", model)
    return make_drafter(heads.method, heads=heads, embed=model.get_input_embeddings(), tree=cfg["default_tree"])


def learner(directory, drafter, monkeypatch, warm: bool = True) -> HeadLearner:
    monkeypatch.setattr(learn, "EVAL_EVERY", 8)
    monkeypatch.setattr(learn, "HELDOUT", 0.2)
    monkeypatch.setattr(learn, "PASSES", 6)  # a few answers, seen more often than a server's many
    monkeypatch.setattr(learn, "LR", 3e-3)
    model, _ = model_and_tok()
    return HeadLearner(model, directory, head_drafters(drafter), base_name="tiny", say=lambda m: None, warm=warm)


def learn_all(lr: HeadLearner, limit: int = 2000) -> int:
    units = 0
    while lr.work():
        units += 1
        assert units < limit, "the learner never runs out of work"
    return units


def test_learned_heads_replace_the_fresh_ones_and_leave_answers_unchanged(tmp_path, monkeypatch):
    model, tok = model_and_tok()
    torch.manual_seed(0)
    ensure_heads(tmp_path / "heads", model, "hydra", "tiny")
    drafter = drafter_in(tmp_path)
    fresh = drafter.heads
    lr = learner(tmp_path, drafter, monkeypatch)
    for row in answers(30):
        lr.add(row)
    assert lr.stats.heldout > 0 and lr.stats.answers > 0
    held = list(lr.heldout)
    before = learn.chain_score(eval_counts(lr.live, model, held, lr.held))
    learn_all(lr)
    assert lr.stats.steps == learn.PASSES * lr.stats.answers  # every answer its passes, then idle
    assert lr.stats.swaps >= 1 and drafter.heads is not fresh
    # accepted draft tokens per step on the held-out answers, up from the fresh heads'
    assert lr.stats.score == round(learn.chain_score(eval_counts(lr.live, model, held, lr.held)), 4)
    assert lr.stats.score > before + 0.1, (before, lr.stats)
    lr.close()
    saved = load_file(str(tmp_path / "heads" / "heads.safetensors"))  # the heads in use, on disk
    assert saved.keys() == lr.live.state_dict().keys()
    assert all(torch.equal(saved[k], v) for k, v in lr.live.state_dict().items())
    load_heads(tmp_path / "heads", model)  # loadable as any heads
    prompt = [{"role": "user", "content": "w5 w9 w12 w5"}]
    want = SpeculativeGenerator(model, tok, make_drafter("ar")).generate(prompt, max_new_tokens=40).token_ids
    got = SpeculativeGenerator(model, tok, drafter).generate(prompt, max_new_tokens=40)
    assert got.token_ids == want


def test_a_restart_goes_on_where_learning_stopped(tmp_path, monkeypatch):
    model, _ = model_and_tok()
    ensure_heads(tmp_path / "heads", model, "hydra", "tiny")
    rows = answers(12)
    (tmp_path / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = learner(tmp_path, drafter_in(tmp_path), monkeypatch)
    learn_all(first)
    first.close()
    again = learner(tmp_path, drafter_in(tmp_path), monkeypatch)
    assert again.stats.steps == first.stats.steps and again.stats.swaps == first.stats.swaps
    assert (again.stats.answers, again.stats.heldout) == (first.stats.answers, first.stats.heldout)
    assert all(torch.equal(a, b) for a, b in zip(again.candidate.state_dict().values(),
                                                 first.candidate.state_dict().values()))
    assert not again.work()  # every answer already had its passes: nothing to redo
    new = answers(14)[12:]
    for r in new:
        again.add(r)
    assert again.work()


def test_each_unit_of_work_is_one_forward_or_one_step(tmp_path, monkeypatch):
    """The server calls work() between looks at its inbox: a unit never takes more than one training step."""
    model, _ = model_and_tok()
    ensure_heads(tmp_path / "heads", model, "medusa", "tiny")
    lr = learner(tmp_path, drafter_in(tmp_path), monkeypatch)
    for row in answers(10):
        lr.add(row)
    steps = []
    while lr.work():
        steps.append(lr.stats.steps)
    assert all(b - a <= 1 for a, b in zip([0] + steps, steps))


def test_a_server_learns_between_requests(tmp_path, monkeypatch):
    import test_serve  # the tiny server harness, with this module's learner

    model = test_serve.target()
    ensure_heads(tmp_path / "heads", model, "hydra", "tiny")
    heads, cfg = load_heads(tmp_path / "heads", model)
    drafter = make_drafter("hydra", heads=heads, embed=model.get_input_embeddings(), tree=cfg["default_tree"])
    lr = learner(tmp_path, drafter, monkeypatch)
    monkeypatch.setattr(learn, "MIN_GAIN", -1.0)  # every scoring swaps: the swap's path, not the learning's quality
    asks = [(p, n) for n in (30, 40) for p in test_serve.PROMPTS]
    want = {a: test_serve.single("ar", *a) for a in asks}
    with test_serve.server(drafter_obj=drafter, learner=lr) as (base, worker):
        c = test_serve.client(base)
        for a in asks:
            assert test_serve.chat(c, *a).choices[0].message.content == want[a]
        t0 = time.monotonic()
        while lr.stats.swaps == 0 or lr.scoring is not None:
            assert time.monotonic() - t0 < 120, lr.stats
            time.sleep(0.05)
        assert worker.keep is not None and lr.stats.steps > 0
        assert httpx.get(base + "/health").json()["learning"]["swaps"] >= 1
        kept = [row for row, _ in lr.pool if lr.memo.has(row)] + [row for row in lr.heldout if lr.held.has(row)]
        assert len(kept) == len(asks)  # the engine handed every answer's states: none read again
        for row in kept:  # ... and they are the base's own states at the answer's positions
            memo = lr.memo if lr.memo.has(row) else lr.held
            own = BaseOutputs(model, max_len=learn.MAX_LEN).hidden(row, memo.ids(row))
            assert torch.allclose(memo.hidden(row, None).float(), own.float(), atol=1e-4)
        for a in asks:  # with the learned heads in use
            assert test_serve.chat(c, *a).choices[0].message.content == want[a]
    assert [json.loads(line)["answer_ids"] for line in (tmp_path / "answers.jsonl").read_text().splitlines()][:1]


def test_serve_learn_refuses_heads_of_its_own_and_methods_without_heads(tmp_path, capsys):
    from hydraspec.cli import main

    base = ["serve", "--model", "smollm2-135m-instruct", "--learn", str(tmp_path)]
    assert main(base + ["--heads", str(tmp_path / "other")]) == 2
    assert "--learn keeps its heads in DIR/heads" in capsys.readouterr().err
    assert main(base + ["--method", "pld"]) == 2
    assert "use --method auto, medusa or hydra, not pld" in capsys.readouterr().err
    assert main(base + ["--keep-answers", str(tmp_path / "elsewhere")]) == 2
    assert "keeps the answers in its own directory" in capsys.readouterr().err


def test_the_warm_up_before_serving_learns_nothing(tmp_path, monkeypatch):
    """The learner's first-step warm-up leaves the heads and the optimizer as a cold start has them: the same
    training steps give the same weights bit for bit."""
    model, _ = model_and_tok()
    ensure_heads(tmp_path / "heads", model, "hydra", "tiny")
    rows = answers(6)
    saved = load_file(str(tmp_path / "heads" / "heads.safetensors"))
    trained = []
    for warm in (True, False):
        lr = learner(tmp_path, drafter_in(tmp_path), monkeypatch, warm=warm)
        if warm:
            assert all(torch.equal(saved[k], v) for k, v in lr.candidate.state_dict().items())
        for row in rows:
            lr.add(row)
        for _ in range(20):
            lr.work()
        assert lr.stats.steps > 2
        trained.append(lr.candidate.state_dict())
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])


def test_a_file_written_in_slices_reads_back_whole_and_replaces_the_old_one_only_at_the_end(tmp_path):
    tensors = {"w": torch.randn(300, 7), "h": torch.randn(11).bfloat16(), "step": torch.tensor(4.0),
               "ids": torch.arange(5), "none": torch.zeros(0), "mask": torch.ones(3, dtype=torch.bool)}
    path = tmp_path / "f.safetensors"
    path.write_bytes(b"the old file")
    w = ChunkedWrite(path, tensors, {"note": "kept"}, chunk=1000)
    steps = 0
    while not w.step():
        steps += 1
        assert path.read_bytes() == b"the old file"  # a reader never sees half a file
    assert steps >= 8  # 8,500 bytes of tensors, at most 1,000 a slice
    back = load_file(str(path))
    assert list(back) == list(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"note": "kept"}


def test_the_learner_writes_in_slices_between_other_units(tmp_path, monkeypatch):
    """Writing the state is many units, and training waits until the state on its way to disk is written."""
    model, _ = model_and_tok()
    ensure_heads(tmp_path / "heads", model, "hydra", "tiny")
    lr = learner(tmp_path, drafter_in(tmp_path), monkeypatch)
    monkeypatch.setattr(chunked_write, "CHUNK_BYTES", 4096)
    for row in answers(10):
        lr.add(row)
    for _ in range(3):
        lr.work()
    lr.save_state()
    steps, units = lr.stats.steps, 0
    while lr.writes:
        assert lr.work() and lr.stats.steps == steps
        units += 1
    assert units > 10 and (tmp_path / learn.STATE).exists()
    assert lr.work() and lr.stats.steps == steps + 1


def test_heads_written_again_while_their_last_write_is_under_way_end_up_whole(tmp_path, monkeypatch):
    """close() can queue the heads while an earlier write of them is half done: both finish, the newer last."""
    model, _ = model_and_tok()
    ensure_heads(tmp_path / "heads", model, "hydra", "tiny")
    lr = learner(tmp_path, drafter_in(tmp_path), monkeypatch)
    monkeypatch.setattr(chunked_write, "CHUNK_BYTES", 4096)
    lr.unsaved = (lr.live, 1)
    lr._put_heads()
    assert lr.work() and lr.work() and lr.writes  # the first write under way
    lr.unsaved = (lr.live, 2)
    lr.close()
    assert not (tmp_path / "heads.new").exists()
    assert json.loads((tmp_path / "heads" / "config.json").read_text())["trained_on"] == 2
    saved = load_file(str(tmp_path / "heads" / "heads.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in lr.live.state_dict().items())


def test_heads_whose_replacement_was_cut_off_between_its_renames_are_taken_back(tmp_path):
    model, _ = model_and_tok()
    torch.manual_seed(0)
    ensure_heads(tmp_path / "heads", model, "medusa", "tiny")
    before = load_file(str(tmp_path / "heads" / "heads.safetensors"))
    (tmp_path / "heads").rename(tmp_path / "heads.old")  # DIR/heads moved aside, the new one not yet in place
    ensure_heads(tmp_path / "heads", model, "medusa", "tiny")
    after = load_file(str(tmp_path / "heads" / "heads.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
