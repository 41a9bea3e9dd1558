"""The drafters of everyday prompts: suffix decoding, predicted outputs and the per-request choice (auto)."""
import math
import time

import pytest
import torch

import tiny
from hydraspec import SpeculativeGenerator
from hydraspec.drafters import make_auto, make_drafter
from hydraspec.drafters.auto import AutoDrafter, AutoRow, Load, stat_key
from hydraspec.drafters.base import DecodeState, Drafter, Verdict
from hydraspec.drafters.frozen_trie import FrozenTrie
from hydraspec.drafters.prediction import PredictionDrafter
from hydraspec.drafters.prompt_lookup import NgramIndex, lookup
from hydraspec.drafters.suffix import SharedAnswers, SuffixDrafter, SuffixTrie, load_store, speculate
from hydraspec.engine import Engine, Request
from hydraspec.sampling import Sampling
from hydraspec.tally import Tally
from hydraspec.tree import DraftTree, chain

N = 24
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3, 9, 4, 3, 9, 4, 3], [11, 2, 13, 4, 15, 6, 17]]


def model():
    return tiny.cached_model("llama", "sdpa", 1)


def plain(m, tok, prompt, n=N):
    return SpeculativeGenerator(m, tok).generate(input_ids=prompt, max_new_tokens=n).token_ids


# ---- suffix tries ------------------------------------------------------------------------------------


def test_suffix_trie_counts_matches_and_speculates_by_frequency():
    trie = SuffixTrie(depth=4)
    trie.add([1, 2, 3, 1, 2, 4, 1, 2, 3])
    found = trie.matches([9, 1, 2])  # [1, 2] and [2] have continuations, longest first; [9, 1, 2] has none
    node, m = found[0]
    assert [n for _, n in found] == [2, 1] and m == 2 and {t: trie.count[k] for t, k in trie.kids[node].items()} == {3: 2, 4: 1}
    spec = speculate(trie, node, budget=8, min_prob=0.0)
    assert spec.tokens[:2] == [3, 4] and spec.probs[0] == pytest.approx(2 / 3) and spec.parents[:2] == [-1, -1]
    chain = speculate(trie, node, budget=8, min_prob=0.0, chain_only=True)
    assert chain.tokens[0] == 3 and all(p == i - 1 for i, p in enumerate(chain.parents))
    assert speculate(trie, node, budget=8, min_prob=0.5).tokens == [3, 1]  # 4 (1/3) left out; 3 -> 1 (2/3 * 1/1)
    assert trie.matches([7, 8]) == []
    trie.remove([1, 2, 3, 1, 2, 4, 1, 2, 3])
    assert trie.tokens == 0 and not trie.kids[trie.ROOT]
    size = len(trie.count)
    trie.add([5, 6])  # removed nodes' ids are used again
    assert len(trie.count) == size and trie.matches([5]) == [(trie.kids[trie.ROOT][5], 1)]


def test_suffix_trie_extends_a_sequence_as_adding_it_whole():
    seq = [4, 1, 4, 1, 2, 4, 1, 4]
    whole, grown = SuffixTrie(depth=3), SuffixTrie(depth=3)
    whole.add(seq)
    active = []
    for t in seq:
        active = grown.extend(active, t)

    def dump(trie, node=0, path=()):
        return {path: trie.count[node]} | {k: v for t, kid in trie.kids[node].items()
                                           for k, v in dump(trie, kid, path + (t,)).items()}
    assert dump(grown) == dump(whole)


@pytest.mark.parametrize("depth,vocab", [(2, 2), (3, 4), (24, 3), (8, 30)])
def test_suffix_match_from_the_open_suffixes_equals_the_walk_from_the_root(depth, vocab):
    g = torch.Generator().manual_seed(depth * 100 + vocab)
    trie, active, seq = SuffixTrie(depth), [], []
    for t in torch.randint(0, vocab, (200,), generator=g).tolist():
        seq.append(t)
        active = trie.extend(active, t)
        assert trie.matches_open(active) == trie.matches(seq)


def test_suffix_drafting_copies_a_long_match_whole_past_the_tries_depth():
    # the answer repeats the prompt: its longest match (depth - 1 tokens) has one level of the trie below it, so
    # a shorter match must speculate the copy (SuffixDecoding tries every pattern length); size 2 per matched token
    prompt = list(range(10, 40))
    d = SuffixDrafter(max_tokens=6, alpha=2.0, depth=8)
    for n in (3, 12, 20):
        s = DecodeState(tokens=prompt + prompt[:n], prompt_len=len(prompt), sampling=Sampling(0.0, 0, 1.0))
        tree = d.propose([s])[0]
        assert tree.tokens.tolist() == prompt[n:n + 5]  # a match of 3 leaves 5 levels, the most any length gives
        assert tree.parents == tuple(range(-1, len(tree) - 1))


