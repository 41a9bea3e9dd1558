"""`hydraspec serve` on a tiny random model, driven over loopback by the official `openai` client (and raw
httpx for malformed input): answers equal `SpeculativeGenerator.generate`'s, streams concatenate to the
plain answer, concurrent requests of very different lengths each equal their single answer, bad input
gets OpenAI error objects, a client that leaves mid-stream frees its row, the API key is enforced."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

import tiny
from hydraspec import SpeculativeGenerator, make_drafter
from hydraspec.batch import BatchGenerator
from hydraspec.serve.answer import ClosingStream
from hydraspec.serve.kept_answers import KeptAnswers
from hydraspec.serve.server import build_server
from hydraspec.train.data import load_answers

SEED = 3
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}w1"


def tokenizer():
    t = tiny.make_tokenizer()
    t.chat_template = TEMPLATE
    return t


@functools.lru_cache(maxsize=None)
def target():
    return tiny.cached_model("llama", "sdpa", SEED)


@functools.lru_cache(maxsize=None)
def draft():
    return tiny.noisy_copy(target(), 0.05, seed=7)


def drafter(method):
    if method == "draft":
        return make_drafter("draft", draft_model=draft(), target_tokenizer=tokenizer(), draft_tokenizer=tokenizer())
    if method == "pld":
        return make_drafter("pld", num_tokens=6)
    if method == "pld+hydra++":  # per-row state in both parts: the prefix-layer cache and the lookup
        from test_batch import TREE, heads

        return make_drafter("pld+hydra++", heads=heads("hydra++"), embed=target().get_input_embeddings(), tree=TREE,
                            pld_tokens=5, pld_min_ngram=1)
    if method == "auto":  # extra verify tokens free here, so predictions and lookups always pay
        from hydraspec.drafters.auto import AutoDrafter
        from hydraspec.drafters.prediction import PredictionDrafter

        return AutoDrafter({"prediction": PredictionDrafter(), "pld": make_drafter("pld", dynamic=False)},
                           {1: 1.0, 64: 1.0})
    return make_drafter("ar")


def single(method, text, max_tokens):
    g = SpeculativeGenerator(target(), tokenizer(), drafter(method))
    return g.generate([{"role": "user", "content": text}], max_new_tokens=max_tokens).text


@contextlib.contextmanager
def server(method="pld", *, max_batch=4, max_queue=16, api_key=None, max_context=200, adaptive=True,
           prefix_tokens=0, tok=None, keep_answers=None, drafter_obj=None, learner=None):
    bg = BatchGenerator(target(), tok or tokenizer(), drafter_obj or drafter(method))
    app, worker, _ = build_server(bg, "tiny", max_batch=max_batch, max_context=max_context, max_queue=max_queue,
                                  api_key=api_key, adaptive=adaptive, say=lambda m: None,
                                  prefix_tokens=prefix_tokens, keep_answers=keep_answers, learner=learner)
    cfg = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    srv = uvicorn.Server(cfg)
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    t0 = time.monotonic()
    while not srv.started:
        assert time.monotonic() - t0 < 60 and th.is_alive(), "server did not start"
        time.sleep(0.02)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", worker
    finally:
        srv.should_exit = True
        th.join(30)
        assert not th.is_alive()


def client(base, key="none"):
    return openai.OpenAI(base_url=base + "/v1", api_key=key, timeout=60, max_retries=0)


PROMPTS = ["w5 w9 w12 w5 w9", "w40 w41 w42 w43 w44 w45 w46 w40 w41", "w7", "w3 w3 w3 w3 w8 w3 w3 w3",
           "w60 w61 w62", "w2 w4 w6 w8 w10 w2 w4", "w30 w31 w30 w31 w30", "w90 w80 w70 w60 w50 w40"]


def chat(c, text, max_tokens, **kw):
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], temperature=0,
                                  max_tokens=max_tokens, **kw)
    return r


@pytest.mark.parametrize("method", ["ar", "pld", "draft", "pld+hydra++"])
def test_chat_equals_generate_and_stream_concatenates(method):
    with server(method) as (base, _):
        c = client(base)
        assert [m.id for m in c.models.list()] == ["tiny"]
        r = chat(c, PROMPTS[0], 24)
        want = single(method, PROMPTS[0], 24)
        assert r.choices[0].message.content == want and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens > 0
        parts = [ch.choices[0].delta.content or "" for ch in
                 c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                           temperature=0, max_tokens=24, stream=True) if ch.choices]
        assert len([p for p in parts if p]) > 1 and "".join(parts) == want
        comp = c.completions.create(model="tiny", prompt=PROMPTS[1], temperature=0, max_tokens=10)
        plain = SpeculativeGenerator(target(), tokenizer(), drafter(method)).generate(PROMPTS[1], max_new_tokens=10,
                                                                                      chat=False)
        assert comp.choices[0].text == plain.text
    # usage reports the request's own accepted tokens per forward: with the drafter's own lengths (no
    # adaptive rule, whose choices follow the clock) it is what a replay counts; the prompt repeats, so
    # every drafter gets some of its drafts accepted
    with server(method, adaptive=False) as (base, _):
        got = chat(client(base), PROMPTS[0], 24).usage.model_extra["mean_accepted_tokens_per_forward"]
    replay = SpeculativeGenerator(target(), tokenizer(), drafter(method), adaptive=False).generate(
        [{"role": "user", "content": PROMPTS[0]}], max_new_tokens=24)
    assert got == round(replay.stats.mean_accepted, 4)
    assert (got == 1.0) if method == "ar" else (got > 1.0), got


@pytest.mark.parametrize("method", ["pld", "pld+hydra++"])
def test_concurrent_requests_equal_their_single_answers(method):
    lengths = [3, 40, 7, 60, 12, 25, 5, 50]
    want = [single(method, p, n) for p, n in zip(PROMPTS, lengths)]
    with server(method, max_batch=4) as (base, worker):
        rows_seen = []
        step = worker.engine.step

        def spy():
            done = step()
            rows_seen.append(worker.engine.last_rows)
            return done
        worker.engine.step = spy
        c = client(base)
        got = [None] * len(PROMPTS)

        def ask(i):
            got[i] = chat(c, PROMPTS[i], lengths[i]).choices[0].message.content
        ths = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in ths:
            t.start()
        for t in ths:
            t.join(120)
        assert got == want
        assert max(rows_seen) > 1  # requests really shared forwards


def _error(resp, status):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and body["error"]["message"] and body["error"]["type"]
    return body["error"]


def test_bad_input_gets_error_objects():
    with server("ar", max_context=64) as (base, _):
        url = base + "/v1/chat/completions"
        msg = [{"role": "user", "content": "w5 w6"}]
        with httpx.Client(timeout=30) as h:
            _error(h.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400)
            assert "messages" in _error(h.post(url, json={"model": "tiny"}), 400)["message"]
            _error(h.post(url, json={"model": "tiny", "messages": msg, "max_tokens": -3}), 400)
            _error(h.post(url, json={"model": "tiny", "messages": msg, "max_tokens": 0}), 400)
            e = _error(h.post(url, json={"model": "gpt-9", "messages": msg}), 404)
            assert e["code"] == "model_not_found"
            long = " ".join(f"w{i % 90}" for i in range(100))
            e = _error(h.post(url, json={"model": "tiny", "messages": [{"role": "user", "content": long}]}), 400)
            assert "64" in e["message"] and e["code"] == "context_length_exceeded"
            _error(h.post(url, json={"model": "tiny", "messages": msg, "n": 2}), 400)
            _error(h.post(url, json={"model": "tiny", "messages": msg, "temperature": -1}), 400)
            _error(h.post(base + "/v1/completions", json={"model": "tiny", "prompt": ""}), 400)
            assert h.get(base + "/health").json()["status"] == "ok"
            m = h.get(base + "/metrics").text
            assert "hydraspec_requests_total" in m and "hydraspec_queue_length" in m


def test_full_queue_gets_429():
    with server("ar", max_batch=1, max_queue=0) as (base, worker):
        c = client(base)
        first = threading.Thread(target=lambda: chat(c, PROMPTS[1], 150))
        first.start()
        t0 = time.monotonic()
        while not worker.engine.active:
            assert time.monotonic() - t0 < 30
            time.sleep(0.005)
        with pytest.raises(openai.RateLimitError):
            chat(c, PROMPTS[0], 5)
        first.join(60)
        assert chat(c, PROMPTS[0], 5).choices[0].message.content == single("ar", PROMPTS[0], 5)


def test_disconnect_mid_stream_frees_the_row_and_leaves_others_intact():
    with server("pld", max_batch=4, max_context=480) as (base, worker):  # room for a long stream to cut
        finished = []
        fin = worker._finish

        def spy(req):
            finished.append(req.result.finish_reason if req.result is not None else None)
            fin(req)
        worker._finish = spy
        read, heard, cancel, tokens, sent = threading.Event(), threading.Event(), worker.cancel, worker._tokens, [0]

        def cancel_spy(req):
            cancel(req)
            heard.set()

        def tokens_spy(req, ids):  # the tiny model could end the cut stream before the server hears the client go:
            tokens(req, ids)  # once the client has read its lines, the row waits for the server to hear it leave
            if req.max_new_tokens != 400:
                return
            sent[0] += len(ids)
            if sent[0] >= 200:  # far more tokens than the client's six lines need
                read.wait(30)
            if read.is_set():
                heard.wait(30)
        worker.cancel, worker._tokens = cancel_spy, tokens_spy
        want = single("pld", PROMPTS[3], 120)
        c = client(base)
        out = []

        def keep_reading():
            s = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[3]}],
                                          temperature=0, max_tokens=120, stream=True)
            out.append("".join(ch.choices[0].delta.content or "" for ch in s if ch.choices))
        other = threading.Thread(target=keep_reading)
        other.start()
        with httpx.Client(timeout=30) as h:
            with h.stream("POST", base + "/v1/chat/completions",
                          json={"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[1]}],
                                "temperature": 0, "max_tokens": 400, "stream": True}) as r:
                lines = r.iter_lines()
                for _ in range(6):
                    next(lines)
                read.set()
        other.join(120)
        assert out == [want]
        t0 = time.monotonic()
        while worker.running_rows or "cancelled" not in finished:
            assert time.monotonic() - t0 < 30, finished
            time.sleep(0.02)
        assert "cancelled" in finished


def test_a_stream_cut_while_sending_closes_its_body_at_once():
    """A client that leaves while the server waits inside ``send`` (behind the middleware): the body generator
    is closed before the response returns, so the row is freed then, not whenever the garbage collector runs."""
    closed = []

    async def body():
        try:
            while True:
                yield "data: x\n\n"
        finally:
            closed.append(True)

    async def main():
        sent, gone = [], asyncio.Event()

        async def send(message):
            sent.append(message)
            if len(sent) == 3:
                gone.set()
            await asyncio.sleep(0)  # where a middleware's stream waits

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}
        await ClosingStream(body(), media_type="text/event-stream")({"type": "http"}, receive, send)
        assert closed == [True]  # before asyncio.run closes leftover generators itself
    gc.disable()
    try:
        asyncio.run(main())
    finally:
        gc.enable()


def test_api_key_is_enforced():
    with server("ar", api_key="s3cret") as (base, _):
        with pytest.raises(openai.AuthenticationError):
            client(base, "wrong").models.list()
        assert [m.id for m in client(base, "s3cret").models.list()] == ["tiny"]
        assert httpx.get(base + "/health").status_code == 200
        assert httpx.get(base + "/metrics").status_code == 401


def test_sampling_with_a_seed_repeats_and_differs_from_greedy():
    with server("pld") as (base, _):
        c = client(base)
        kw = dict(model="tiny", messages=[{"role": "user", "content": PROMPTS[5]}], max_tokens=20)
        a = c.chat.completions.create(temperature=1.0, seed=5, **kw).choices[0].message.content
        b = c.chat.completions.create(temperature=1.0, seed=5, **kw).choices[0].message.content
        g = c.chat.completions.create(temperature=0, **kw).choices[0].message.content
        assert a == b and a != g


def test_predicted_outputs_through_the_openai_client():
    """prediction= on both endpoints: the answer is the one without it, and usage reports how many predicted
    tokens were accepted and rejected; a prediction that is mostly right is mostly accepted."""
    want = single("ar", PROMPTS[1], 24)
    with server("auto") as (base, _):
        c = client(base)
        plain = chat(c, PROMPTS[1], 24)
        assert plain.choices[0].message.content == want
        assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
        right = chat(c, PROMPTS[1], 24, prediction={"type": "content", "content": want})
        d = right.usage.completion_tokens_details
        assert right.choices[0].message.content == want and d.accepted_prediction_tokens >= 20
        assert right.usage.model_extra["mean_accepted_tokens_per_forward"] > 3
        words = want.split()
        edited = " ".join(words[:8] + ["w99", "w98"] + words[10:])
        parts = [{"type": "text", "text": edited[:10]}, {"type": "text", "text": edited[10:]}]
        r = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                 extra_body={"prediction": {"type": "content", "content": parts}})
        assert r.choices[0].text == SpeculativeGenerator(target(), tokenizer()).generate(
            PROMPTS[1], max_new_tokens=24, chat=False).text
        d = r.usage.completion_tokens_details
        assert d.rejected_prediction_tokens > 0 and d.accepted_prediction_tokens > 0
        with pytest.raises(openai.BadRequestError, match="prediction.type"):
            chat(c, PROMPTS[1], 4, prediction={"type": "other", "content": "x"})


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_a_chat_through_the_prefix_cache_answers_as_without_it(method):
    """Each turn re-sends the conversation (as chat clients do): later turns read only the new tokens
    (usage.prompt_tokens_details.cached_tokens) and every answer is the one decoded alone, from scratch."""
    tok = tiny.make_tokenizer()  # a turn ends with a marker, as in real chat templates (w1 user, w2 assistant)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }} {{ 'w1' if m['role'] == 'user' else 'w2' }} "
                         "{% endfor %}")
    messages = []
    with server(method, prefix_tokens=2000, tok=tok) as (base, _):
        c = client(base)
        for turn, text in enumerate(PROMPTS[:3]):
            messages.append({"role": "user", "content": text})
            r = c.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12)
            g = SpeculativeGenerator(target(), tok, drafter(method))
            assert r.choices[0].message.content == g.generate(messages, max_new_tokens=12).text
            cached = r.usage.prompt_tokens_details.cached_tokens
            assert (cached == 0) if turn == 0 else (cached > 12 * turn)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})


def test_reset_prefix_cache_reads_the_next_prompt_cold_with_the_same_answer():
    """POST /reset_prefix_cache (what bench-serve --reset sends) empties the prefix pool and the suffix
    drafter's memory of earlier answers; a repeated request then reads its whole prompt, answering the same."""
    from hydraspec.bench.serve_load import reset_cache
    from hydraspec.drafters.suffix import SuffixDrafter

    bg = BatchGenerator(target(), tokenizer(), SuffixDrafter())
    with server("pld", prefix_tokens=2000) as (base, worker):
        worker.engine.drafter = suffix = bg.drafter
        c = client(base)
        first, again = chat(c, PROMPTS[1], 10), chat(c, PROMPTS[1], 10)
        assert suffix.shared.trie.tokens > 0 and again.usage.prompt_tokens_details.cached_tokens > 0
        reset_cache(base, None)
        cold = chat(c, PROMPTS[1], 10)
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        assert suffix.shared.trie.tokens == 0  # the earlier answers are gone (an answer joins at the next proposal)
        assert first.choices[0].message.content == again.choices[0].message.content == cold.choices[0].message.content


