"""Head training: target offsets, loss arithmetic, and that training on self-distilled data helps."""
import json

import pytest
import torch
import torch.nn.functional as F

import tiny
from hydraspec import SpeculativeGenerator, make_drafter
from hydraspec.heads import build_heads, load_heads
from hydraspec.train import answer_prompts, evaluate, head_positions, heads_loss, load_answers, train_heads


def test_head_positions_offsets():
    # sequence of 10 tokens, prompt of 4: head k at position t predicts token t + k + 2 in the answer
    assert head_positions(10, 4, 0).tolist() == [2, 3, 4, 5, 6, 7]
    assert head_positions(10, 4, 1).tolist() == [1, 2, 3, 4, 5, 6]
    assert head_positions(10, 4, 3).tolist() == [0, 1, 2, 3, 4]
    assert head_positions(4, 4, 0).tolist() == []


class LinearHeads(torch.nn.Module):
    kind, method, num_heads = "medusa", "medusa", 2

    def __init__(self, dim, vocab):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, dim, vocab))

    def logits(self, k, h, path_emb=None):
        return h @ self.w[k]


def test_loss_matches_hand_computation():
    torch.manual_seed(0)
    T, D, V, P = 9, 5, 7, 3
    heads = LinearHeads(D, V)
    hidden, ids = torch.randn(T, D), torch.randint(0, V, (T,))
    loss, stats = heads_loss(heads, hidden, ids, P, decay=0.5)
    expected = 0.0
    for k in range(2):
        terms = [F.cross_entropy((hidden[t] @ heads.w[k])[None], ids[t + k + 2][None])
                 for t in range(T) if t + k + 2 < T and t + k + 2 >= P]
        expected += 0.5 ** k * torch.stack(terms).mean()
    torch.testing.assert_close(loss, expected)
    assert [s["n"] for s in stats] == [T - P, T - P]
    # distillation from a teacher that is one-hot on the real tokens gives the same loss
    teacher = torch.full((T, V), -1e9)
    teacher[torch.arange(T - 1), ids[1:]] = 0.0
    loss_t, _ = heads_loss(heads, hidden, ids, P, decay=0.5, teacher_logits=teacher)
    torch.testing.assert_close(loss_t, expected)


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    from hydraspec.train.trainer import lr_factor
    f = [lr_factor(s, 1000) for s in range(1000)]
    assert f[0] == pytest.approx(1 / 30) and f[29] == pytest.approx(1.0)  # 3 % linear warm-up
    assert all(a >= b for a, b in zip(f[29:], f[30:]))  # then never rises
    assert f[-1] == pytest.approx(0.1, abs=1e-4) and f[515] == pytest.approx(0.55, abs=0.01)  # cosine to 0.1
    assert lr_factor(0, 1) == 1.0


