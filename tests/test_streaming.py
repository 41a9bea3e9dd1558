"""Streaming and stop strings on a tiny model."""
import threading

from transformers import TextIteratorStreamer

import tiny
from hydraspec import SpeculativeGenerator, make_drafter


def _gen(tok, method="pld"):
    model = tiny.cached_model("llama", "sdpa", 1)
    drafter = make_drafter("draft", draft_model=tiny.noisy_copy(model, 0.05)) if method == "draft" else make_drafter(method)
    return SpeculativeGenerator(model, tok, drafter)


PROMPT = "w3 w4 w5 w6 w3 w4 w5 w6 w3 w4"


def test_text_iterator_streamer_receives_exactly_the_answer(tok):
    for method in ("ar", "pld", "draft"):
        gen = _gen(tok, method)
        streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
        box = {}
        th = threading.Thread(target=lambda: box.update(r=gen.generate(PROMPT, max_new_tokens=20, streamer=streamer)))
        th.start()
        chunks = list(streamer)
        th.join()
        res = box["r"]
        assert "".join(chunks).strip() == res.text.strip()
        assert res.text.strip() == tok.decode(res.token_ids, skip_special_tokens=True).strip()


class _Recorder:
    """Minimal streamer: records what put() receives, like transformers' BaseStreamer."""

    def __init__(self):
        self.calls, self.ended = [], False

    def put(self, value):
        self.calls.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_gets_prompt_first_then_every_new_token_once(tok):
    gen = _gen(tok, "pld")
    rec = _Recorder()
    res = gen.generate(PROMPT, max_new_tokens=17, streamer=rec)
    assert rec.calls[0] == res.prompt_ids
    assert sum(rec.calls[1:], []) == res.token_ids
    assert rec.ended
    # with drafting, some puts carry several accepted tokens at once
    assert res.stats.target_forwards == len(rec.calls) - 1


def test_stop_string_ends_the_answer(tok):
    gen = _gen(tok, "ar")
    full = gen.generate(PROMPT, max_new_tokens=20)
    words = full.text.split()
    stop = words[5]
    first = words.index(stop)
    for method in ("ar", "pld", "draft"):
        res = _gen(tok, method).generate(PROMPT, max_new_tokens=20, stop=[stop])
        assert res.finish_reason == "stop"
        assert res.token_ids == full.token_ids[: first + 1]
        assert res.text.split()[-1] == stop
        assert res.stats.new_tokens == len(res.token_ids)
        assert sum(i * c for i, c in enumerate(res.stats.accept_hist)) == res.stats.new_tokens


def test_attention_without_4d_masks_is_refused():
    import types

    import pytest

    from hydraspec import HydraspecError
    from hydraspec.verify import check_supported

    for impl in ("flash_attention_2", "flex_attention", "paged|sdpa"):
        fake = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation=impl))
        with pytest.raises(HydraspecError, match="cannot take a 4D tree attention mask"):
            check_supported(fake)
    check_supported(types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="sdpa")))