def test_adaptive_rule_drafts_less_when_verify_cost_grows():
    from hydraspec.adaptive import AdaptiveDraft

    flat = AdaptiveDraft({1: 1.0, 32: 1.0}, 8)  # free extra tokens: always the longest draft
    assert flat.best_k(1, 0.7) == 8
    steep = AdaptiveDraft({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}, 8)  # cost grows with every token: no drafting
    assert steep.best_k(1, 0.7) == 0
    knee = AdaptiveDraft({1: 1.0, 8: 1.1, 16: 2.0, 32: 4.0}, 7)
    assert knee.best_k(1, 0.8) >= 5 and knee.best_k(8, 0.8) <= 1  # long drafts alone, short in a full batch
    with torch.no_grad():
        assert AdaptiveDraft({1: 1.0, 2: 1.0}, 3).best_k(4, 0.0) == 0  # nothing is ever accepted


def test_adaptive_rule_widths_per_row():
    """After drafting, the rule cuts each row's proposal to what pays for its verify tokens: packed, a row that
    accepts well keeps more than one that rarely does (and a row that proposed nothing costs nothing);
    padded, one common length; nothing when extra tokens cost as much as whole steps."""
    from hydraspec.adaptive import AdaptiveDraft

    cost = {1: 1.0, 4: 1.0, 8: 1.2, 16: 2.0, 32: 4.0}  # 8 tokens cheap, then 0.1 a token
    rule = AdaptiveDraft(cost, 8, packed=True, cheap=True)
    keep = rule.widths(4, [8, 8, 0, 3], [0.95, 0.3, 0.9, 0.9])
    assert keep[0] > keep[1] and keep[2] == 0 and keep[3] == 3 and sum(keep) <= 12
    assert rule.widths(4, [0, 0, 0, 0], [0.9] * 4) == [0, 0, 0, 0]
    assert rule.limit(4) == 8  # a cheap drafter always proposes; widths() then cuts
    padded = AdaptiveDraft(cost, 8, packed=False)
    keep = padded.widths(4, [8, 8, 0, 3], [0.95, 0.3, 0.9, 0.9])
    assert len(set(k for k, n in zip(keep, [8, 8, 0, 3]) if k < n)) <= 1 and max(keep) <= 1  # 4 rows x 2 = 8
    steep = AdaptiveDraft({1: 1.0, 2: 2.0, 4: 4.0}, 8, packed=True)
    assert steep.widths(2, [5, 5], [0.99, 0.99]) == [0, 0]


