"""The prefix cache across requests: a request that starts with an earlier prompt and answer reads only what
is new, and its answer is the one it gets without the cache."""
import pytest
import torch

import tiny
from hydraspec.batch import BatchGenerator
from hydraspec.cache import new_cache, allocate_rows, read_row, write_row
from hydraspec.drafters import make_auto, make_drafter
from hydraspec.memory import kv_bytes_per_slot
from hydraspec.prefix_pool import PrefixPool

N = 20
FIRST = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 11, 12, 13, 14]


def conversation(gen: BatchGenerator, turns: int = 3) -> list:
    """Each turn's prompt is the previous prompt, its answer and a new message, as a chat client sends."""
    prompt, results = list(FIRST), []
    for t in range(turns):
        r = gen.generate(input_ids=[prompt], max_new_tokens=N, chat=False).results[0]
        results.append(r)
        prompt = prompt + r.token_ids + [20 + t, 21 + t, 22 + t, 23, 24, 25]
    return results


@pytest.mark.parametrize("attn", ["sdpa", "hydraspec_cpu"])
@pytest.mark.parametrize("method", ["ar", "pld", "suffix", "auto"])
def test_a_conversation_with_the_prefix_cache_answers_as_without(tok, attn, method):
    model = tiny.cached_model("llama", attn, 3)
    def drafter():
        return make_auto(model) if method == "auto" else make_drafter(method)
    plain = conversation(BatchGenerator(model, tok, drafter()))
    gen = BatchGenerator(model, tok, drafter())
    gen.prefix_pool = PrefixPool(4096)
    cached = conversation(gen)
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]
    hits = [r.stats.counters.get("cached_tokens", 0) for r in cached]
    assert hits[0] == 0
    # later turns reuse the earlier prompt and answer (all but the last answer token, never in the cache)
    assert hits[1] >= len(FIRST) + N - 1 and hits[2] > hits[1]


@pytest.mark.parametrize("auto", [False, True])
def test_heads_that_read_hidden_states_keep_the_prefix_cache(tok, auto):
    """A head drafts from the hidden states of what the target computes: after a cache hit, the rest of the
    prompt. The pool stays on with it, and every turn answers as without the pool."""
    model = tiny.cached_model("llama", "hydraspec_cpu", 3)
    plain = conversation(BatchGenerator(model, tok, tiny.eagle_drafter(model, auto)))
    drafter = tiny.eagle_drafter(model, auto)
    head = drafter.drafters["eagle"] if auto else drafter
    proposed, propose = [], head.propose

    def counted(states):
        trees = propose(states)
        proposed.extend(len(t) for t in trees)
        return trees
    head.propose = counted
    gen = BatchGenerator(model, tok, drafter)
    gen.prefix_pool = PrefixPool(4096)
    cached = conversation(gen)
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]
    assert [r.stats.counters.get("cached_tokens", 0) for r in cached][1] >= len(FIRST) + N - 1
    assert sum(proposed) > 0  # the head drafted


def test_a_cache_hit_with_several_rows_leaves_every_answer_unchanged(tok):
    model = tiny.cached_model("llama", "sdpa", 3)
    gen = BatchGenerator(model, tok)
    gen.prefix_pool = PrefixPool(4096)
    first = gen.generate(input_ids=[FIRST], max_new_tokens=N, chat=False).results[0]
    prompts = [FIRST + first.token_ids + [30, 31, 32], [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8], FIRST[:12] + [40, 41]]
    alone = [BatchGenerator(model, tok).generate(input_ids=[p], max_new_tokens=N, chat=False).results[0].token_ids
             for p in prompts]
    together = gen.generate(input_ids=prompts, max_new_tokens=N, chat=False).results
    assert [r.token_ids for r in together] == alone
    assert [r.stats.counters.get("cached_tokens", 0) for r in together][0] > len(FIRST)
    assert together[1].stats.counters.get("cached_tokens", 0) == 0  # nothing shared
    assert together[2].stats.counters.get("cached_tokens", 0) == 12  # a shared beginning of another entry


def random_cache(model, slots: int, rows: int):
    cache = new_cache(model, slots)
    allocate_rows(cache, model, rows)
    for layer in cache.layers:
        layer.full_k.normal_()
        layer.full_v.normal_()
    return cache


def test_the_pool_stays_within_its_tokens_and_drops_the_least_recently_used(tok):
    model = tiny.cached_model("llama", "sdpa", 3)
    cache = random_cache(model, 64, 1)
    pool = PrefixPool(max_tokens=30, min_hit=4)
    a, b, c = list(range(10, 22)), list(range(40, 52)), list(range(60, 72))
    pool.store(cache, 0, a)
    pool.store(cache, 0, b)
    assert pool.tokens == 24
    assert pool.match(a + [1, 2])[0] == 12  # a is used: b is now the least recently used
    pool.load(cache, 0, a + [1, 2])
    pool.store(cache, 0, c)
    assert pool.tokens <= 30 and pool.match(b)[0] == 0 and pool.match(a)[0] == 12
    pool.store(cache, 0, a + [7, 7, 7])  # extends a: a's entry goes
    assert len(pool.entries) == 2 and pool.tokens == 27
    assert pool.match([10, 11, 12])[0] == 0  # below min_hit
    pool.store(cache, 0, list(range(31)))  # longer than the pool: not kept
    assert pool.tokens == 27


def test_a_loaded_prefix_is_the_stored_keys_and_values(tok):
    model = tiny.cached_model("llama", "sdpa", 3)
    cache = random_cache(model, 32, 2)
    kept = [(k.clone(), v.clone()) for k, v in read_row(cache, 1, 10)]
    pool = PrefixPool(100)
    pool.store(cache, 1, list(range(10)))
    write_row(cache, 1, [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in kept])
    assert pool.load(cache, 0, list(range(10)) + [50, 51]) == 10
    for (k, v), (k2, v2) in zip(kept, read_row(cache, 0, 10)):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    assert kv_bytes_per_slot(model) == 2 * 2 * 2 * 12 * 4  # layers x (k, v) x kv heads x head dim x float32