@pytest.mark.parametrize("matched,grade", [(1, 1), (2, 2), (4, 4), (6, 5), (9, 8), (20, 8)])
def test_suffix_proposals_carry_the_grade_of_their_match(matched, grade):
    """A proposal's grade is its match length in classes (1-4, 5-7, 8 and more): the context's last ``matched``
    tokens occurred before, followed by what is proposed, and one token more did not."""
    old = list(range(100, 100 + matched)) + [7, 8, 9]
    context = [50] + old[:matched]  # the token before the match differs from the one before it earlier
    s = DecodeState(tokens=[1, 2] + old + [3] + context, prompt_len=2, sampling=Sampling(0.0, 0, 1.0))
    tree = SuffixDrafter().propose([s])[0]
    assert tree.tokens.tolist()[:1] == [7] and tree.grade == grade


@pytest.mark.parametrize("min_n,max_n,vocab", [(1, 1, 3), (2, 3, 4), (2, 4, 20), (1, 3, 2)])
def test_prompt_lookup_index_proposes_what_the_full_search_proposes(min_n, max_n, vocab):
    g = torch.Generator().manual_seed(min_n * 10 + max_n + vocab)
    index, seq, hits = NgramIndex(min_n, max_n), [], 0
    for step in range(80):
        seq += torch.randint(0, vocab, (1 + step % 4,), generator=g).tolist()
        want = lookup(seq, 5, max_n, min_n).tolist()
        assert index.lookup(seq, 5) == want
        hits += bool(want)
    assert hits > 10  # the sequences repeat enough for the lookups to find something
    assert index.lookup(seq[:3], 5) == lookup(seq[:3], 5, max_n, min_n).tolist()  # a shorter sequence: rebuilt


def test_suffix_tries_add_nothing_for_the_garbage_collector_to_walk():
    import gc

    trie = SuffixTrie(depth=8)
    active = []
    for t in range(3000):
        active = trie.extend(active, t % 97)
    assert len(trie.count) > 700
    assert not any(gc.is_tracked(k) for k in trie.kids)