@pytest.mark.parametrize("kind,train_dtype", [("medusa", "float32"), ("hydra", "float32"), ("hydra", "bfloat16")])
def test_training_on_self_distilled_data_improves_heads(kind, train_dtype, tok, tmp_path):
    model = tiny.cached_model("llama", "sdpa", 1)
    questions = [(i, [" ".join(f"w{(i * 7 + j * 3) % 90}" for j in range(6))]) for i in range(12)]
    data = tmp_path / "answers.jsonl"
    assert answer_prompts(model, tok, questions[:6], data, max_new_tokens=24, progress=False) == 6
    assert answer_prompts(model, tok, questions, data, max_new_tokens=24, progress=False) == 6  # resumes
    rows = load_answers(data)
    assert len(rows) == 12 and all(len(r["answer_ids"]) == 24 for r in rows)

    fresh = build_heads(kind, model, num_heads=3)
    before = evaluate(fresh, model, rows)
    train_heads(model, data, tmp_path / "heads", kind=kind, base_name="tiny", num_heads=3, epochs=12, lr=6e-3,
                heldout=0.0, progress=False, train_dtype=train_dtype)
    heads, cfg = load_heads(tmp_path / "heads", model, base_model="tiny")
    after = evaluate(heads, model, rows)
    assert after[0]["top1"] > before[0]["top1"] + 0.2, (before, after)
    log = [json.loads(x) for x in (tmp_path / "heads" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 12 and log[-1]["loss"] < log[0]["loss"]

    prompt = rows[0]["prompt_ids"]
    ref = SpeculativeGenerator(model, tok).generate(input_ids=prompt, max_new_tokens=24)
    res = SpeculativeGenerator(model, tok, make_drafter(kind, heads=heads, embed=model.get_input_embeddings(),
                                                        tree=cfg["default_tree"])).generate(input_ids=prompt,
                                                                                           max_new_tokens=24)
    assert res.token_ids == ref.token_ids
    assert res.stats.mean_accepted > 1.2


def test_hydra_plus_plus_trains_prefix_layer_and_stays_exact(tok, tmp_path):
    model = tiny.cached_model("llama", "sdpa", 1)
    questions = [(i, [" ".join(f"w{(i * 5 + j * 3) % 90}" for j in range(6))]) for i in range(8)]
    data = tmp_path / "answers.jsonl"
    # batched data generation gives the same greedy answers as one prompt at a time (fp32)
    answer_prompts(model, tok, questions, data, max_new_tokens=16, progress=False, batch_size=3)
    one = tmp_path / "one.jsonl"
    answer_prompts(model, tok, questions, one, max_new_tokens=16, progress=False)
    by_id = {r["id"]: r["answer_ids"] for r in load_answers(one)}
    assert {r["id"]: r["answer_ids"] for r in load_answers(data)} == by_id
    # and so does prompt lookup, batched (adaptive draft length) or alone
    for bs in (1, 3):
        spec = tmp_path / f"pld{bs}.jsonl"
        answer_prompts(model, tok, questions, spec, max_new_tokens=16, progress=False, batch_size=bs, method="pld")
        assert {r["id"]: r["answer_ids"] for r in load_answers(spec)} == by_id
    train_heads(model, data, tmp_path / "hpp", kind="hydra", base_name="tiny", num_heads=3, num_layers=4,
                epochs=6, lr=3e-3, heldout=0.0, progress=False, distill=True, prefix_layer=True)
    heads, cfg = load_heads(tmp_path / "hpp", model, base_model="tiny")
    assert cfg["prefix_layer"]
    # the prefix layer was trained: it is no longer the identity it starts as
    h = torch.randn(4, model.config.hidden_size)
    with torch.no_grad():
        assert not torch.allclose(heads.prefixed(h), h, atol=1e-4)
    rows = load_answers(data)
    prompt = rows[0]["prompt_ids"]
    ref = SpeculativeGenerator(model, tok).generate(input_ids=prompt, max_new_tokens=16)
    res = SpeculativeGenerator(model, tok, make_drafter("hydra", heads=heads, embed=model.get_input_embeddings(),
                                                        tree=cfg["default_tree"])).generate(input_ids=prompt,
                                                                                           max_new_tokens=16)
    assert res.token_ids == ref.token_ids
    assert res.stats.mean_accepted > 1.2


def test_draft_vocab_training_maps_targets_and_improves(tok, tmp_path):
    model = tiny.cached_model("llama", "sdpa", 1)
    questions = [(i, [" ".join(f"w{(i * 7 + j * 3) % 90}" for j in range(6))]) for i in range(10)]
    data = tmp_path / "answers.jsonl"
    answer_prompts(model, tok, questions, data, max_new_tokens=20, progress=False, batch_size=4)
    rows = load_answers(data)
    train_heads(model, data, tmp_path / "h", kind="medusa", base_name="tiny", num_heads=2, epochs=10, lr=6e-3,
                heldout=0.0, progress=False, draft_vocab=24)
    heads, cfg = load_heads(tmp_path / "h", model)
    assert heads.subset.numel() == 24 and 0 < cfg["draft_vocab_coverage"] <= 1
    after = evaluate(heads, model, rows)
    fresh = build_heads("medusa", model, num_heads=2, vocab_subset=heads.subset.tolist())
    before = evaluate(fresh, model, rows)
    assert after[0]["top1"] > before[0]["top1"] + 0.12, (before, after)
    assert after[0]["top1"] <= cfg["draft_vocab_coverage"] + 1e-9  # tokens outside the subset are sure misses
    # the loss counts an out-of-subset target as unreachable, not as some other token
    from hydraspec.train.losses import heads_loss
    ids = torch.tensor(rows[0]["prompt_ids"] + rows[0]["answer_ids"])
    hidden = model(input_ids=ids[None], output_hidden_states=True).hidden_states[-1][0]
    loss, st = heads_loss(heads, hidden, ids, len(rows[0]["prompt_ids"]), embed=model.get_input_embeddings())
    assert torch.isfinite(loss)


def test_base_outputs_cache_matches_recomputation(tok, tmp_path):
    from hydraspec.train.trainer import BaseOutputs, teacher_logits

    model = tiny.cached_model("llama", "sdpa", 1)
    questions = [(i, [" ".join(f"w{(i * 3 + j) % 90}" for j in range(5))]) for i in range(4)]
    data = tmp_path / "answers.jsonl"
    answer_prompts(model, tok, questions, data, max_new_tokens=10, progress=False)
    rows = load_answers(data)
    base = BaseOutputs(model, tmp_path / "cache", 1 << 30, 1024, "tiny")
    first = [base.hidden(r, base.ids(r)) for r in rows]
    again = [base.hidden(r, base.ids(r)) for r in rows]
    assert (base.misses, base.hits) == (4, 4)
    for r, a, b in zip(rows, first, again):
        ids = base.ids(r)
        out = model(input_ids=ids[None], output_hidden_states=True)
        assert b.shape[0] == ids.numel() - 1  # the last token's state is never a target's input
        torch.testing.assert_close(b, out.hidden_states[-1][0, :-1], atol=0, rtol=0)  # stored exactly
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        # distillation targets recomputed from the hidden states are the model's logits
        torch.testing.assert_close(teacher_logits(model, b), out.logits[0, :-1].float(), atol=1e-5, rtol=1e-5)
        sub = torch.tensor([5, 1, 7])
        torch.testing.assert_close(teacher_logits(model, b, sub), out.logits[0, :-1, sub].float(), atol=1e-5, rtol=1e-5)
    # the size bound: nothing beyond it is stored, and those sequences are recomputed
    small = BaseOutputs(model, tmp_path / "small", 1, 1024, "tiny")
    small.hidden(rows[0], small.ids(rows[0]))
    small.hidden(rows[0], small.ids(rows[0]))
    assert (small.misses, small.hits) == (2, 0) and not list((tmp_path / "small").glob("*.pt"))
    # a cache made for another base model is cleared, not reused
    other = BaseOutputs(model, tmp_path / "cache", 1 << 30, 1024, "another-base")
    assert other.used == 0 and not list((tmp_path / "cache").glob("*.pt"))
    # training reads the cache: the second epoch computes nothing
    train_heads(model, data, tmp_path / "h", kind="medusa", base_name="tiny", num_heads=2, epochs=2,
                heldout=0.25, progress=False)
    log = [json.loads(x) for x in (tmp_path / "h" / "train_log.jsonl").read_text().splitlines()]
    assert log[0]["base_cache"]["computed"] == 4 and log[1]["base_cache"]["computed"] == 4
    assert log[1]["base_cache"]["hits"] > log[0]["base_cache"]["hits"]


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_batched_data_generation_fills_the_base_cache(tok, tmp_path, method):
    from hydraspec.train.trainer import BaseOutputs, _base_hidden

    model = tiny.cached_model("llama", "sdpa", 1)
    questions = [(i, [" ".join(f"w{(i * 5 + j * 2) % 90}" for j in range(3 + i % 4))]) for i in range(6)]
    data = tmp_path / "answers.jsonl"
    cache = BaseOutputs.for_data(model, data, 1 << 30, base_name="tiny")
    answer_prompts(model, tok, questions, data, max_new_tokens=9, progress=False, batch_size=4, base_cache=cache,
                   method=method)
    rows = load_answers(data)
    assert len(list((tmp_path / "answers.base_cache").glob("*.pt"))) == len(rows) == 6
    # what generation captured (left-padded batches) is what a plain forward over the sequence gives
    reader = BaseOutputs.for_data(model, data, 1 << 30, base_name="tiny")
    for r in rows:
        ids = reader.ids(r)
        torch.testing.assert_close(reader.hidden(r, ids), _base_hidden(model, ids), atol=1e-4, rtol=1e-4)
    assert (reader.hits, reader.misses) == (6, 0)
    # so training runs no base forward at all
    train_heads(model, data, tmp_path / "h", kind="medusa", base_name="tiny", num_heads=2, epochs=1,
                heldout=0.0, progress=False)
    log = [json.loads(x) for x in (tmp_path / "h" / "train_log.jsonl").read_text().splitlines()]
    assert log[0]["base_cache"]["computed"] == 0 and log[0]["base_cache"]["hits"] == 6


def test_medusa2_joint_training_tunes_the_base_and_stays_exact(tok, tmp_path):
    import copy

    from hydraspec import HydraspecError
    from hydraspec.cpu.kernels import prepack

    model = copy.deepcopy(tiny.cached_model("llama", "sdpa", 1))  # this test changes the base
    prepack(model)  # as load_model leaves it: joint training must not read stale packed weights
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    questions = [(i, [" ".join(f"w{(i * 7 + j * 3) % 90}" for j in range(6))]) for i in range(8)]
    data = tmp_path / "answers.jsonl"
    answer_prompts(model, tok, questions, data, max_new_tokens=16, progress=False, batch_size=4)
    with pytest.raises(HydraspecError, match="more epochs"):
        train_heads(model, data, tmp_path / "x", kind="medusa", epochs=1, joint=True, progress=False)
    train_heads(model, data, tmp_path / "m2", kind="medusa", base_name="tiny", num_heads=2, epochs=3, lr=3e-3,
                heldout=0.25, progress=False, joint=True, warmup_epochs=1, base_lr=1e-3)
    log = [json.loads(x) for x in (tmp_path / "m2" / "train_log.jsonl").read_text().splitlines()]
    assert "joint" not in log[0] and log[1]["joint"] and log[2]["joint"]
    assert 0 <= log[2]["lm_kl"] < 1.0  # the tuned base stays close to the original
    after = dict(model.named_parameters())
    emb = model.get_input_embeddings().weight
    changed = [n for n, p in after.items() if not torch.equal(p.detach(), original[n])]
    assert changed and all("layers" in n or "norm" in n for n in changed)
    assert torch.equal(emb.detach(), original["model.embed_tokens.weight"])
    # the tuned base is saved; the heads name it and refuse the original base
    base_dir = tmp_path / "m2" / "base"
    tuned = type(model).from_pretrained(base_dir).eval()
    for n, p in tuned.named_parameters():
        torch.testing.assert_close(p, after[n].detach())
    heads, cfg = load_heads(tmp_path / "m2", tuned, base_model=str(base_dir))
    assert cfg["joint"]["original_base"] == "tiny"
    with pytest.raises(HydraspecError, match="trained for"):
        load_heads(tmp_path / "m2", tuned, base_model="tiny")
    # speculative decoding with the tuned base and its heads is exact for that base
    prompt = load_answers(data)[0]["prompt_ids"]
    ref = SpeculativeGenerator(tuned, tok).generate(input_ids=prompt, max_new_tokens=16)
    res = SpeculativeGenerator(tuned, tok, make_drafter("medusa", heads=heads, embed=tuned.get_input_embeddings(),
                                                        tree=cfg["default_tree"])).generate(input_ids=prompt,
                                                                                           max_new_tokens=16)
    assert res.token_ids == ref.token_ids


def test_distillation_with_a_draft_vocabulary_trains(tok, tmp_path):
    # hydra++ with --draft-vocab: the teacher comes restricted to the subset's columns (or whole)
    from hydraspec.train.trainer import teacher_logits

    model = tiny.cached_model("llama", "sdpa", 1)
    questions = [(i, [" ".join(f"w{(i * 7 + j * 3) % 90}" for j in range(6))]) for i in range(6)]
    data = tmp_path / "answers.jsonl"
    answer_prompts(model, tok, questions, data, max_new_tokens=12, progress=False, batch_size=3)
    train_heads(model, data, tmp_path / "h", kind="hydra", base_name="tiny", num_heads=2, num_layers=2, epochs=2,
                heldout=0.0, progress=False, distill=True, prefix_layer=True, draft_vocab=20)
    heads, _ = load_heads(tmp_path / "h", model)
    r = load_answers(data)[0]
    ids = torch.tensor(r["prompt_ids"] + r["answer_ids"])
    hidden = model(input_ids=ids[None], output_hidden_states=True).hidden_states[-1][0, :-1]
    P = len(r["prompt_ids"])
    full, _ = heads_loss(heads, hidden, ids, P, embed=model.get_input_embeddings(),
                         teacher_logits=teacher_logits(model, hidden))
    part, _ = heads_loss(heads, hidden, ids, P, embed=model.get_input_embeddings(),
                         teacher_logits=teacher_logits(model, hidden, heads.subset))
    torch.testing.assert_close(full, part)


def test_gradient_accumulation_averages_over_sequences(tok, tmp_path):
    """accum=3 over three copies of one sequence takes the same single step as accum=1 over one copy
    (each sequence's loss weighted 1 / accum); a sequence whose prompt fills max_len is left out."""
    model = tiny.cached_model("llama", "sdpa", 1)
    data = tmp_path / "one.jsonl"
    answer_prompts(model, tok, [("a", ["w1 w2 w3 w4"])], data, max_new_tokens=16, progress=False)
    row = load_answers(data)[0]
    long = {"id": "long", "prompt_ids": list(range(5, 45)), "answer_ids": [7, 8, 9]}
    three = tmp_path / "three.jsonl"
    three.write_text("".join(json.dumps({**row, "id": f"c{i}"}) + "\n" for i in range(3)) + json.dumps(long) + "\n")
    torch.manual_seed(0)
    train_heads(model, data, tmp_path / "h1", kind="hydra", num_heads=2, epochs=1, lr=1e-2, heldout=0.0,
                progress=False, train_dtype="float32", accum=1, max_len=32)
    torch.manual_seed(0)
    train_heads(model, three, tmp_path / "h3", kind="hydra", num_heads=2, epochs=1, lr=1e-2, heldout=0.0,
                progress=False, train_dtype="float32", accum=3, max_len=32)
    h1, _ = load_heads(tmp_path / "h1", model)
    h3, _ = load_heads(tmp_path / "h3", model)
    fresh = build_heads("hydra", model, num_heads=2)
    moved = False
    for (name, a), b, c in zip(h1.state_dict().items(), h3.state_dict().values(), fresh.state_dict().values()):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-5, rtol=1e-4, msg=name)
        moved |= not torch.allclose(a.float(), c.float())
    assert moved  # the step did change the heads


def _gloo_available() -> bool:
    try:
        import accelerate.commands.launch  # noqa: F401
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_gloo_available()


@pytest.mark.skipif(not _gloo_available(), reason="needs accelerate and torch.distributed with gloo")
def test_two_processes_train_as_one_with_the_same_global_batch(tok, tmp_path):
    """`accelerate launch` with 2 CPU processes (gloo) splits each optimizer step's 4 sequences over them
    and sums the gradients: the same losses, held-out accuracy, base-cache use and heads as one process
    with --grad-accum 4. 9 training sequences make steps of 4, 4 and 1 (process 1 has nothing to do in
    the last: its gradients count as zeros); 2 held-out ones are split too."""
    import os
    import subprocess
    import sys

    from hydraspec.cli import main
    from hydraspec.train.trainer import is_heldout

    model = tiny.make_model("llama", seed=0)
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    questions = [(f"q{i}", [" ".join(f"w{(i * 7 + j * 3) % 90}" for j in range(5))]) for i in range(20)]
    answer_prompts(model, tok, questions, tmp_path / "all.jsonl", max_new_tokens=12, progress=False, batch_size=4)
    rows = load_answers(tmp_path / "all.jsonl")
    held = [r for r in rows if is_heldout(r["id"], 0.2)][:2]
    train = [r for r in rows if not is_heldout(r["id"], 0.2)][:9]
    assert len(held) == 2 and len(train) == 9
    for name in ("one", "two"):  # each run fills a base cache of its own
        (tmp_path / name).mkdir()
        (tmp_path / name / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train + held))

    def argv(name):
        return ["train-heads", "--model", str(tmp_path / "base"), "--dtype", "float32", "--device", "cpu",
                "--kind", "hydra", "--num-heads", "2", "--epochs", "2", "--lr", "1e-2", "--grad-accum", "4",
                "--heldout", "0.2", "--train-dtype", "float32", "--data", str(tmp_path / name / "answers.jsonl"),
                "--out", str(tmp_path / name / "heads")]

    threads = torch.get_num_threads()
    try:
        assert main(argv("one")) == 0
    finally:
        torch.set_num_threads(threads)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # --multi_gpu is accelerate's torchrun launcher (one process each); on CPUs the processes use gloo
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]
    p = subprocess.run(launch + ["-m", "hydraspec.cli"] + argv("two"), env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert p.stdout.count("head 0: held-out top-1") == 1  # only the main process reports

    logs = {name: [json.loads(x) for x in (tmp_path / name / "heads" / "train_log.jsonl").read_text().splitlines()]
            for name in ("one", "two")}
    assert [e["processes"] for e in logs["one"]] == [1, 1] and [e["processes"] for e in logs["two"]] == [2, 2]
    for one, two in zip(logs["one"], logs["two"], strict=True):
        assert len(one["step_losses"]) == len(two["step_losses"]) == 3
        assert two["step_losses"] == pytest.approx(one["step_losses"], rel=1e-4)
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-4)
        for a, b in zip(one["heads"], two["heads"], strict=True):
            assert a["n"] == b["n"] > 0
            assert (b["top1"], b["top5"]) == pytest.approx((a["top1"], a["top5"]))
        # every sequence's base states were computed once, by one of the processes, and then read by either
        assert one["base_cache"] == two["base_cache"] and one["base_cache"]["computed"] == 11
    assert logs["one"][1]["step_losses"][-1] < logs["one"][0]["step_losses"][0]
    cache = tmp_path / "two" / "answers.base_cache"
    assert len(list(cache.glob("*.pt"))) == 11 and not list(cache.glob("*.tmp"))

    h1, cfg1 = load_heads(tmp_path / "one" / "heads", model)
    h2, cfg2 = load_heads(tmp_path / "two" / "heads", model)
    assert cfg1 == cfg2
    fresh = build_heads("hydra", model, num_heads=2)
    moved = False
    for (name, a), b, c in zip(h1.state_dict().items(), h2.state_dict().values(), fresh.state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4, msg=name)
        moved |= "blocks" in name and not torch.allclose(a, c)
    assert moved  # the zero-initialised residual blocks did train
    state1 = torch.load(tmp_path / "one" / "heads" / "train_state.pt", weights_only=False)
    state2 = torch.load(tmp_path / "two" / "heads" / "train_state.pt", weights_only=False)
    assert state1["epoch"] == state2["epoch"] == 2 and state1["sched"] == state2["sched"]


