"""The command line on tiny models saved to disk: output format and every user error."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import tiny
from hydraspec.cli import main
from hydraspec.drafters import NoDrafter, PromptLookupDrafter, SuffixDrafter
from hydraspec.train.fit import default_lr
from hydraspec.models import shipped_suffix_store
from hydraspec.stack import build_drafter


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = tiny.make_model("llama", seed=0)
    tok = tiny.make_tokenizer()
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    tiny.noisy_copy(target, 0.05).save_pretrained(root / "draft")
    tok.save_pretrained(root / "draft")
    other = tiny.make_model("llama", seed=1, vocab=64)
    other.save_pretrained(root / "other")
    tiny.make_tokenizer(64).save_pretrained(root / "other")
    return root


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_generate_json_has_the_promised_fields(saved, capsys):
    rc, out, _ = run(capsys, "generate", "--model", str(saved / "target"), "--dtype", "float32",
                     "--prompt", "w1 w2 w3 w1 w2", "--max-new-tokens", "12", "--method", "pld", "--json")
    assert rc == 0
    d = json.loads(out)
    for key in ("method", "text", "new_tokens", "target_forwards", "mean_accepted", "tokens_per_s"):
        assert key in d
    assert d["new_tokens"] == 12 and d["method"] == "pld"
    assert d["mean_accepted"] == pytest.approx(d["new_tokens"] / d["target_forwards"], rel=1e-3)


def test_draft_and_ar_agree_through_the_cli(saved, capsys):
    common = ["generate", "--model", str(saved / "target"), "--dtype", "float32", "--prompt", "w5 w6 w7",
              "--max-new-tokens", "16", "--json"]
    _, ar, _ = run(capsys, *common, "--method", "ar")
    _, dr, _ = run(capsys, *common, "--method", "draft", "--draft-model", str(saved / "draft"))
    _, tr, _ = run(capsys, *common, "--method", "draft", "--draft-model", str(saved / "draft"), "--draft-tree", "2,2")
    _, pd, _ = run(capsys, *common, "--method", "pld+draft", "--draft-model", str(saved / "draft"),
                   "--pld-min-ngram", "1")
    ar, dr, tr, pd = json.loads(ar), json.loads(dr), json.loads(tr), json.loads(pd)
    assert ar["token_ids"] == dr["token_ids"] == tr["token_ids"] == pd["token_ids"]
    assert pd["method"] == "pld+draft"
    assert ar["mean_accepted"] == 1.0


@pytest.mark.parametrize("method, kind", [("suffix", SuffixDrafter), ("pld", PromptLookupDrafter), ("ar", NoDrafter)])
def test_the_command_line_builds_the_drafter_a_method_names(method, kind):
    """generate and serve build --method's drafter (--method suffix once ran plain decoding under its name)."""
    args = SimpleNamespace(method=method, model="some-dir", pld_tokens=10, pld_ngram=3, pld_min_ngram=2)
    assert type(build_drafter(args, None)) is kind


def test_suffix_decoding_of_the_offline_qwen_model_drafts_from_its_shipped_store_by_default(tmp_path):
    import numpy as np

    from hydraspec.errors import HydraspecError
    from hydraspec.options import suffix_store_for

    store = suffix_store_for(SimpleNamespace(model="qwen2.5-coder-1.5b-instruct", suffix_store="shipped"))
    with np.load(shipped_suffix_store("qwen2.5-coder-1.5b-instruct")) as f:
        meta = json.loads(str(f["meta"]))
    assert len(store) == meta["answers"] and sum(map(len, store)) == meta["tokens"] > 10_000
    assert suffix_store_for(SimpleNamespace(model="qwen2.5-coder-1.5b-instruct", suffix_store=None)) is store
    assert suffix_store_for(SimpleNamespace(model="qwen2.5-coder-1.5b-instruct", suffix_store="none")) is None
    assert suffix_store_for(SimpleNamespace(model="some-dir", suffix_store=None)) is None
    assert suffix_store_for(SimpleNamespace(model="some-dir", suffix_store="shipped")) is None
    (tmp_path / "bad.npz").write_text("not a store")
    with pytest.raises(HydraspecError, match="cannot read suffix store"):
        suffix_store_for(SimpleNamespace(model="some-dir", suffix_store=str(tmp_path / "bad.npz")))


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/model/dir", "--prompt", "w1"], "cannot load model"),
    (["--prompt", "   "], "the prompt is empty"),
    (["--prompt", "w1", "--max-new-tokens", "0"], "--max-new-tokens must be positive"),
    (["--prompt", "w1", "--method", "beam"], "unknown method 'beam'; known: ar, auto, draft, pld, suffix, medusa, hydra"),
    (["--prompt", "w1", "--method", "draft"], "needs --draft-model"),
    (["--prompt", "w1", "--method", "draft", "--draft-model", "OTHER"], "incompatible"),
    (["--prompt-file", "/no/such/file.txt"], "cannot read prompt file"),
])
def test_user_errors_exit_nonzero_with_one_line(saved, capsys, args, message):
    args = [str(saved / "other") if a == "OTHER" else a for a in args]
    if "--model" not in args:
        args = ["--model", str(saved / "target")] + args
    rc, out, err = run(capsys, "generate", "--dtype", "float32", *args)
    assert rc == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_flag_is_one_line_without_traceback(saved):
    p = subprocess.run([sys.executable, "-m", "hydraspec.cli", "generate", "--model", str(saved / "target"),
                        "--prompt", "w1", "--max-new-tokens", "ten"], capture_output=True, text=True)
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_context_overflow_is_a_clear_error(saved, capsys):
    rc, _, err = run(capsys, "generate", "--model", str(saved / "target"), "--dtype", "float32",
                     "--prompt", "w1 w2", "--max-new-tokens", "100000")
    assert rc == 2 and "exceeds the model's context" in err


