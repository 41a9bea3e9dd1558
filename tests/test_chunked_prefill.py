"""Chunked prefill: a request that joins while others decode reads its prompt a chunk a step inside their
forwards; the running rows keep advancing and every answer is the one decoded alone."""
import pytest
import torch

import tiny
from hydraspec import SpeculativeGenerator
from hydraspec.drafters import make_auto, make_drafter
from hydraspec.engine import Engine, Request
from hydraspec.inputs import eos_ids
from hydraspec.prefix_pool import PrefixPool

N = 16


def model():
    return tiny.cached_model("llama", "hydraspec_cpu", 5, max_pos=2400)


def drafter(method, m):
    if "eagle" in method:  # a head reading the hidden states of what the target computes (none of a chunk)
        return tiny.eagle_drafter(m, auto=method == "auto+eagle")
    return make_auto(m) if method == "auto" else make_drafter(method)


def alone(m, tok, method, prompt, n=N):
    method = "ar" if "eagle" in method else method  # exact: the answer is plain decoding's
    return SpeculativeGenerator(m, tok, drafter(method, m)).generate(input_ids=prompt, max_new_tokens=n).token_ids


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, tiny.VOCAB, (n,), generator=g).tolist()


@pytest.mark.parametrize("method", ["ar", "pld", "auto", "eagle", "auto+eagle"])
def test_requests_joining_mid_stream_read_in_chunks_and_answer_as_alone(tok, method):
    m = model()
    engine = Engine(m, tok, drafter(method, m), eos_ids(m, tok), rows=4, capacity=2100, prefill_chunk=64)
    assert engine.prefill_chunk or not engine.packed  # a drafter reading hidden states too
    steps = []  # one entry per step in which the first request got tokens
    first = Request(prompt(12, 0), 48, on_tokens=lambda req, ids: steps.append(len(ids)))
    engine.add(first)
    engine.step()
    engine.step()
    joining = [Request(prompt(n, n), N) for n in (1, 150, 2000)]
    for r in joining:
        engine.add(r)
    read_steps = 0
    while engine.busy:
        reading, running, before = any(r.reading for r in engine.active), first.result is None, len(steps)
        engine.step()
        if reading and running:
            read_steps += 1
            assert len(steps) == before + 1  # the running row advanced in this step too
    for r in [first] + joining:
        assert r.result.token_ids == alone(m, tok, method, r.ids, r.max_new_tokens)
    if engine.prefill_chunk:  # packed rows (the CPU backend's attention): the prompts were read in chunks
        assert read_steps >= 3  # the 150-token prompt alone takes three chunks
    else:
        assert read_steps == 0


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_a_joining_row_decodes_in_the_step_that_reads_the_rest_of_its_prompt(tok, method):
    """The last chunk of a prompt and the row's first verify tree go in one forward: the first token comes in
    the step that reads the rest (20 tokens at 8 a step: 8, 8, then 3 + the pending one), and the answer is
    the one decoded alone."""
    m = model()
    engine = Engine(m, tok, drafter(method, m), eos_ids(m, tok), rows=2, capacity=300, prefill_chunk=8)
    running = Request(prompt(10, 3) * 3, 60)
    engine.add(running)
    engine.step()
    got = []
    joining = Request(prompt(20, 4), N, on_tokens=lambda req, ids: got.append(len(ids)))
    engine.add(joining)
    steps = 0
    while not got:
        engine.step()
        steps += 1
    assert steps == 3
    while engine.busy:
        engine.step()
    assert joining.result.token_ids == alone(m, tok, method, joining.ids)
    assert running.result.token_ids == alone(m, tok, method, running.ids, 60)


def test_a_chunked_prompt_after_a_cache_hit_reads_only_the_rest(tok):
    m = model()
    engine = Engine(m, tok, None, eos_ids(m, tok), rows=2, capacity=600, prefill_chunk=8,
                    prefix_pool=PrefixPool(2000))
    base = prompt(40, 7)
    engine.add(Request(base, N))
    while engine.busy:
        engine.step()
    running, follow = Request(prompt(10, 8), 40), Request(base + prompt(30, 9), N)
    engine.add(running)
    engine.step()
    engine.add(follow)
    while engine.busy:
        engine.step()
    assert follow.result.stats.counters["cached_tokens"] == 40
    assert follow.result.token_ids == alone(m, tok, "ar", follow.ids)
    assert running.result.token_ids == SpeculativeGenerator(m, tok).generate(input_ids=running.ids,
                                                                              max_new_tokens=40).token_ids