def test_adaptive_rule_keeps_a_long_match_whose_drafts_are_accepted_whole():
    """Two rows accept their first draft half the time: one accepts the rest of its proposals whole once the
    first is (a copied span), the other accepts each draft half the time. Counted by depth, the first keeps
    all 8 drafts and the second two or three (its deep counts are few, so they lean on every row's), on a cost
    where every extra verify token costs a tenth of a step."""
    from hydraspec.adaptive import AdaptiveDraft
    from hydraspec.policy import RowStep

    rule = AdaptiveDraft({n: 1.0 + 0.1 * (n - 1) for n in (1, 2, 4, 8, 16)}, 8, packed=True, cheap=True)
    for i in range(40):
        rule.book.update([RowStep(0, [], 8, 8 if i % 2 else 0, False),
                          RowStep(1, [], 8, [0, 1, 0, 2, 0, 1, 0, 3][i % 8], False)])
    keep = rule.widths(1, [8], [rule.book.row_rates(0)])
    assert keep == [8]
    assert 2 <= rule.widths(1, [8], [rule.book.row_rates(1)])[0] <= 3
    assert rule.widths(1, [8], [rule.book.row_rates(1)[0]]) == [2]  # one rate for every depth: the same cut


def test_adaptive_rule_counts_each_grade_apart():
    """A row's proposals alternate between a grade that is never accepted (suffix decoding's one-token matches)
    and one accepted whole (long matches). Counted by grade, the rule verifies all of the second and none of the
    first; counted together (a first draft taken half the time, deeper ones always) it would keep both whole."""
    import torch

    from hydraspec.adaptive import AdaptiveDraft
    from hydraspec.drafters.base import DecodeState
    from hydraspec.policy import RowStep, StepReport
    from hydraspec.sampling import Sampling
    from hydraspec.tree import DraftTree

    rule = AdaptiveDraft({n: 1.0 + 0.1 * (n - 1) for n in (1, 2, 4, 8, 16)}, 8, packed=True, cheap=True)
    seq = [7] * 4

    def chain(grade):
        return DraftTree(torch.arange(1, 9), tuple(range(-1, 7)), grade=grade)

    def state():
        return DecodeState(list(seq), 4, Sampling(), key=0)

    for i in range(60):
        grade = 8 if i % 2 else 1
        kept = len(rule.cut([chain(grade)], [state()])[0])
        truth = list(range(1, 9)) + [50 + i] if grade == 8 else [50 + i]  # what the target decodes next
        accepted = kept if grade == 8 else 0
        seq.extend(truth[:accepted + 1])
        rule.update(StepReport(1, True, 0.01, accepted + 1, [RowStep(0, list(seq), kept, accepted, False)]))
    assert len(rule.cut([chain(8)], [state()])[0]) == 8
    assert len(rule.cut([chain(1)], [state()])[0]) == 0


