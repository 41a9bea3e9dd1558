"""The OpenVINO GenAI baselines of `hydraspec bench` (ov-ar, ov-draft, ov-pld) without OpenVINO: where the
exports are looked for, the generation settings, and how a pipeline's answer becomes a TurnResult."""
from __future__ import annotations

import pytest

from hydraspec import HydraspecError
from hydraspec.bench import openvino as ovb
from hydraspec.bench.methods import METHODS


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _Config:  # the attributes of openvino_genai.GenerationConfig that the bench sets
    pass


class _GenAI:
    GenerationConfig = _Config


def test_methods_are_registered():
    assert {"ov-ar", "ov-draft", "ov-pld"} <= set(METHODS)
    assert METHODS["ov-draft"].needs_draft and not METHODS["ov-pld"].needs_draft


def test_export_is_looked_for_by_name_and_its_absence_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRASPEC_OPENVINO_HOME", str(tmp_path))
    with pytest.raises(HydraspecError, match="optimum-cli export openvino .*--weight-format int4"):
        ovb.export_dir("qwen2.5-coder-1.5b-instruct")
    d = tmp_path / "qwen2.5-coder-1.5b-instruct-int4"
    d.mkdir()
    (d / "openvino_model.xml").write_text("<net/>")
    assert ovb.export_dir("qwen2.5-coder-1.5b-instruct") == d
    assert ovb.export_dir("/some/where/qwen2.5-coder-1.5b-instruct.gguf") == d


def test_generation_settings_per_kind():
    g = ovb.generation_config(_GenAI, "ar", 64, 0.0, None, [2, 7])
    assert g.max_new_tokens == 64 and g.do_sample is False and g.stop_token_ids == {2, 7}
    assert not hasattr(g, "num_assistant_tokens")
    d = ovb.generation_config(_GenAI, "draft", 8, 0.0, None, [2])
    assert d.num_assistant_tokens == 5 and not hasattr(d, "max_ngram_size")
    p = ovb.generation_config(_GenAI, "pld", 8, 0.7, 3, [2])
    assert (p.num_assistant_tokens, p.max_ngram_size) == (5, 3)
    assert p.do_sample is True and p.temperature == 0.7 and p.rng_seed == 3 and p.top_p == 1.0


def test_answer_counts_steps_and_the_end_token():
    # prompt lookup: 5 tokens in 3 target steps (one step accepted 2 drafts); OpenVINO keeps the end token
    r = ovb.turn_result([4, 5, 6, 8, 2], True, [1, 3, 1], 120.0, None, None, 9, 0.5, [2], _Tok())
    assert r.token_ids == [4, 5, 6, 8, 2] and r.finish_reason == "eos"
    assert r.target_forwards == 3 and r.mean_accepted == pytest.approx(5 / 3) and r.draft_accepted == 2
    assert r.drafted is None and r.prefill_s == pytest.approx(0.12)
    # the draft model's pipeline reports what it drafted
    r = ovb.turn_result([4, 5, 6], False, [1, 2], 10.0, 4, 1, 9, 0.5, [2], _Tok())
    assert r.finish_reason == "length" and (r.drafted, r.draft_accepted) == (4, 1) and r.target_forwards == 2
    # a stop on an end token the pipeline left out is counted, as the engine counts it
    r = ovb.turn_result([4], True, [], None, None, None, 9, 0.5, [2], _Tok())
    assert r.token_ids == [4, 2] and r.target_forwards is None and r.prefill_s is None