@pytest.mark.parametrize("method", ["pld", "auto"])
def test_a_step_bound_keeps_every_forward_within_its_cost_and_answers_as_alone(tok, method):
    """With LatencyCap every forward beside decoding rows holds at most what its room allows (drafts and prompt
    chunks together, from a made-up linear cost at first), the joining prompt still advances, and every answer is
    the one decoded alone. Without the bound the 64-token chunks break it (so the check can fail)."""
    from hydraspec.policy import DraftPolicy, LatencyCap

    m = model()
    cap = LatencyCap(DraftPolicy(), lambda n: 1.0 + 0.25 * (n - 1), 2.0)
    assert [cap.room(r) for r in (1, 2, 4)] == [2, 3, 4]  # c(R + 1 + T) <= 0.85 * 2 * c(R), reader beside
    seen = []  # (decoding rows, tokens in one forward)
    for policy in (cap, None):
        engine = Engine(m, tok, drafter(method, m), eos_ids(m, tok), rows=4, capacity=400, prefill_chunk=64,
                        policy=policy)
        if not engine.prefill_chunk:
            pytest.skip("chunked prefill needs packed rows")
        rows, lone = [0], [False]  # decoding rows; one of them and no prompt read beside it
        hook = m.register_forward_pre_hook(lambda mod, args, kw: seen.append(
            (rows[0], kw["input_ids"].numel(), cap.room(rows[0], lone[0]) if rows[0] else 0)), with_kwargs=True)
        try:
            first = Request(PROMPTS_REPEAT, 40)
            engine.add(first)
            engine.step()
            joining = Request(prompt(150, 3), N)
            engine.add(joining)
            seen.clear()
            while engine.busy:
                rows[0] = sum(not r.reading for r in engine.active)
                lone[0] = rows[0] == 1 and not any(r.reading for r in engine.active)
                engine.step()
        finally:
            hook.remove()
        over = [(r, t) for r, t, room in seen if r and t > r + room]
        if policy is cap:
            assert not over, over
            for r in (first, joining):
                assert r.result.token_ids == alone(m, tok, method, r.ids, r.max_new_tokens)
        else:
            assert over


def test_the_step_bound_follows_the_steps_own_times():
    """The room follows a fit of the packed steps' own times (rows, tokens): a server whose steps cost more per
    token than the one-row curve says gets less room, and every row count follows the same fit."""
    from hydraspec.policy import HEADROOM, DraftPolicy, LatencyCap

    cap = LatencyCap(DraftPolicy(), lambda n: 1.0 + 0.25 * (n - 1), 2.0)
    assert cap.room(4) == 4 and cap.room(2) == 3

    def truth(rows, tokens):
        return 2.0 + 0.5 * tokens + 0.3 * (rows - 1)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        rows = int(torch.randint(2, 9, (1,), generator=g))
        tokens = rows + int(torch.randint(0, 11, (1,), generator=g))
        cap.learn(rows, tokens, truth(rows, tokens))
    cap.learn(1, 5, 100.0)  # a one-row step runs compiled: nothing to learn for packed ones
    for rows in (2, 4, 8):
        bound = HEADROOM * 2.0 * truth(rows, rows)
        expected = max(t for t in range(100) if truth(rows + 1, rows + t) <= bound)
        assert cap.room(rows) == expected
    assert [cap.room(r) for r in (2, 4)] == [4, 6]


def test_a_lone_row_is_bounded_on_its_own_curve():
    """One decoding row and no prompt beside it runs a one-row (compiled) forward: its drafts are bounded on the
    one-row curve, whatever the packed steps were seen to cost; beside a prompt chunk, on the packed fit."""
    from hydraspec.policy import HEADROOM, DraftPolicy, LatencyCap

    curve = lambda n: 1.0 + 0.25 * (n - 1)  # noqa: E731
    cap = LatencyCap(DraftPolicy(), curve, 2.0)
    for i in range(300):
        rows, tokens = 2 + i % 3, 3 + i % 7
        cap.learn(rows, tokens, 1.0 + 1.0 * tokens)  # packed steps: a whole step per token
    alone = max(t for t in range(20) if curve(1 + t) <= HEADROOM * 2.0 * curve(1))
    assert cap.room(1, alone=True) == alone == 2
    assert cap.room(1) < alone and cap.limit(1) == alone and cap.limit(1, extra=1) < alone


PROMPTS_REPEAT = [5, 6, 7, 8, 9] * 6