def test_adaptive_rule_counts_a_step_whose_proposals_were_all_cut_as_drafting():
    """A step that asked the drafter paid for its proposals even when the cut kept none of them: it is measured
    as drafting, not as the plain decoding it is compared with (else the plain side looks slower than it is)."""
    from hydraspec.adaptive import MIN_STEPS, AdaptiveDraft
    from hydraspec.policy import StepReport

    rule = AdaptiveDraft({1: 1.0, 32: 1.0}, 4)
    for _ in range(MIN_STEPS):
        rule.update(StepReport(rows=8, drafted=True, seconds=0.060, emitted=8, row_steps=[]))
        rule.update(StepReport(rows=8, drafted=False, seconds=0.040, emitted=8, row_steps=[]))
    assert rule.drafting_loses(8)  # 133 tokens/s asking the drafter, 200 without


def test_adaptive_rule_stops_drafting_where_the_clock_says_it_loses():
    """The cost model says draft; the measured steps say drafting is slower at 4 rows and faster at 1: after a
    few probes the rule decodes plainly at 4 rows (still probing now and then) and keeps drafting at 1."""
    from hydraspec.adaptive import MIN_STEPS, PROBE_EVERY, AdaptiveDraft

    rule = AdaptiveDraft({1: 1.0, 32: 1.0}, 4)  # free extra tokens: the model always drafts 4
    clock = {1: (0.010, 0.008), 4: (0.020, 0.045)}  # rows -> seconds of a plain step, of a drafting step

    def run(rows, steps):
        ks = []
        for _ in range(steps):
            k = rule.limit(rows)
            plain_s, draft_s = clock[rows]
            rule.observe(rows, k, draft_s if k else plain_s, rows * (2 if k else 1))  # drafting emits 2 a row
            ks.append(k)
        return ks

    early = run(4, PROBE_EVERY * MIN_STEPS)
    assert early.count(0) >= MIN_STEPS and rule.drafting_loses(4)  # 4 rows: 178 tokens/s drafting, 200 plain
    assert rule.drafting_loses(8) and rule.limit(8) == 0  # more rows, not measured yet: taken to lose as well
    late = run(4, 10 * PROBE_EVERY)
    assert late.count(4) == 10 and late.count(0) == 9 * PROBE_EVERY  # plain, one probe in PROBE_EVERY
    ones = run(1, 20 * PROBE_EVERY)
    assert not rule.drafting_loses(1) and ones.count(4) > 0.9 * len(ones)  # 1 row: 250 vs 100 tokens/s
    assert "measured" in rule.describe()
    unchecked = AdaptiveDraft({1: 1.0, 32: 1.0}, 4, check=False)
    assert all(unchecked.limit(4) == 4 for _ in range(3 * PROBE_EVERY))