@pytest.mark.parametrize("depth,vocab", [(2, 2), (3, 5), (8, 20), (8, 3)])
def test_a_frozen_store_trie_drafts_what_the_dict_trie_drafts(depth, vocab):
    """The store's flat-array trie has the dict trie's nodes, counts and child order: every match and every
    tree (and chain) grown from it are the same, and so is its node count."""
    g = torch.Generator().manual_seed(depth * 10 + vocab)
    seqs = [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in torch.randint(0, 40, (9,), generator=g)]
    grown, frozen = SuffixTrie(depth), FrozenTrie(seqs, depth)
    for s in seqs:
        grown.add(s)
    assert len(frozen) == len(grown.count) and frozen.tokens == grown.tokens
    found = 0
    for _ in range(40):
        ctx = torch.randint(0, vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        assert [m for _, m in frozen.each_match(ctx)] == [m for _, m in grown.each_match(ctx)]
        for (a, m), (b, _) in zip(frozen.each_match(ctx), grown.each_match(ctx)):
            for only_chain in (False, True):
                assert speculate(frozen, a, 8, 0.05, only_chain) == speculate(grown, b, 8, 0.05, only_chain)
            found += 1
    assert found > 20


def test_shared_answers_stay_within_their_token_bound():
    store = SharedAnswers(depth=4, max_tokens=10)
    for key in range(5):
        store.add(key, [key] * 4)
    assert store.trie.tokens <= 10 and list(store.seqs) == [3, 4]  # the oldest went first
    assert store.trie.matches([4, 4]) and not store.trie.matches([0, 0])


def test_a_store_of_answers_is_drafted_from_and_stays_when_earlier_answers_go():
    kept = [[7, 8, 9, 7, 8, 9], [20, 21, 22]]
    d = SuffixDrafter(store=kept, shared_tokens=6)
    state = DecodeState(tokens=[1, 2, 20], prompt_len=2, sampling=Sampling())
    assert d.propose([state])[0].tokens.tolist()[:2] == [21, 22]
    for key in range(4):
        d.shared.add(key, [30 + key] * 3)
    assert list(d.shared.seqs) == [2, 3] and d.shared.trie.tokens == 6  # the store is not counted in the bound
    assert not d.shared.trie.matches([20]) and d.store.matches([20])  # nor mixed into the shared counts
    d.forget()
    assert not d.shared.seqs and d.propose([DecodeState(tokens=[1, 2, 20], prompt_len=2, sampling=Sampling())])[0] \
        .tokens.tolist()[:2] == [21, 22]


def test_drafters_given_one_store_share_its_trie_and_leave_it_as_built():
    kept = [[7, 8, 9, 7, 8, 9], [20, 21, 22]]
    a, b = SuffixDrafter(store=kept), SuffixDrafter(store=kept)
    assert a.store is b.store and SuffixDrafter(store=[list(s) for s in kept]).store is not a.store
    before = (a.store.tokens, len(a.store.count), sum(a.store.count))
    for d in (a, b):
        state = DecodeState(tokens=[1, 2, 20], prompt_len=2, sampling=Sampling())
        assert d.propose([state])[0].tokens.tolist()[:2] == [21, 22]
        state.done = True
        d.propose([DecodeState(tokens=[3, 7, 8], prompt_len=2, sampling=Sampling())])  # the first answer is kept
    assert (a.store.tokens, len(a.store.count), sum(a.store.count)) == before


def test_a_store_file_reads_back_as_its_answers(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    answers = [[5, 6, 7], [8], [9, 10]]
    src = tmp_path / "answers.jsonl"
    src.write_text("".join(json.dumps({"answer_ids": a}) + "\n" for a in answers))
    script = Path(__file__).parent.parent / "scripts" / "build_suffix_store.py"
    subprocess.run([sys.executable, str(script), str(tmp_path / "s.npz"), str(src), "--note", "test"], check=True,
                   capture_output=True)
    assert load_store(tmp_path / "s.npz") == answers


@pytest.mark.parametrize("method", ["suffix", "suffix-store", "auto", "auto-one-draft", "auto-store"])
def test_suffix_and_auto_equal_plain_decoding(method, tok):
    """Also with the draft model proposing one token a step (the shape shipped for the Qwen pair), and with a
    store of answers to draft from (whatever it drafts, the output is plain decoding's)."""
    m = model()
    draft = tiny.noisy_copy(m, 0.05)
    shape = {"tree": [[0]]} if method == "auto-one-draft" else {}
    store = [list(range(t, t + 12)) for t in range(0, 60, 5)] if method.endswith("store") else None
    drafter = make_drafter("suffix", store=store) if method.startswith("suffix") else \
        make_auto(m, {"draft": make_drafter("draft", draft_model=draft, **shape)}, store=store)
    gen = SpeculativeGenerator(m, tok, drafter)
    for p in PROMPTS:
        assert gen.generate(input_ids=p, max_new_tokens=N).token_ids == plain(m, tok, p)
    many = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=N, batch_size=2)  # rows come and go
    assert [r.token_ids for r in many] == [plain(m, tok, p) for p in PROMPTS]


def test_suffix_drafts_from_earlier_answers(tok):
    """A request like an earlier one drafts that answer from the shared trie: the second time the same
    prompt comes, most of the answer is accepted in long runs."""
    m = model()
    prompt = [11, 2, 13, 4, 15, 6, 17]
    gen = SpeculativeGenerator(m, tok, SuffixDrafter(shared_tokens=1000), adaptive=False)
    first = gen.generate(input_ids=prompt, max_new_tokens=N)
    second = gen.generate(input_ids=prompt, max_new_tokens=N)
    assert second.token_ids == first.token_ids == plain(m, tok, prompt)
    assert second.stats.target_forwards < first.stats.target_forwards
    assert second.stats.target_forwards <= N // 3
    off = SpeculativeGenerator(m, tok, SuffixDrafter(shared_tokens=0), adaptive=False)
    off.generate(input_ids=prompt, max_new_tokens=N)
    assert off.generate(input_ids=prompt, max_new_tokens=N).stats.target_forwards > second.stats.target_forwards


# ---- predicted outputs -------------------------------------------------------------------------------------


def test_prediction_follows_and_realigns():
    d = PredictionDrafter(num_tokens=4, max_ngram=3, min_ngram=2)
    pred = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    s = DecodeState(tokens=[1, 2], prompt_len=2, sampling=Sampling(), prediction=pred)
    assert d.propose([s])[0].tokens.tolist() == [10, 11, 12, 13]  # an answer starts at the prediction's start
    d.observe([s], [Verdict([0, 1], 4)])
    assert s.counters == {"accepted_prediction_tokens": 2, "rejected_prediction_tokens": 2}
    s.tokens += [10, 11, 99]  # departs after 11: nothing ends in a known n-gram
    assert len(d.propose([s])[0]) == 0
    s.tokens += [14, 15]  # back on the prediction after an insertion
    assert d.propose([s])[0].tokens.tolist() == [16, 17, 18, 19]
    none = DecodeState(tokens=[1, 2], prompt_len=2, sampling=Sampling())
    assert len(d.propose([none])[0]) == 0


def test_prediction_through_the_engine_is_exact_and_counted(tok):
    m = model()
    prompt = PROMPTS[2]
    ref = plain(m, tok, prompt)
    edited = ref[:10] + [1, 2] + ref[12:]  # a prediction right but for two tokens
    drafter = AutoDrafter({"prediction": PredictionDrafter(), "pld": make_drafter("pld", dynamic=False)},
                          {1: 1.0, 64: 1.0})  # extra verify tokens free: drafting pays wherever it may
    eng = Engine(m, tok, drafter, set(), rows=1, capacity=128)
    req = Request(list(prompt), N, prediction=edited)
    eng.add(req)
    while eng.busy:
        eng.step()
    assert req.result.token_ids == ref
    c = req.result.stats.counters
    assert c["accepted_prediction_tokens"] >= N - 6 and req.result.stats.target_forwards <= 8


# ---- the choice --------------------------------------------------------------------------------------------


class Oracle(Drafter):
    """A costly drafter that knows the target's greedy answer (a perfect draft model)."""

    name, cheap, needs_hidden, max_nodes = "oracle", False, False, 4

    def __init__(self, answer: list[int], prompt_len: int):
        self.answer, self.plen, self.calls = answer, prompt_len, 0

    def propose(self, states):
        self.calls += len(states)
        out = []
        for s in states:
            done = len(s.tokens) - self.plen
            nxt = self.answer[done:done + 4]
            out.append(DraftTree(torch.tensor(nxt, dtype=torch.long), chain(len(nxt))))
        return out

    def observe(self, states, verdicts):
        pass


@pytest.mark.parametrize("extra_token_cost,drafts", [(0.0, True), (1.0, False)])
def test_auto_drafts_where_it_pays_and_decodes_plainly_where_not(extra_token_cost, drafts, tok):
    """Free verify tokens: the perfect drafter is chosen and accepted; every extra verify token costing a
    whole step: nothing is drafted (plain decoding: one token per forward). Output is plain's either way."""
    m = model()
    prompt = PROMPTS[2]
    ref = plain(m, tok, prompt)
    oracle = Oracle(ref, len(prompt))
    cost = {n: 1.0 + extra_token_cost * (n - 1) for n in (1, 2, 4, 8, 16)}
    auto = AutoDrafter({"oracle": oracle}, cost)
    res = SpeculativeGenerator(m, tok, auto).generate(input_ids=prompt, max_new_tokens=N)
    assert res.token_ids == ref
    if drafts:
        assert res.stats.target_forwards <= N // 4 + 2
    else:
        assert res.stats.target_forwards == N and oracle.calls == 0


class HalfRight(Drafter):
    """A cheap drafter offering one token a step: the target's next greedy token on calls of one parity, a
    wrong one on the others."""

    cheap, needs_hidden, max_nodes = True, False, 2  # room for the other's node beside its own

    def __init__(self, name: str, answer: list[int], prompt_len: int, parity: int):
        self.name, self.answer, self.plen, self.parity, self.calls = name, answer, prompt_len, parity, 0

    def propose(self, states):
        out = []
        self.calls += 1
        for s in states:
            done = len(s.tokens) - self.plen
            right = self.answer[done] if done < len(self.answer) else 0
            token = right if self.calls % 2 == self.parity else (right + 1 + self.parity) % 50
            out.append(DraftTree(torch.tensor([token]), chain(1)))
        return out


class Follower(HalfRight):
    """A drafter that follows every step (as an EAGLE head does): its proposal is paid whether it is chosen or
    not. ``right``: it offers the target's next greedy token, else a wrong one."""

    follows = True

    def __init__(self, answers: dict, right: bool):
        self.answers, self.right, self.asked = answers, right, 0

    def propose(self, states):
        self.asked += len(states)
        out = []
        for s in states:
            answer, plen = self.answers[s.tokens[0]]
            done = len(s.tokens) - plen
            token = answer[done] if done < len(answer) else 0
            out.append(DraftTree(torch.tensor([token if self.right else (token + 1) % 50]), chain(1)))
        return out


@pytest.mark.parametrize("right", [True, False])
def test_auto_leaves_a_following_drafter_out_of_new_sequences_where_it_does_not_pay(right, tok):
    """A following drafter that is always right pays (verify tokens free) and every sequence asks it; one that is
    never right costs its proposal every step and adds nothing: a sequence stops asking it after ROW_EVIDENCE of its
    steps, and once the pooled account has seen KEEP_EVIDENCE steps, new sequences leave it out, but for one in
    KEEP_EXPLORE. Answers are plain decoding's either way."""
    from hydraspec.drafters.auto import KEEP_EVIDENCE, KEEP_EXPLORE, ROW_EVIDENCE

    m = model()
    prompts = [[p0] + PROMPTS[i % 3][1:] for i, p0 in enumerate(range(30, 38))]
    refs = [plain(m, tok, p) for p in prompts]
    follower = Follower({p[0]: (r, len(p)) for p, r in zip(prompts, refs)}, right)
    auto = AutoDrafter({"head": follower}, {n: 1.0 for n in (1, 2, 4, 8, 16)})
    eng = Engine(m, tok, auto, set(), rows=1, capacity=64)
    asked, steps, times = [], 0, []
    for p, ref in zip(prompts, refs):
        before = follower.asked
        req = Request(list(p), N, seed=0)
        eng.add(req)
        while eng.busy:
            eng.step()
        assert req.result.token_ids == ref
        asked.append((steps, follower.asked > before))
        steps += req.result.stats.target_forwards
        times.append((follower.asked - before, req.result.stats.target_forwards))
    if right:
        assert all(a for _, a in asked) and all(t >= f - 1 for t, f in times)
        return
    assert times[0][0] < times[0][1] - 1 and 0 < max(t for t, _ in times) <= ROW_EVIDENCE + 1
    late = [a for at, a in asked if at >= KEEP_EVIDENCE + N]
    assert all(a for at, a in asked if at < KEEP_EVIDENCE)
    assert late and 0 < sum(late) <= math.ceil(len(late) / KEEP_EXPLORE)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.7)])
