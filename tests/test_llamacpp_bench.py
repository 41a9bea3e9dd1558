"""The llama.cpp baselines of `hydraspec bench`: command lines, requests, replies, the time-to-first-token
split, the drafting counts and the refusal of speculation that drafted nothing, the best llama.cpp method,
and (where llama.cpp's server is built and SmolLM2 is pulled) a real server answering token ids."""
from __future__ import annotations

import pytest

from hydraspec import HydraspecError
from hydraspec.bench import llamacpp, report, stats
from hydraspec.bench.methods import METHODS


def _rec(method, turns):
    return {"method": method, "question_id": 1, "category": "a",
            "turns": [{"new_tokens": n, "wall_s": w, "prefill_s": p, "target_forwards": None,
                       "token_ids": list(range(n))} for n, w, p in turns]}


def test_ttft_and_decode_speed_are_split_from_the_overall_figure():
    s = stats.summarize([_rec("ar", [(10, 2.0, 0.5), (5, 1.0, 0.25)]),
                         _rec("llamacpp-ar", [(10, 1.0, 0.5), (5, 1.0, 0.5)])], ["ar", "llamacpp-ar"])
    ar, lc = s["table"]["ar"]["overall"], s["table"]["llamacpp-ar"]["overall"]
    assert ar["ttft_s"] == pytest.approx(0.375)
    assert ar["decode_tokens_per_s"] == pytest.approx((15 - 2) / (3.0 - 0.75))
    assert lc["decode_tokens_per_s"] == pytest.approx(13 / 1.0)
    assert ar["speedup_vs_llamacpp_ar"] == pytest.approx((15 / 3.0) / (15 / 2.0))
    assert s["reference"] == "ar"  # llama.cpp's answers are compared for speed only
    s2 = stats.summarize([_rec("hf-ar", [(3, 1.0, None)])], ["hf-ar"])
    assert s2["table"]["hf-ar"]["overall"]["ttft_s"] is None


def _types(cmd):
    return cmd[cmd.index("--spec-type") + 1] if "--spec-type" in cmd else None


def test_server_command_per_kind():
    ar = llamacpp.server_command("/bin/llama-server", "t.gguf", 2, 9, "ar")
    assert ar[:3] == ["/bin/llama-server", "-m", "t.gguf"] and "-md" not in ar and "--spec-type" not in ar
    assert ar[ar.index("-t") + 1] == "2" and ar[ar.index("--port") + 1] == "9" and "--no-cache-prompt" in ar
    # a draft model speculates only with --spec-type draft-simple; llama.cpp's default draft settings given
    d = llamacpp.server_command("x", "t.gguf", 2, 9, "draft", "d.gguf", "--spec-draft-n-max 16")
    assert d[d.index("-md") + 1] == "d.gguf" and _types(d) == "draft-simple"
    assert d[d.index("-td") + 1] == "2" and d[d.index("-tbd") + 1] == "2"
    assert d[d.index("--spec-draft-n-max") + 1] == "3" and d[d.index("--spec-draft-n-min") + 1] == "0"
    assert d[d.index("--spec-draft-p-min") + 1] == "0.0"
    assert d[-2:] == ["--spec-draft-n-max", "16"]  # extra arguments last: they win
    for kind in ("ngram-simple", "ngram-mod", "ngram-map-k", "ngram-map-k4v", "ngram-cache"):
        n = llamacpp.server_command("x", "t.gguf", 2, 9, kind)
        assert _types(n) == kind and "-md" not in n and "--spec-draft-n-max" not in n
    assert _types(llamacpp.server_command("x", "t.gguf", 2, 9, "ngram")) == "ngram-simple"  # the old name
    c = llamacpp.server_command("x", "t.gguf", 2, 9, "ngram-mod+draft", "d.gguf")
    assert _types(c) == "ngram-mod,draft-simple" and c[c.index("-md") + 1] == "d.gguf"
    assert _types(llamacpp.server_command("x", "t.gguf", 2, 9, "ngram-simple+draft", "d.gguf")) == \
        "ngram-simple,draft-simple"
    for kind in ("draft", "ngram-mod+draft"):
        with pytest.raises(HydraspecError, match="draft-model"):
            llamacpp.server_command("x", "t.gguf", 2, 9, kind)
    with pytest.raises(ValueError):
        llamacpp.server_command("x", "t.gguf", 2, 9, "beam")