def test_bench_serve_measures_a_real_server(tmp_path):
    from hydraspec.bench.serve_load import run_level, table

    with server("pld", max_batch=2) as (base, _):
        r = run_level(base, "tiny", [[p] for p in PROMPTS[:4]], 2, 12)
    assert r["requests"] == 4 and r["tokens"] == 48  # no EOS in the tiny model: every answer is 12 tokens
    assert r["tokens_per_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and r["itl_p50_ms"] > 0
    assert "| 2 | 4 | 48 |" in table([r], "x") and "later_ttft_p50_s" not in r


def test_bench_serve_multi_turn_resends_the_conversation_with_the_servers_answers():
    from hydraspec.bench.serve_load import converse, run_level, run_open, table

    with server("ar", max_batch=2, prefix_tokens=2000) as (base, _):
        turns = converse(base, "tiny", PROMPTS[:3], 8, None, 60)
        r = run_level(base, "tiny", [PROMPTS[:2], PROMPTS[2:4]], 2, 8)
        o = run_open(base, "tiny", [PROMPTS[:2], PROMPTS[2:4], PROMPTS[4:6]], 50.0, 8)
    assert o["requests"] == 6 and o["tokens"] == 48 and o["concurrency"] == "50/s"
    messages = []
    for t, user in enumerate(PROMPTS[:3]):  # each turn's answer is the one for the conversation with the earlier ones
        messages.append({"role": "user", "content": user})
        want = SpeculativeGenerator(target(), tokenizer()).generate(messages, max_new_tokens=8).text
        assert turns[t]["text"] == want and turns[t]["turn"] == t
        messages.append({"role": "assistant", "content": want})
    assert r["requests"] == 4 and r["tokens"] == 32 and r["later_ttft_p50_s"] > 0
    assert "later turns' TTFT" in table([r], "x")


def test_bench_serve_pools_rounds_of_a_level(tmp_path):
    """With --pool a level run again counts the requests of both runs: tokens and wall time summed, every
    request's timings in the percentiles; without it the new run replaces the stored one."""
    import json

    from hydraspec.bench.serve_load import summarize
    from hydraspec.cli import make_parser

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [p]}) + "\n"
                               for i, p in enumerate(PROMPTS[:3])))
    out = tmp_path / "out"
    with server("pld", max_batch=2) as (base, _):
        for extra in ([], ["--pool"], []):
            args = make_parser().parse_args(["bench-serve", "--url", base, "--model", "tiny", "--prompts",
                                             str(prompts), "--concurrency", "2", "--max-tokens", "6",
                                             "--label", "x", "--out", str(out), *extra])
            args.func(args)
            rows = json.loads((out / "serve_results.json").read_text())["x"]
            kept = json.loads((out / "serve_samples.json").read_text())["x"]["2"]
            if extra:
                pooled = rows
    assert pooled[0]["requests"] == 6 and pooled[0]["tokens"] == 36 and pooled[0]["rounds"] == 2
    assert len(pooled[0]["round_itl_p99_p50"]) == 2
    a, b = pooled[0]["round_tokens_per_s"]  # each round's own: the pooled rate lies between them
    assert 0.95 * min(a, b) <= pooled[0]["tokens_per_s"] <= 1.05 * max(a, b)  # (stored wall times are rounded)
    assert rows[0]["requests"] == 3 and rows[0]["rounds"] == 1 and len(kept["each"]) == 1  # not pooled: replaced
    own = rows[0].pop("round_tokens_per_s")
    assert rows[0].pop("round_itl_p99_p50") == [round(rows[0]["itl_p99_ms"] / max(rows[0]["itl_p50_ms"], 1e-9), 3)]
    assert rows[0] == {**summarize(kept["results"], 2, kept["wall_s"]), "rounds": 1}
    assert own == pytest.approx([rows[0]["tokens_per_s"]], rel=0.05)  # (the stored wall time is rounded)