def test_auto_verifies_cheap_offers_side_by_side_and_counts_each_for_its_drafter(sampling, tok):
    """Two cheap drafters, each right on every other step and never on the same one: side by side (greedy,
    verify tokens free) every step accepts a draft, so 24 tokens take 12 forwards, and each drafter's count
    is its own (about half its drafts accepted). Sampling verifies one drafter's proposal a step."""
    m = model()
    prompt = PROMPTS[2]
    ref = plain(m, tok, prompt)
    drafters = {n: HalfRight(n, ref, len(prompt), k) for k, n in enumerate(("even", "odd"))}
    auto = AutoDrafter(drafters, {n: 1.0 for n in (1, 2, 4, 8, 16)})
    for n in drafters:
        for i in range(20):
            auto.totals[n].add(i % 2, 1, decay=1.0)
    eng = Engine(m, tok, auto, set(), rows=1, capacity=64)
    req = Request(list(prompt), N, sampling=sampling, seed=0)
    eng.add(req)
    parts = []
    while eng.busy:
        eng.step()
        parts += [len(row.parts) for _, row in auto.rows.rows.values()]
    if not sampling.greedy:
        assert max(parts) == 1
        return
    assert req.result.token_ids == ref and req.result.stats.target_forwards == N // 2 and max(parts) == 2
    row = next(iter(auto.rows.rows.values()))[1]
    for n in drafters:
        rate = row.tallies[n].accepted[0] / row.tallies[n].reached[0]
        assert 0.3 < rate < 0.7