def test_head_methods_through_the_cli(saved, tmp_path, capsys):
    from hydraspec.heads import build_heads, save_heads
    from hydraspec.models import load_model

    model, _ = load_model(str(saved / "target"), dtype="float32", device="cpu")
    save_heads(build_heads("hydra", model, num_heads=3), tmp_path / "heads", base_model=str(saved / "target"),
               tree=[[0], [0, 0], [1]])
    common = ["generate", "--model", str(saved / "target"), "--dtype", "float32", "--prompt", "w5 w6 w7",
              "--max-new-tokens", "10", "--json"]
    _, ar, _ = run(capsys, *common)
    rc, hy, _ = run(capsys, *common, "--method", "hydra", "--heads", str(tmp_path / "heads"))
    assert rc == 0 and json.loads(hy)["token_ids"] == json.loads(ar)["token_ids"]
    rc, _, err = run(capsys, *common, "--method", "medusa", "--heads", str(tmp_path / "heads"))
    assert rc == 2 and "holds hydra heads, not medusa heads" in err
    rc, _, err = run(capsys, *common, "--method", "hydra")
    assert rc == 2 and "needs --heads DIR" in err


def test_train_heads_command(saved, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [f"w{i} w{i + 1} w{i + 2}"]})
                                 for i in range(5)))
    out = tmp_path / "heads"
    rc, stdout, _ = run(capsys, "train-heads", "--model", str(saved / "target"), "--dtype", "float32", "--kind",
                        "hydra++", "--prompts", str(prompts), "--out", str(out), "--epochs", "1",
                        "--max-new-tokens", "8", "--num-heads", "2", "--heldout", "0.5")
    assert rc == 0
    assert "head 1: held-out top-1" in stdout
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["kind"] == "hydra" and cfg["num_layers"] == 4 and cfg["num_heads"] == 2 and cfg["prefix_layer"]
    assert cfg["train_prompts"]["questions"] == 5 and cfg["variant"] == "hydra++"
    assert len((out / "answers.jsonl").read_text().splitlines()) == 5
    # a second kind reuses those answers (--data), skipping the first 2 prompts (kept for evaluation),
    # plus docstring prompts from installed modules
    rc, _, err = run(capsys, "train-heads", "--model", str(saved / "target"), "--dtype", "float32", "--kind",
                     "medusa", "--prompts", str(prompts), "--skip", "2", "--docstring-prompts", "2", "--data",
                     str(out / "answers.jsonl"), "--out", str(tmp_path / "med"), "--epochs", "1",
                     "--max-new-tokens", "8", "--num-heads", "2")
    assert rc == 0, err
    rows = [json.loads(x) for x in (out / "answers.jsonl").read_text().splitlines()]
    assert len(rows) == 7 and sum(r["id"].startswith("doc-") for r in rows) == 2
    cfg = json.loads((tmp_path / "med" / "config.json").read_text())
    assert cfg["train_prompts"]["skip_per_category"] == 2 and cfg["train_prompts"]["questions"] == 3
    rc, _, err = run(capsys, "train-heads", "--model", str(saved / "target"), "--kind", "medusa", "--out",
                     str(tmp_path / "x"))
    assert rc == 2 and "--docstring-prompts" in err
    # --data alone: train on the answers file as it is, generating nothing
    rc, _, err = run(capsys, "train-heads", "--model", str(saved / "target"), "--dtype", "float32", "--kind", "hydra",
                     "--data", str(out / "answers.jsonl"), "--out", str(tmp_path / "reuse"), "--epochs", "1",
                     "--num-heads", "2", "--grad-accum", "2")
    assert rc == 0, err
    assert len((out / "answers.jsonl").read_text().splitlines()) == 7
    cfg = json.loads((tmp_path / "reuse" / "config.json").read_text())
    assert cfg["train_prompts"]["answers_by_source"] == {"p": 5, "doc": 2}
    # Medusa-2 changes the base: refused for a bf16 base, with a one-line message
    rc, _, err = run(capsys, "train-heads", "--model", str(saved / "target"), "--dtype", "bfloat16", "--kind",
                     "medusa", "--joint", "--epochs", "2", "--prompts", str(prompts), "--data",
                     str(out / "answers.jsonl"), "--out", str(tmp_path / "j"), "--max-new-tokens", "8")
    assert rc == 2 and "float32" in err and "Traceback" not in err