def test_request_is_greedy_or_plain_sampling():
    g = llamacpp.request_body([1, 2], 8, 0.0, None)
    assert g["prompt"] == [1, 2] and g["n_predict"] == 8 and g["top_k"] == 1 and g["samplers"] == ["top_k"]
    assert g["cache_prompt"] is False
    s = llamacpp.request_body([1], 8, 0.7, 3)
    assert s["temperature"] == 0.7 and s["seed"] == 3 and s["top_k"] == 0 and s["samplers"][-1] == "dist"


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_reply_counts_the_end_token_like_the_engine():
    r = llamacpp.turn_result({"tokens": [5, 6], "stop_type": "eos", "timings": {"prompt_ms": 250.0}}, 7, 1.5,
                             [2], _Tok())
    assert r.token_ids == [5, 6, 2] and r.finish_reason == "eos" and r.prefill_s == pytest.approx(0.25)
    r = llamacpp.turn_result({"tokens": [5, 6], "stop_type": "limit", "timings": {}}, 7, 1.5, [2], _Tok())
    assert r.token_ids == [5, 6] and r.finish_reason == "length" and r.prefill_s is None


def test_drafted_counts_come_from_the_server_timings():
    timings = {"prompt_ms": 10.0, "predicted_n": 40, "draft_n": 30, "draft_n_accepted": 21}
    r = llamacpp.turn_result({"tokens": [5] * 40, "stop_type": "limit", "timings": timings}, 7, 1.0, [2], _Tok())
    assert (r.drafted, r.draft_accepted) == (30, 21)
    assert r.to_dict()["drafted"] == 30
    # the server leaves draft_n out when it drafted nothing: 0, not unknown
    assert llamacpp.draft_counts({"prompt_ms": 1.0, "predicted_n": 4}) == (0, 0)
    assert llamacpp.draft_counts({}) == (None, None)


def test_a_server_that_cannot_speculate_is_refused_at_start():
    with pytest.raises(HydraspecError, match="llamacpp-draft: llama-server started without speculative decoding"):
        llamacpp.check_speculating("llamacpp-draft", [{"id": 0, "speculative": False}], "x.log")
    llamacpp.check_speculating("llamacpp-draft", [{"id": 0, "speculative": True}], "x.log")
    llamacpp.check_speculating("llamacpp-draft", None, "x.log")  # /slots off: the report's check still applies


def _drec(method, qid, cat, n, wall, drafted=None, accepted=None):
    turn = {"new_tokens": n, "wall_s": wall, "prefill_s": 0.1, "target_forwards": None,
            "token_ids": list(range(n))}
    if drafted is not None:
        turn.update(drafted=drafted, draft_accepted=accepted)
    return {"method": method, "question_id": qid, "category": cat, "turns": [turn]}