def test_text_rows_sample_every_file_within_the_budget(tok, tmp_path):
    from hydraspec.train.text_data import write_text_rows

    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    for i in range(6):
        (src / "pkg" / f"m{i}.py").write_text(" ".join(f"w{(i * 11 + j) % 90}" for j in range(400)))
    (src / "skip.bin").write_text("not text")
    n = write_text_rows(tok, [src], tmp_path / "t.jsonl", max_tokens=1000, seq_len=64, progress=False)
    rows = load_answers(tmp_path / "t.jsonl")
    assert n == 1000 == sum(len(r["answer_ids"]) for r in rows)
    assert all(r["prompt_ids"] == [] and 0 < len(r["answer_ids"]) <= 64 for r in rows)
    assert len({r["id"] for r in rows}) == len(rows)
    again = write_text_rows(tok, [src], tmp_path / "u.jsonl", max_tokens=1000, seq_len=64, progress=False)
    assert again == n and load_answers(tmp_path / "u.jsonl") == rows  # a fixed order
    with pytest.raises(Exception, match="no such file"):
        write_text_rows(tok, [tmp_path / "missing"], tmp_path / "v.jsonl", 1000, progress=False)


def test_train_heads_on_text_alone_distils_the_base(tok, tmp_path):
    """`train-heads --text DIR` with no prompts: rows read at prefill speed, the base's own distributions as
    targets (the loss falls), no answer decoded, and greedy output with the heads stays plain decoding's."""
    from hydraspec.cli import main

    model = tiny.make_model("llama", seed=0)
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"doc{i}.md").write_text(" ".join(f"w{(i * 7 + j * 3) % 90}" for j in range(600)))
    threads = torch.get_num_threads()
    try:
        assert main(["train-heads", "--model", str(tmp_path / "base"), "--dtype", "float32", "--device", "cpu",
                     "--kind", "medusa", "--num-heads", "2", "--epochs", "3", "--lr", "1e-2", "--text", str(src),
                     "--text-tokens", "3000", "--train-dtype", "float32", "--out", str(tmp_path / "h")]) == 0
    finally:
        torch.set_num_threads(threads)
    log = [json.loads(x) for x in (tmp_path / "h" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["train_seqs"] > 0 and log[-1]["step_losses"][-1] < log[0]["step_losses"][0]
    heads, cfg = load_heads(tmp_path / "h", model)
    assert cfg["kind_detail"]["distill"] is True and cfg["train_text"]["tokens"] == 3000
    assert not (tmp_path / "h" / "answers.jsonl").exists()  # no decoding at all
    prompt = "w1 w2 w3 w4"
    ref = SpeculativeGenerator(model, tok).generate(prompt, max_new_tokens=24)
    drafter = make_drafter("medusa", heads=heads, embed=model.get_input_embeddings(), tree=cfg["default_tree"])
    res = SpeculativeGenerator(model, tok, drafter).generate(prompt, max_new_tokens=24)
    assert res.token_ids == ref.token_ids


def test_training_from_saved_heads_starts_where_they_left_off(tok, tmp_path):
    """init=DIR: the heads start from that checkpoint (at learning rate 0 they come out as they went in, their
    draft vocabulary kept), a further epoch moves them, and heads of another kind are refused."""
    from hydraspec.errors import HydraspecError

    model = tiny.cached_model("llama", "sdpa", 1)
    questions = [(i, [" ".join(f"w{(i * 5 + j * 3) % 90}" for j in range(6))]) for i in range(4)]
    data = tmp_path / "answers.jsonl"
    answer_prompts(model, tok, questions, data, max_new_tokens=12, progress=False, batch_size=2)
    opts = dict(kind="hydra", base_name="tiny", num_heads=2, heldout=0.0, progress=False, distill=True,
                train_dtype="float32")
    train_heads(model, data, tmp_path / "a", epochs=1, draft_vocab=20, **opts)
    train_heads(model, data, tmp_path / "same", epochs=1, lr=0.0, init=tmp_path / "a", **opts)
    train_heads(model, data, tmp_path / "more", epochs=1, init=tmp_path / "a", **opts)
    a, same, more = (load_heads(tmp_path / d, model)[0].state_dict() for d in ("a", "same", "more"))
    assert a.keys() == same.keys() and torch.equal(a["subset"], same["subset"]) and a["subset"].numel() == 20
    for k in a:
        torch.testing.assert_close(a[k], same[k], msg=k)
    assert any(not torch.equal(a[k], more[k]) for k in a if a[k].is_floating_point())
    assert json.loads((tmp_path / "more" / "config.json").read_text())["started_from"] == str(tmp_path / "a")
    with pytest.raises(HydraspecError, match="not medusa heads"):
        train_heads(model, data, tmp_path / "b", epochs=1, init=tmp_path / "a", **{**opts, "kind": "medusa"})