@pytest.mark.parametrize("budget,tries", [(8, False), (100_000, True)])
def test_auto_tries_a_costly_drafter_only_where_its_catch_up_can_pay(budget, tries):
    """A costly drafter first reads the whole prompt: on a long prompt with 8 tokens left to write that read
    cannot pay back and the drafter is never asked; with a long answer ahead it is tried."""
    prompt = list(range(5, 405))
    oracle = Oracle(prompt[-4:] * 4, len(prompt))
    auto = AutoDrafter({"oracle": oracle}, {n: 1.0 + 0.01 * (n - 1) for n in (1, 2, 4, 8, 16)})
    state = DecodeState(prompt, len(prompt), Sampling(), capacity=len(prompt) + budget)
    trees = auto.propose([state])
    assert (oracle.calls == 1) == tries and (len(trees[0]) > 0) == tries


class Reader(Drafter):
    """A costly drafter that first reads a sequence's prompt (``per_token`` seconds a token, slept) and then proposes
    four tokens a step, which the test below accepts whole."""

    name, cheap, needs_hidden, max_nodes = "reader", False, False, 4

    def __init__(self, per_token: float):
        self.per_token, self.seen, self.calls = per_token, {}, 0

    def propose(self, states):
        self.calls += len(states)
        for s in states:
            if s.key not in self.seen:
                time.sleep(self.per_token * len(s.tokens))
            self.seen[s.key] = len(s.tokens)
        return [DraftTree(torch.tensor([1, 2, 3, 4]), chain(4)) for _ in states]


@pytest.mark.parametrize("steps,pays", [(2, False), (20, True)])
def test_auto_stops_trying_a_costly_drafter_whose_tries_do_not_repay_their_read(steps, pays):
    """A drafter right every time whose first read of a prompt costs 30 plain steps: trying it looks worth it on a
    long budget, but answers of 2 steps never repay the read, so once its trial account has seen TRIAL_EVIDENCE
    steps, new sequences try it but for one in KEEP_EXPLORE; answers of 20 steps repay it, and every sequence
    tries it."""
    from hydraspec.drafters.auto import KEEP_EXPLORE, TRIAL_EVIDENCE

    reader, step = Reader(per_token=0.0006), 0.002
    auto = AutoDrafter({"reader": reader}, {n: step * (1 + 0.1 * (n - 1)) for n in (1, 2, 4, 8, 16)})
    tried, counted = [], []
    for _ in range(12):
        state = DecodeState(list(range(100)), 100, Sampling(), capacity=300)
        before = reader.calls
        counted.append(auto.trials["reader"].steps)
        for _ in range(steps):
            tree = auto.propose([state])[0]
            auto.observe([state], [Verdict(list(range(len(tree))), len(tree))])
            state.tokens += [7] * (len(tree) + 1)
        tried.append(reader.calls > before)
    assert (auto.trials["reader"].saved > 0) == pays
    if pays:
        assert all(tried)
        return
    late = [t for t, c in zip(tried, counted) if c >= TRIAL_EVIDENCE]
    assert all(t for t, c in zip(tried, counted) if c < TRIAL_EVIDENCE)
    assert late and 0 < sum(late) <= math.ceil(len(late) / KEEP_EXPLORE)