def test_bench_serve_keeps_levels_measured_on_other_server_starts(tmp_path):
    """A level measured again replaces the stored one; the others stay, in client order, open loop last."""
    from hydraspec.bench.serve_load import merge_levels

    old = [{"concurrency": 8, "v": 1}, {"concurrency": "2/s", "v": 1}, {"concurrency": 1, "v": 1}]
    rows = merge_levels(old, [{"concurrency": 2, "v": 2}, {"concurrency": 8, "v": 2}])
    assert [(r["concurrency"], r["v"]) for r in rows] == [(1, 1), (2, 2), (8, 2), ("2/s", 1)]


def test_shutdown_mid_request_is_an_error_not_a_finished_answer():
    """Rows cancelled by a shutdown end with an OpenAI-style error (503, code "cancelled"; an error event in a
    stream), never with finish_reason "stop" as if the answer were complete."""
    with server("pld", max_batch=4, max_context=480) as (base, worker):
        step = worker.engine.step

        def slow_step():  # a step long enough for the shutdown to land mid-answer
            time.sleep(0.05)
            return step()
        worker.engine.step = slow_step
        c = client(base)
        plain_error = []

        def plain():
            try:
                chat(c, PROMPTS[1], 400)
            except openai.APIStatusError as exc:
                plain_error.append((exc.status_code, exc.body))
        t = threading.Thread(target=plain)
        t.start()
        s = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[3]}],
                                      temperature=0, max_tokens=400, stream=True)
        chunks = iter(s)
        next(chunks), next(chunks)  # the answer has begun
        threading.Thread(target=worker.stop).start()
        with pytest.raises(openai.APIError, match="cancelled"):
            for ch in chunks:
                assert not ch.choices or ch.choices[0].finish_reason is None
        t.join(60)
        assert plain_error and plain_error[0][0] == 503 and plain_error[0][1]["code"] == "cancelled"


