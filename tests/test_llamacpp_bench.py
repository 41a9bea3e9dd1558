"""The llama.cpp baselines of `hydraspec bench`: command lines, requests, replies, the time-to-first-token
split, and (where llama.cpp's server is built and SmolLM2 is pulled) a real server answering token ids."""
from __future__ import annotations

import pytest

from hydraspec import HydraspecError
from hydraspec.bench import llamacpp, stats
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


def test_server_command_per_kind():
    ar = llamacpp.server_command("/bin/llama-server", "t.gguf", 2, 9, "ar")
    assert ar[:3] == ["/bin/llama-server", "-m", "t.gguf"] and "-md" not in ar and "--spec-type" not in ar
    assert ar[ar.index("-t") + 1] == "2" and ar[ar.index("--port") + 1] == "9" and "--no-cache-prompt" in ar
    d = llamacpp.server_command("x", "t.gguf", 2, 9, "draft", "d.gguf", "--spec-draft-n-max 16")
    assert d[d.index("-md") + 1] == "d.gguf" and d[-2:] == ["--spec-draft-n-max", "16"]
    n = llamacpp.server_command("x", "t.gguf", 2, 9, "ngram")
    assert n[n.index("--spec-type") + 1] == "ngram-simple"
    with pytest.raises(HydraspecError, match="draft-model"):
        llamacpp.server_command("x", "t.gguf", 2, 9, "draft")


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


def test_missing_server_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRASPEC_LLAMACPP_BIN", str(tmp_path))
    with pytest.raises(HydraspecError, match="build_llamacpp.sh"):
        llamacpp.server_binary()
    assert {"llamacpp-ar", "llamacpp-draft", "llamacpp-ngram"} <= set(METHODS)
    assert METHODS["llamacpp-draft"].needs_draft


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