@pytest.mark.parametrize("all_or_nothing,keeps", [(True, 8), (False, 2)])
def test_auto_keeps_deep_drafts_where_acceptance_holds_with_depth(all_or_nothing, keeps):
    """Half the proposals accepted whole and half rejected at once (a repeated answer, say): a draft at depth 8
    is accepted half the time, so all 8 drafts pay; the same first-draft rate with rejections spread over the
    depths (each draft accepted half the time) pays for 2 where extra verify tokens cost a tenth of a step."""
    from hydraspec.tally import Tally, reach
    from hydraspec.tree import DraftTree, chain

    tally = Tally()
    for i in range(200):
        if all_or_nothing:
            tally.add(8 if i % 2 else 0, 8, decay=1.0)
        else:
            tally.add([0, 1, 0, 2, 0, 1, 0, 3][i % 8], 8, decay=1.0)
    rates = tally.own_rates()
    assert rates[0] == pytest.approx(0.5, abs=0.02)
    deep = reach(rates, 8)[-1]
    assert deep == pytest.approx(0.5 if all_or_nothing else 0.5 ** 8, abs=0.03)
    auto = AutoDrafter({"pld": make_drafter("pld")}, {n: 1.0 + 0.1 * (n - 1) for n in (1, 2, 4, 8, 16)})
    offer = DraftTree(torch.arange(8), chain(8))
    assert auto._best_cut(offer, AutoRow(tallies={"pld": tally}), "pld", Load(1, 1)).keep == keeps


@pytest.mark.parametrize("beside, most", [(0, 4), (4, 0)])
def test_auto_rows_choose_on_the_forward_that_the_others_fill(beside, most):
    """Four rows, each with an 8-token chain (accepted whole 4 times in 5), on a forward that costs the same up
    to 8 tokens and three times that beyond: each row alone would verify 4 (16 in all: a forward of three
    times the cost), together they keep to the flat part, and nothing is drafted where prompt chunks fill it."""
    lookup = make_drafter("pld")
    auto = AutoDrafter({"pld": lookup}, {1: 1.0, 8: 1.0, 9: 3.0, 40: 6.0})
    for _ in range(200):
        auto.totals["pld"].add(8 if _ % 5 else 0, 8, decay=1.0)
    rows, offers = [AutoRow() for _ in range(4)], [{"pld": DraftTree(torch.arange(8), chain(8))} for _ in range(4)]
    states = [DecodeState([5, 6, 7, 8 + b], 4, Sampling(), capacity=64) for b in range(4)]
    alone = auto._choose(rows[0], states[0], Load(4, 4), offers[0])
    assert len(alone.tree) == 4
    auto.beside = beside
    chosen = [c for _, _, c in auto._in_turn(rows, states, offers)]
    assert sum(len(c.tree) for c in chosen) == most


class Chains:
    """A cheap drafter offering every row the same 8-token chain."""

    name, cheap, needs_hidden, max_nodes = "chains", True, False, 8

    def propose(self, states):
        return [DraftTree(torch.arange(8), chain(8)) for _ in states]

    def observe(self, states, verdicts):
        pass


@pytest.mark.parametrize("learnt, drafts", [(False, True), (True, False)])
def test_auto_in_a_batch_weighs_drafts_on_what_packed_steps_cost(learnt, drafts):
    """Four rows with chains accepted whole 4 times in 5, on a one-row curve that is flat to 32 tokens: they
    draft. Once packed steps of four rows have been seen to cost a whole step per token, they do not: a
    batch's drafts are weighed on what its steps cost, not on the one-row curve."""
    auto = AutoDrafter({"chains": Chains()}, {1: 1.0, 32: 1.0})
    for i in range(200):
        auto.totals["chains"].add(8 if i % 5 else 0, 8, decay=1.0)
    if learnt:
        for i in range(60):
            tokens = 4 + i % 9
            auto.step_took(4, tokens, 1.0 * tokens)
    states = [DecodeState([5, 6, 7, 8 + b], 4, Sampling(), capacity=64) for b in range(4)]
    trees = auto.propose(states)
    assert (sum(len(t) for t in trees) > 0) == drafts


def test_packed_cost_starts_from_the_curve_and_follows_the_steps():
    """No steps seen: the one-row curve. After packed steps that cost 0.5 + 0.1 a token + 0.05 a row (and a
    little noise), the fit predicts them; never below the curve."""
    from hydraspec.packed_cost import PackedCost
    from hydraspec.verify_cost import Curve

    curve = Curve({1: 0.1, 4: 0.12, 16: 0.3})
    packed = PackedCost(curve)
    assert packed.cost(2)(4) == pytest.approx(curve(4), rel=0.15)
    g = torch.Generator().manual_seed(0)
    for i in range(300):
        rows, tokens = 2 + i % 7, 2 + (i * 5) % 23
        truth = 0.5 + 0.1 * tokens + 0.05 * (rows - 1)
        packed.learn(rows, tokens, truth * (1 + 0.02 * float(torch.randn(1, generator=g))))
    for rows, tokens in ((2, 3), (8, 20), (5, 12)):
        assert packed.cost(rows)(tokens) == pytest.approx(0.5 + 0.1 * tokens + 0.05 * (rows - 1), rel=0.05)
    assert packed.cost(2)(0.5) >= curve(0.5)