def test_a_pacing_drafter_decodes_plainly_where_the_clock_says_its_drafts_lose():
    """``auto`` chooses its own drafts; at 8 decoding rows the steps that verified some are measured slower
    than those that verified none: after a few probes the check decodes plainly there (one probe in
    PROBE_EVERY), while at 2 rows, where drafting pays, and at one row (never checked) the drafter keeps its
    choice. Steps that also read a prompt chunk are not compared."""
    from hydraspec.adaptive import MIN_STEPS, PROBE_EVERY, PacedCheck, draft_policy
    from hydraspec.drafters import make_auto
    from hydraspec.policy import StepReport

    rule = PacedCheck()
    clock = {2: (0.040, 0.045, 3), 8: (0.090, 0.120, 9)}  # rows -> plain s, drafting s, tokens a drafting step

    def run(rows, steps, readers=0):
        ks = []
        for i in range(steps):
            k = rule.limit(rows)
            drafts = k != 0 and i % 2 == 0  # the drafter itself drafts every other step
            plain_s, draft_s, emitted = clock[rows]
            rule.update(StepReport(rows, k != 0, draft_s if drafts else plain_s, emitted if drafts else rows, [],
                                   tokens=rows + 2 * drafts + 5 * readers, readers=readers))
            ks.append(k)
        return ks

    assert rule.limit(1) is None and rule.limit(2) is None
    run(8, 3 * PROBE_EVERY * MIN_STEPS, readers=1)
    assert not rule.measured  # steps beside a prompt chunk: not compared
    run(8, 3 * PROBE_EVERY * MIN_STEPS)
    assert rule.drafting_loses(8)  # 75 tokens/s with drafts, 89 without
    late = run(8, 10 * PROBE_EVERY)
    assert late.count(None) == 10 and late.count(0) == 9 * PROBE_EVERY
    twos = run(2, 20 * PROBE_EVERY)
    assert not rule.drafting_loses(2) and twos.count(None) > 0.9 * len(twos)  # 67 tokens/s with drafts, 50 without
    assert all(rule.limit(1) is None for _ in range(3 * PROBE_EVERY))
    m = target()
    assert isinstance(draft_policy(m, make_auto(m, cost={1: 1.0, 16: 1.0}), serving=True), PacedCheck)