def test_speculation_that_drafted_nothing_is_not_reported_as_speculation():
    recs = [_drec("ar", 1, "a", 10, 1.0), _drec("ar", 2, "b", 10, 1.0),
            _drec("llamacpp-ar", 1, "a", 10, 2.0, 0, 0), _drec("llamacpp-ar", 2, "b", 10, 2.0, 0, 0),
            # fastest of all, but its server drafted nothing: plain decoding, not the best llama.cpp method
            _drec("llamacpp-ngram-mod", 1, "a", 10, 0.5, 0, 0), _drec("llamacpp-ngram-mod", 2, "b", 10, 0.5, 0, 0),
            _drec("llamacpp-draft", 1, "a", 10, 1.0, 12, 8), _drec("llamacpp-draft", 2, "b", 10, 1.5, 9, 3),
            _drec("llamacpp-ngram", 1, "a", 10, 0.4), _drec("llamacpp-ngram", 2, "b", 10, 0.4)]  # old records
    s = stats.summarize(recs, ["ar", "llamacpp-ar", "llamacpp-ngram-mod", "llamacpp-draft", "llamacpp-ngram"])
    assert s["llamacpp"] == {"best": "llamacpp-draft", "no_drafts": ["llamacpp-ngram-mod"],
                             "not_recorded": ["llamacpp-ngram"]}
    t = s["table"]
    assert t["llamacpp-draft"]["overall"]["drafted"] == 21 and t["llamacpp-draft"]["overall"]["draft_accepted"] == 11
    assert t["ar"]["overall"]["drafted"] is None
    assert t["ar"]["overall"]["speedup_vs_best_llamacpp"] == pytest.approx((20 / 2.0) / (20 / 2.5))
    assert t["ar"]["categories"]["b"]["speedup_vs_best_llamacpp"] == pytest.approx(1.5)
    assert t["llamacpp-draft"]["overall"]["speedup_vs_best_llamacpp"] == pytest.approx(1.0)
    md = report.markdown(s, {"command": ["hydraspec", "bench"]}, {"model": "m", "max_new_tokens": 10})
    assert "Best llama.cpp method: **llamacpp-draft**" in md
    assert "## Speedup over the best llama.cpp method (llamacpp-draft)" in md
    assert "WARNING: llamacpp-ngram-mod's server drafted nothing over the whole run" in md
    assert "| llamacpp-ngram-mod (NO DRAFTS: decoded plainly) |" in md
    assert "| llamacpp-ngram (drafting not recorded) |" in md
    assert "| llamacpp-draft | 21 | 11 | 52% |" in md
    # plain llama.cpp is a method in its own right: it can be the best one
    s2 = stats.summarize(recs[:4], ["ar", "llamacpp-ar"])
    assert s2["llamacpp"]["best"] == "llamacpp-ar" and not s2["llamacpp"]["no_drafts"]
    assert stats.summarize(recs[:2], ["ar"])["llamacpp"]["best"] is None
    assert "llama.cpp" not in report.markdown(stats.summarize(recs[:2], ["ar"]), {}, {})


def test_missing_server_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRASPEC_LLAMACPP_BIN", str(tmp_path))
    with pytest.raises(HydraspecError, match="build_llamacpp.sh"):
        llamacpp.server_binary()
    names = {"llamacpp-ar", "llamacpp-draft", "llamacpp-ngram", "llamacpp-ngram-simple", "llamacpp-ngram-mod",
             "llamacpp-ngram-map-k", "llamacpp-ngram-map-k4v", "llamacpp-ngram-cache", "llamacpp-ngram-simple+draft",
             "llamacpp-ngram-mod+draft"}
    assert names <= set(METHODS)
    assert {m for m in names if METHODS[m].needs_draft} == {"llamacpp-draft", "llamacpp-ngram-simple+draft",
                                                           "llamacpp-ngram-mod+draft"}
    assert METHODS["llamacpp-ngram-mod+draft"].settings == ("llamacpp_args", "draft_model")


def _smollm2_gguf():
    from hydraspec.models import REGISTRY, hydraspec_home

    p = hydraspec_home() / "gguf" / "smollm2-135m-instruct.gguf"
    return p if p.is_file() and p.stat().st_size == REGISTRY["smollm2-135m-instruct"].gguf_size else None


@pytest.mark.skipif(not (llamacpp.binary_dir() / llamacpp.SERVER).is_file() or _smollm2_gguf() is None,
                    reason="llama.cpp's server (scripts/build_llamacpp.sh) or SmolLM2 not here")
def test_real_llama_server_answers_token_ids_greedily(tmp_path):
    cmd = llamacpp.server_command(llamacpp.server_binary(), str(_smollm2_gguf()), 2, 0, "ar")
    server = llamacpp.LlamaServer(cmd, tmp_path / "server.log")
    try:
        body = llamacpp.request_body([1, 9690, 198, 19556, 314, 260, 3575, 282, 4649, 47, 2, 198], 12, 0.0, None)
        a, b = server.complete(body), server.complete(body)
        r = llamacpp.turn_result(a, 12, 1.0, [2], _Tok())
        assert 0 < len(r.token_ids) <= 13 and a["tokens"] == b["tokens"]  # greedy: the same twice
        assert r.prefill_s is not None and r.prefill_s > 0
    finally:
        server.close()
    assert server.proc.poll() is not None