def test_packed_cost_learns_what_a_new_pass_over_the_weights_costs():
    """Kernels that take 6 rows a pass: a 7th token costs a pass over the weights, the next ones little. Fitted
    with the passes, the step just past a block and the one that fills it are both predicted; a straight line
    in the tokens (no block) misses the first by far (so the check can fail)."""
    from hydraspec.packed_cost import PackedCost
    from hydraspec.verify_cost import Curve

    def truth(rows, tokens):
        return 0.03 + 0.003 * tokens + 0.004 * (rows - 1) + 0.02 * (math.ceil(tokens / 6) - 1)
    curve = Curve({n: truth(1, n) for n in (1, 2, 4, 6, 7, 8, 12, 13, 16)})
    fits = {block: PackedCost(curve, block) for block in (6, None)}
    assert fits[6].passes(6) == 1 and fits[6].passes(7) == 2 and fits[None].passes(13) == 1
    g = torch.Generator().manual_seed(0)
    for i in range(300):
        rows, tokens = 2 + i % 3, 2 + (i * 5) % 11
        for fit in fits.values():
            fit.learn(rows, tokens, truth(rows, tokens) * (1 + 0.02 * float(torch.randn(1, generator=g))))
    for rows, tokens in ((2, 6), (2, 7), (3, 12), (4, 5)):
        assert fits[6].cost(rows)(tokens) == pytest.approx(truth(rows, tokens), rel=0.05)
    assert fits[None].cost(2)(7) != pytest.approx(truth(2, 7), rel=0.05)


def test_packed_cost_stays_sane_through_a_long_run_of_two_row_steps():
    """A server's long run of steps that all hold two rows (one decoding, one reading, or two decoding) cannot
    tell the rows term from the constant. The fit still predicts those steps, and its one-row step (what a
    server's step bound is set from) stays between the one-row curve and the two-row step, however long
    the run; a prior that fades away entirely leaves it to rounding (so the check can fail)."""
    from hydraspec.packed_cost import PackedCost
    from hydraspec.verify_cost import Curve

    curve = Curve({1: 0.035, 4: 0.038, 6: 0.046, 7: 0.058, 16: 0.11})
    packed = PackedCost(curve, 6)
    g = torch.Generator().manual_seed(0)
    for i in range(4000):
        tokens = 2 + i % 5
        truth = 0.040 + 0.004 * tokens
        packed.learn(2, tokens, truth * (1 + 0.02 * float(torch.randn(1, generator=g))))
        if i % 400 == 399:
            assert packed.cost(2)(4) == pytest.approx(0.056, rel=0.05)
            assert curve(1) <= packed.cost(1)(1) <= packed.cost(2)(2)


def test_auto_values_a_proposal_as_the_proposals_of_its_grade_fared():
    """Suffix proposals from one-token matches always rejected, from long matches always accepted whole: auto
    counts each grade apart and verifies the second kind whole and none of the first (one rate for the
    drafter would value both alike), and a grade it has not seen yet starts from its prior."""
    auto = AutoDrafter({"suffix": SuffixDrafter()}, {n: 1.0 + 0.1 * (n - 1) for n in (1, 2, 4, 8, 16)})
    row = AutoRow()
    for _ in range(100):
        auto._count(row, stat_key("suffix", 1), 0, 2)
        auto._count(row, stat_key("suffix", 8), 8, 8)
    weak, strong = (DraftTree(torch.arange(k), chain(k), grade=g) for k, g in ((2, 1), (8, 8)))
    assert auto._choose(row, None, Load(1, 1), {"suffix": weak}).name is None  # plain decoding
    chosen = auto._choose(row, None, Load(1, 1), {"suffix": strong})
    assert chosen.name == "suffix" and len(chosen.tree) == 8
    fresh = auto.chances(row, stat_key("suffix", 3), 1)[0]
    assert 0.3 < fresh < 0.7 and auto.chances(row, stat_key("suffix", 8), 1)[0] > 0.9


def test_auto_scales_a_drafters_chances_to_what_its_chosen_drafts_realised():
    """Drafts predicted at 0.9 and accepted half the time (the winner's curse of choosing the highest
    estimates): the drafter's chances at that depth fall towards half, and only there."""
    from hydraspec.tally import Calibration

    cal = Calibration()
    for i in range(300):
        cal.add([1, 2], [0.9, 0.5], [i % 2 == 0, i % 4 == 0], decay=0.98)
    f = cal.factors(2.0)
    assert f[0] == pytest.approx(0.5 / 0.9, abs=0.03) and f[1] == pytest.approx(0.25 / 0.5, abs=0.03)
    assert f[2] == 1.0  # no evidence deeper: as predicted

    auto = AutoDrafter({"pld": make_drafter("pld")}, {n: 1.0 for n in (1, 16)})
    row = AutoRow(tallies={"pld": Tally()})
    before = auto.chances(row, "pld", 2)
    for _ in range(200):  # a one-node proposal of pld verified and rejected each time
        auto._calibrate(row, "pld", [1], Verdict([], 1))
    after = auto.chances(row, "pld", 2)
    assert after[0] < 0.1 * before[0] and after[1] == pytest.approx(before[1])