def test_eagle3_heads_train_draft_and_export(saved, tmp_path, capsys):
    """train-heads --kind eagle3, drafting with them (--method eagle, and inside auto) equal to plain decoding,
    and export-heads writing the speculators layout (loaded back by speculators itself in test_eagle); other kinds
    refused."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [f"w{i} w{i + 1}"]})
                                 for i in range(4)))
    target, out = str(saved / "target"), tmp_path / "e3"
    rc, _, err = run(capsys, "train-heads", "--model", target, "--dtype", "float32", "--kind", "eagle3", "--prompts",
                     str(prompts), "--out", str(out), "--epochs", "1", "--max-new-tokens", "8", "--num-heads", "3",
                     "--eagle-intermediate", "32", "--draft-vocab", "40")
    assert rc == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["kind"] == "eagle3" and len(cfg["feature_layers"]) >= 2 and cfg["draft_vocab"] == 40
    opt = torch.load(out / "train_state.pt", weights_only=False)["opt"]  # no --lr: the kind's own rate
    assert opt["param_groups"][0]["initial_lr"] == default_lr("eagle3") < default_lr("hydra")
    common = ["generate", "--model", target, "--dtype", "float32", "--prompt", "w5 w6 w7", "--max-new-tokens", "10",
              "--json"]
    _, ar, _ = run(capsys, *common, "--method", "ar")
    rc, e3, err = run(capsys, *common, "--method", "eagle", "--heads", str(out))
    assert rc == 0, err
    assert json.loads(e3)["token_ids"] == json.loads(ar)["token_ids"]
    rc, au, err = run(capsys, *common, "--method", "auto", "--heads", str(out))  # the head follows inside auto
    assert rc == 0, err
    assert json.loads(au)["token_ids"] == json.loads(ar)["token_ids"]
    rc, _, err = run(capsys, "export-heads", "--model", target, "--dtype", "float32", "--heads", str(out), "--out",
                     str(tmp_path / "spec"), "--verifier", "Org/Base-1B")
    assert rc == 0, err
    spec = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3" and spec["draft_vocab_size"] == 40
    assert spec["eagle_aux_hidden_state_layer_ids"] == cfg["feature_layers"]
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "Org/Base-1B"
    assert (tmp_path / "spec" / "model.safetensors").stat().st_size > 0
    from hydraspec.heads import build_heads, save_heads
    from hydraspec.models import load_model

    model, _ = load_model(target, dtype="float32", device="cpu")
    save_heads(build_heads("hydra", model, num_heads=2), tmp_path / "hy", base_model=target)
    rc, _, err = run(capsys, "export-heads", "--model", target, "--dtype", "float32", "--heads", str(tmp_path / "hy"),
                     "--out", str(tmp_path / "x"))
    assert rc == 2 and "no format another engine loads" in err and "Traceback" not in err


def test_train_heads_on_answers_another_model_wrote(saved, tmp_path, capsys):
    """--answers-model: a model with the target's tokenizer writes the answers (its own greedy ones, which are
    not the target's), and the target's distributions over them are what the heads learn. A kind that learns
    the answer tokens themselves refuses it, and so does a model with another vocabulary."""
    from hydraspec import SpeculativeGenerator

    writer = tiny.make_model("llama", seed=3)
    tok = tiny.make_tokenizer()
    writer.save_pretrained(tmp_path / "writer")
    tok.save_pretrained(tmp_path / "writer")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [f"w{i} w{i + 3} w{i + 1}"]})
                                 for i in range(4)))
    common = ["train-heads", "--model", str(saved / "target"), "--dtype", "float32", "--prompts", str(prompts),
              "--epochs", "1", "--max-new-tokens", "8", "--num-heads", "2", "--heldout", "0.5"]
    out = tmp_path / "heads"
    rc, stdout, err = run(capsys, *common, "--kind", "hydra++", "--answers-model", str(tmp_path / "writer"),
                          "--out", str(out))
    assert rc == 0, err
    assert "head 1: held-out top-1" in stdout
    target = tiny.make_model("llama", seed=0)
    rows = [json.loads(x) for x in (out / "answers.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for r in rows:
        assert r["answer_ids"] == SpeculativeGenerator(writer, tok).generate(
            input_ids=r["prompt_ids"], max_new_tokens=8).token_ids
    assert any(r["answer_ids"] != SpeculativeGenerator(target, tok).generate(
        input_ids=r["prompt_ids"], max_new_tokens=8).token_ids for r in rows)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["train_prompts"]["answers_model"] == str(tmp_path / "writer") and cfg["kind_detail"]["distill"]
    rc, _, err = run(capsys, *common, "--kind", "medusa", "--answers-model", str(tmp_path / "writer"),
                     "--out", str(tmp_path / "m"))
    assert rc == 2 and "use hydra++ or eagle" in err
    rc, _, err = run(capsys, *common, "--kind", "hydra++", "--answers-model", str(saved / "other"),
                     "--out", str(tmp_path / "o"))
    assert rc == 2 and "incompatible" in err


def test_distilled_heads_of_the_qwen_target_learn_from_answers_its_smaller_sibling_writes():
    """By default the distilled kinds of the offline Qwen2.5-Coder 1.5B take their answers from the registry's
    0.5B (the same tokenizer, a third of the data's CPU time); kinds that learn the answer tokens themselves,
    models without such a sibling and --answers-model none keep the base's own answers."""
    from hydraspec.models import REGISTRY, default_writer
    from hydraspec.train.job import HeadsJob

    qwen = "qwen2.5-coder-1.5b-instruct"
    for kind in ("hydra++", "eagle", "eagle3"):
        assert HeadsJob(model=qwen, out="o", kind=kind).writer() == "qwen2.5-coder-0.5b-instruct"
    assert HeadsJob(model=qwen, out="o", kind="medusa").writer() is None
    assert HeadsJob(model=qwen, out="o", kind="hydra++", answers_model="none").writer() is None
    assert HeadsJob(model="smollm2-135m-instruct", out="o", kind="hydra++").writer() is None
    assert HeadsJob(model=qwen, out="o", kind="eagle", answers_model="w").writer() == "w"
    for name in REGISTRY:  # a writer is itself an offline model (it is pulled as the base is)
        assert default_writer(name) is None or default_writer(name) in REGISTRY


def test_bench_and_serve_compile_where_they_can_by_default_and_generate_does_not(saved):
    """bench and serve default to --compile auto (compiled where it can be done, quietly eager elsewhere),
    generate to eager; --compile / --no-compile override; auto on a model not at a GGUF precision loads it
    eagerly without a warning, where an explicit --compile warns why."""
    import warnings

    from hydraspec.cli import make_parser
    from hydraspec.models import load_model

    p = make_parser()
    common = ["--model", str(saved / "target")]
    assert p.parse_args(["generate", *common, "--prompt", "x"]).compile is False
    assert p.parse_args(["serve", *common]).compile == "auto"
    bench = ["bench", *common, "--prompts", "p.jsonl", "--out", "o"]
    assert p.parse_args(bench).compile == "auto"
    assert p.parse_args([*bench, "--no-compile"]).compile is False
    assert p.parse_args(["generate", *common, "--prompt", "x", "--compile"]).compile is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, _ = load_model(str(saved / "target"), dtype="float32", device="cpu", compile="auto")
    assert not getattr(model, "hs_compiled", False)
    with pytest.warns(UserWarning, match="uncompiled"):
        load_model(str(saved / "target"), dtype="float32", device="cpu", compile=True)