def test_kept_answers_are_the_served_answers_in_train_heads_format(tmp_path):
    with server("pld", keep_answers=str(tmp_path)) as (base, _):
        c = client(base)
        for text in PROMPTS[:3]:
            chat(c, text, 10)
    rows = load_answers(tmp_path / "answers.jsonl")
    assert [r["id"] for r in rows] == ["served-0", "served-1", "served-2"]
    for row, text in zip(rows, PROMPTS[:3]):
        want = SpeculativeGenerator(target(), tokenizer()).generate([{"role": "user", "content": text}],
                                                                     max_new_tokens=10)
        assert row["prompt_ids"] == list(want.prompt_ids) and row["answer_ids"] == list(want.token_ids)


def test_kept_answers_stay_within_their_bound_and_resume_after_a_restart(tmp_path):
    keep = KeptAnswers(tmp_path, max_tokens=40)
    for i in range(12):
        keep.add([1, 2, 3], [i] * 5)  # 8 tokens each
    rows = load_answers(tmp_path / "answers.jsonl")
    assert sum(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in rows) == keep.tokens <= 40
    assert [r["answer_ids"][0] for r in rows] == list(range(12 - len(rows), 12))  # the oldest went first
    keep.add([4], [])  # an empty answer is not kept
    with (tmp_path / "answers.jsonl").open("a") as f:
        f.write('{"id": "served-99", "prompt_ids": [1')  # a line cut off by a crash
    again = KeptAnswers(tmp_path, max_tokens=40)
    assert again.tokens == keep.tokens and again.next == 12
    again.add([7], [8, 9])
    assert load_answers(tmp_path / "answers.jsonl")[-1] == {"id": "served-12", "prompt_ids": [7], "answer_ids": [8, 9]}