class Copier:
    """A cheap drafter offering a 4-token chain of the answer: its second draft wrong for the first ``wrong``
    calls, then the whole chain right (a store of answers that has learnt the request)."""

    name, cheap, needs_hidden, max_nodes = "copier", True, False, 4

    def __init__(self, answer: list[int], prompt_len: int, wrong: int):
        self.answer, self.plen, self.wrong, self.calls = answer, prompt_len, wrong, 0

    def propose(self, states):
        self.calls += 1
        out = []
        for s in states:
            nxt = self.answer[len(s.tokens) - self.plen:][:4]
            if self.calls <= self.wrong and len(nxt) > 1:
                nxt = [nxt[0], nxt[1] + 1] + nxt[2:]
            out.append(DraftTree(torch.tensor(nxt, dtype=torch.long), chain(len(nxt))))
        return out

    def observe(self, states, verdicts):
        pass


@pytest.mark.parametrize("whole", [True, False])
def test_auto_keeps_measuring_the_drafts_its_cut_leaves_out(whole):
    """A chain whose second draft is wrong for 150 steps (the cut falls to one node) and then right for 200:
    auto scores the whole chosen chain as a shadow, sees the deeper drafts accepted again, and verifies them.
    Counted only where verified (the chain's shadow left out), the second depth's rate stays where the wrong
    steps left it and the cut at one node to the end."""
    answer = [(7 * i) % 50 + 2 for i in range(900)]
    prompt = [1, 2, 3]
    copier = Copier(answer, len(prompt), wrong=150)
    auto = AutoDrafter({"copier": copier}, {n: 1.0 + 0.2 * (n - 1) for n in (1, 2, 4, 8, 16)})
    auto.whole_chains = whole
    s = DecodeState(list(prompt) + [answer[0]], len(prompt), Sampling(), capacity=1000)
    kept = []
    while len(s.tokens) - len(prompt) < 700:
        tree = auto.propose([s])[0]
        done = len(s.tokens) - len(prompt)  # the answer's tokens so far, the pending one included
        n = 0
        while n < len(tree) and int(tree.tokens[n]) == answer[done + n]:
            n += 1
        auto.observe([s], [Verdict(list(range(n)), len(tree))])
        s.tokens += answer[done:done + n + 1]  # the accepted drafts and the target's next token
        kept.append(len(tree))
    assert max(kept[:30]) <= 2 and kept[25:40].count(1) >= 10  # the cut fell to one node while depth 2 failed
    late = kept[-20:]
    assert (min(late) >= 3) == whole and (max(late) == 1) == (not whole)


class Pair:
    """One of two cheap drafters offering one token a step: on every fourth token of the answer both offer the
    right one, elsewhere each a wrong one of its own (``shift``), so they agree exactly where they are right."""

    cheap, needs_hidden, max_nodes = True, False, 1

    def __init__(self, name: str, answer: list[int], prompt_len: int, shift: int):
        self.name, self.answer, self.plen, self.shift = name, answer, prompt_len, shift

    def propose(self, states):
        out = []
        for s in states:
            done = len(s.tokens) - self.plen
            right = self.answer[done]
            out.append(DraftTree(torch.tensor([right if done % 4 == 0 else (right + self.shift) % 50]), chain(1)))
        return out

    def observe(self, states, verdicts):
        pass


@pytest.mark.parametrize("agreement", [True, False])
def test_auto_verifies_offers_where_other_drafters_agree_with_them(agreement):
    """Two drafters right on a quarter of the steps, exactly those where they agree: pooled, a quarter is below
    what a verify token costs here and auto drafts nothing; with each offer's rate scaled by how agreeing and
    differing offers fare, it verifies the offers that agree (all right) and leaves out those that differ."""
    answer = [(7 * i) % 50 + 2 for i in range(900)]
    prompt = [1, 2, 3]
    drafters = {n: Pair(n, answer, len(prompt), shift) for n, shift in (("a", 1), ("b", 2))}
    auto = AutoDrafter(drafters, {n: 1.0 + 0.3 * (n - 1) for n in (1, 2, 4, 8, 16)})
    auto.agreement = agreement
    s = DecodeState(list(prompt) + [answer[0]], len(prompt), Sampling(), capacity=1000)
    steps = []
    while len(s.tokens) - len(prompt) < 600:
        done = len(s.tokens) - len(prompt)
        tree = auto.propose([s])[0]
        n = 0
        while n < len(tree) and int(tree.tokens[n]) == answer[done + n]:
            n += 1
        auto.observe([s], [Verdict(list(range(n)), len(tree))])
        s.tokens += answer[done:done + n + 1]
        steps.append((done % 4 == 0, len(tree)))
    late = steps[-100:]
    agreeing = [kept for agree, kept in late if agree]
    differing = [kept for agree, kept in late if not agree]
    assert agreeing and differing and max(differing) == 0
    assert min(agreeing) == (1 if agreement else 0) == max(agreeing)
