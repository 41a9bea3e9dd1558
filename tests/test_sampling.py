"""Speculative sampling must be lossless: whatever the drafts, the emitted tokens follow the target's
(warped) distribution exactly. Checked with chi-square goodness-of-fit tests of the joint distribution
of the first two emitted tokens against the EXACT target probabilities, mostly by calling the acceptors
on fixed logits (cheap), plus a smaller end-to-end run through SpeculativeGenerator. A deliberately
wrong acceptor shows the same test rejects a broken residual distribution."""
from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

import tiny
from hydraspec import SpeculativeGenerator, make_drafter
from hydraspec.accept import Acceptance, accept_greedy, accept_lossless, accept_typical
from hydraspec.sampling import Sampling, sample, sample_without_replacement
from hydraspec.tree import shape_of

V = 20
PENDING = 0  # the verify tree's node 0: its token does not matter to the acceptors
N_DRAWS = 3000
PASS_P = 1e-3  # a correct acceptor must not be rejected at this level...
FAIL_P = 1e-3  # ...and the wrong one must be

SAMPLINGS = {
    "T0.7-top_p0.8": Sampling(temperature=0.7, top_p=0.8),
    "T0.7-top_k5": Sampling(temperature=0.7, top_k=5),
}


# ---- the fixed "models": target logits L, draft logits D -------------------------------------------


class Toy:
    """Target logits at depth 0 (L0) and, given the first token x, at depth 1 (L1[x]); anything deeper
    (L2) only feeds the bonus token, which is past the two tokens we look at. The draft's logits D
    agree with the target only loosely, so both acceptances and rejections are common."""

    def __init__(self, sampling: Sampling, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.S = sampling
        self.L0 = torch.randn(V, generator=g)
        self.L1 = torch.randn(V, V, generator=g)
        self.L2 = torch.randn(V, generator=g)
        self.D0 = self.L0 + torch.randn(V, generator=g)
        self.D1 = self.L1 + torch.randn(V, V, generator=g)
        self.p0, self.p1 = sampling.probs(self.L0), sampling.probs(self.L1)
        self.q0, self.q1 = sampling.probs(self.D0), sampling.probs(self.D1)
        self.joint = self.p0[:, None] * self.p1  # exact P(y1, y2)

    # each scenario returns (shape, tokens, logits, q) of one verify tree
    def chain_q(self, g):
        """Draft-model chain of 2: x1 ~ q0, x2 ~ q1[x1]."""
        x1 = int(sample_without_replacement(self.q0, 1, g)[0])
        x2 = int(sample_without_replacement(self.q1[x1], 1, g)[0])
        logits = torch.stack([self.L0, self.L1[x1], self.L2])
        return shape_of((-1, 0, 1)), [PENDING, x1, x2], logits, torch.stack([self.q0, self.q1[x1]])

    def tree_q(self, g, widths=(3, 2)):
        """Draft-model tree: 3 siblings drawn without replacement from q0, under each 2 from q1[x]."""
        xs = sample_without_replacement(self.q0, widths[0], g).tolist()
        tokens, parents, rows, qrows = [PENDING] + xs, [-1] + [0] * len(xs), [self.L0], []
        rows += [self.L1[x] for x in xs]
        qrows += [self.q0] * len(xs)
        for i, x in enumerate(xs):
            ys = sample_without_replacement(self.q1[x], widths[1], g).tolist()
            tokens += ys
            parents += [1 + i] * len(ys)
            rows += [self.L2] * len(ys)
            qrows += [self.q1[x]] * len(ys)
        return shape_of(tuple(parents)), tokens, torch.stack(rows), torch.stack(qrows)

    @staticmethod
    def _ranked(logits: torch.Tensor, *ranks: int) -> list[int]:
        order = logits.argsort(descending=True).tolist()
        return [order[r] for r in ranks]

    def tree_det(self, g):
        """Deterministic drafts (q = None, like prompt lookup) with siblings: the target's 2nd choice, its
        least likely token (outside top-k / top-p), then its favourite; under each the 3rd and 1st."""
        xs = self._ranked(self.L0, 1, V - 1, 0)
        tokens, parents, rows = [PENDING] + xs, [-1] + [0] * len(xs), [self.L0] + [self.L1[x] for x in xs]
        for i, x in enumerate(xs):
            ys = self._ranked(self.L1[x], 2, 0)
            tokens += ys
            parents += [1 + i] * len(ys)
            rows += [self.L2] * len(ys)
        return shape_of(tuple(parents)), tokens, torch.stack(rows), None

    def chain_det(self, g):
        """A prompt-lookup style chain: fixed tokens, q = None."""
        x1 = self._ranked(self.L0, 0)[0]
        x2 = self._ranked(self.L1[x1], 1)[0]
        return shape_of((-1, 0, 1)), [PENDING, x1, x2], torch.stack([self.L0, self.L1[x1], self.L2]), None


SCENARIOS = ["chain_q", "tree_q", "tree_det", "chain_det"]


def draw_pairs(toy: Toy, scenario: str, acceptor, n: int, seed: int):
    """n draws of the first two emitted tokens; returns (V x V counts, histogram of accepted drafts)."""
    g = torch.Generator().manual_seed(seed)
    make = getattr(toy, scenario)
    counts = torch.zeros(V, V, dtype=torch.long)
    accepted = [0, 0, 0]
    for _ in range(n):
        shape, tokens, logits, q = make(g)
        acc = acceptor(shape, tokens, logits, q=q, sampling=toy.S, generator=g)
        path = acc.path
        assert path[0] == 0 and all(shape.parents[b] == a for a, b in zip(path, path[1:])), path
        out = [tokens[i] for i in path[1:]] + [acc.next_token]
        if len(out) == 1:  # only the recovered token: the second comes from the next (plain) step
            out.append(sample(toy.p1[out[0]], g))
        counts[out[0], out[1]] += 1
        accepted[min(len(path) - 1, 2)] += 1
    return counts, accepted


def gof(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value of `counts` against `probs` (same shape). Cells expecting
    fewer than 5 draws are pooled; any draw in a cell of probability 0 gives p = 0."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    n = counts.sum()
    zero = probs <= 0
    if counts[zero].sum() > 0:
        return 0.0
    exp = probs * n
    big = (exp >= 5) & ~zero
    small = ~big & ~zero
    obs_cells, exp_cells = counts[big].tolist(), exp[big].tolist()
    if small.any():
        pooled_o, pooled_e = float(counts[small].sum()), float(exp[small].sum())
        if pooled_e >= 5 or not obs_cells:
            obs_cells.append(pooled_o)
            exp_cells.append(pooled_e)
        else:  # too little to stand alone: fold into the smallest large cell
            i = min(range(len(exp_cells)), key=exp_cells.__getitem__)
            obs_cells[i] += pooled_o
            exp_cells[i] += pooled_e
    if len(obs_cells) < 2:
        return 1.0
    total_e = sum(exp_cells)
    exp_cells = [e * sum(obs_cells) / total_e for e in exp_cells]
    return float(chisquare(obs_cells, exp_cells).pvalue)


def accept_resample_from_p(shape, tokens, logits, q, sampling, generator, **_) -> Acceptance:
    """A WRONG speculative sampler: accepts exactly like the real one, but after rejecting the drafts it
    draws the recovered token from the target p itself instead of the residual norm(max(0, p - q))."""
    node, path = 0, [0]
    while True:
        p = sampling.probs(logits[node])
        kids = shape.children[node]
        if not kids:
            return Acceptance(path, sample(p, generator))
        qd = None if q is None else q[kids[0] - 1].clone()
        chosen = None
        for c in kids:
            x = tokens[c]
            u = torch.rand((), generator=generator).item()
            qx = 1.0 if qd is None else qd[x].item()
            if qx > 0 and u * qx < p[x].item():
                chosen = c
                break
            if qd is not None:
                qd[x] = 0.0
                if qd.sum() > 0:
                    qd /= qd.sum()
        if chosen is None:
            return Acceptance(path, sample(p, generator))
        node = chosen
        path.append(node)


# ---- lossless speculative sampling on fixed logits -----------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("sname", list(SAMPLINGS))
def test_lossless_acceptance_matches_target(scenario, sname):
    toy = Toy(SAMPLINGS[sname], seed=1)
    counts, accepted = draw_pairs(toy, scenario, accept_lossless, N_DRAWS, seed=2)
    # the drafts are neither always right nor always wrong, so every branch of the acceptor ran
    assert all(a > 0.03 * N_DRAWS for a in accepted[:2]) and accepted[2] > 0, accepted
    zero_hits = int(counts[toy.joint <= 0].sum())
    assert zero_hits == 0, f"{zero_hits} draws of token pairs the target gives probability 0"
    pv = gof(counts, toy.joint)
    assert pv > PASS_P, f"emitted pairs do not follow the target distribution (chi-square p = {pv:.2e})"


@pytest.mark.parametrize("scenario", ["chain_q", "tree_q", "tree_det"])
def test_chi_square_rejects_a_wrong_acceptor(scenario):
    """Negative control: the same test must catch a sampler that ignores the residual distribution."""
    toy = Toy(SAMPLINGS["T0.7-top_k5"], seed=1)
    counts, _ = draw_pairs(toy, scenario, accept_resample_from_p, N_DRAWS, seed=2)
    pv = gof(counts, toy.joint)
    assert pv < FAIL_P, f"the chi-square test failed to reject a wrong acceptor (p = {pv:.2e})"


def test_first_token_marginal_with_many_siblings():
    """One level, 4 siblings without replacement from a draft far from the target: the first token's
    marginal (20 cells, many draws) — the recursive residual is exercised down to the last sibling."""
    S = Sampling(temperature=1.0)
    g = torch.Generator().manual_seed(5)
    L = torch.randn(V, generator=g) * 1.5
    q = S.probs(torch.randn(V, generator=g) * 1.5)
    p = S.probs(L)
    shape = shape_of((-1, 0, 0, 0, 0))
    counts = torch.zeros(V, dtype=torch.long)
    rows = torch.stack([L] + [torch.zeros(V)] * 4)
    n, rejected_all = 4000, 0
    for _ in range(n):
        xs = sample_without_replacement(q, 4, g).tolist()
        acc = accept_lossless(shape, [PENDING] + xs, rows, q=q.expand(4, V), sampling=S, generator=g)
        first = xs[acc.path[1] - 1] if len(acc.path) > 1 else acc.next_token
        rejected_all += len(acc.path) == 1
        counts[first] += 1
    assert rejected_all > 0.02 * n
    assert gof(counts, p) > PASS_P


def test_identical_draft_is_always_accepted():
    """q == p: min(1, p/q) = 1, so every child on the path is accepted."""
    S = Sampling(temperature=0.7, top_k=5)
    toy = Toy(S, seed=3)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        x1 = int(sample_without_replacement(toy.p0, 1, g)[0])
        x2 = int(sample_without_replacement(toy.p1[x1], 1, g)[0])
        logits = torch.stack([toy.L0, toy.L1[x1], toy.L2])
        acc = accept_lossless(shape_of((-1, 0, 1)), [PENDING, x1, x2], logits,
                              q=torch.stack([toy.p0, toy.p1[x1]]), sampling=S, generator=g)
        assert acc.path == [0, 1, 2]


def test_sample_without_replacement_distribution():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    assert sorted(sample_without_replacement(p, 10, g).tolist()) == [0, 1, 2, 3]  # capped at the support
    counts = torch.zeros(5, 5, dtype=torch.long)
    for _ in range(3000):
        a, b = sample_without_replacement(p, 2, g).tolist()
        assert a != b
        counts[a, b] += 1
    exact = torch.zeros(5, 5)
    for a in range(4):
        for b in range(4):
            if a != b:
                exact[a, b] = p[a] * p[b] / (1 - p[a])
    assert gof(counts, exact) > PASS_P


# ---- end to end through SpeculativeGenerator ----------------------------------------------------------


E2E_VOCAB = 24


@pytest.mark.parametrize("method,sampling,n", [
    ("draft-tree", dict(temperature=0.7, top_k=5), 600),
    ("pld", dict(temperature=0.7, top_p=0.8), 500),
    ("pld+hydra", dict(temperature=0.7, top_p=0.8), 500),
    ("eagle", dict(temperature=0.7, top_k=5), 500),
])
def test_generator_two_tokens_follow_target(method, sampling, n):
    tok = tiny.make_tokenizer(E2E_VOCAB)
    model = tiny.cached_model("llama", "sdpa", 7, vocab=E2E_VOCAB, hidden=32, layers=1, init_range=0.2)
    if method.startswith("pld"):
        # prompt [3, 5, c, 3, 5]: prompt lookup proposes c, 3; pick the c the target most expects there
        # so that the deterministic draft is accepted some of the time
        c = max(range(E2E_VOCAB), key=lambda c: float(tiny.full_logits(model, [3, 5, c, 3, 5])[-1, c]))
        prompt = [3, 5, c, 3, 5]
        drafter = make_drafter("pld", num_tokens=2)
        if method == "pld+hydra":  # lookup where it matches, sampled Hydra heads elsewhere
            from hydraspec.heads import build_heads

            torch.manual_seed(0)  # the same fresh heads whether or not an earlier test built the cached model
            heads = build_heads("hydra", model, num_heads=2)
            drafter = make_drafter(method, heads=heads, embed=model.get_input_embeddings(),
                                   tree=[[0], [1], [0, 0]], pld_tokens=2)
    elif method == "eagle":  # a sampled EAGLE tree: siblings drawn without replacement from the head's q
        from hydraspec.heads import build_heads

        prompt = [3, 5, 7, 11]
        torch.manual_seed(0)  # the same fresh head whether or not an earlier test built the cached model
        heads = build_heads("eagle", model, num_heads=2).eval()
        drafter = make_drafter(method, heads=heads, embed=model.get_input_embeddings(), tree=[[0], [1], [0, 0]])
    else:
        prompt = [3, 5, 7, 11]
        drafter = make_drafter("draft", tiny.noisy_copy(model, 0.5, seed=8), widths=[2, 2])
    gen = SpeculativeGenerator(model, tok, drafter)
    S = Sampling(sampling["temperature"], sampling.get("top_k", 0), sampling.get("top_p", 1.0))
    p0 = S.probs(tiny.full_logits(model, prompt)[-1])
    p1 = torch.stack([S.probs(tiny.full_logits(model, prompt + [y])[-1]) for y in range(E2E_VOCAB)])
    joint = p0[:, None] * p1

    counts = torch.zeros(E2E_VOCAB, E2E_VOCAB, dtype=torch.long)
    forwards = 0
    for seed in range(n):
        r = gen.generate(input_ids=prompt, max_new_tokens=2, seed=seed, **sampling)
        assert len(r.token_ids) == 2 and r.finish_reason == "length"
        counts[r.token_ids[0], r.token_ids[1]] += 1
        forwards += r.stats.target_forwards
    # some steps emitted both tokens in one forward (a draft was accepted), others did not
    assert n < forwards < 2 * n - 0.05 * n, forwards
    assert int(counts[joint <= 0].sum()) == 0
    pv = gof(counts, joint)
    assert pv > PASS_P, f"generator output does not follow the target (chi-square p = {pv:.2e})"
    # same seed, same output
    a = gen.generate(input_ids=prompt, max_new_tokens=4, seed=123, **sampling).token_ids
    b = gen.generate(input_ids=prompt, max_new_tokens=4, seed=123, **sampling).token_ids
    assert a == b


# ---- typical acceptance -----------------------------------------------------------------------------


def _typical_threshold(p: torch.Tensor, eps: float, alpha: float) -> float:
    ent = -(p * p.log()).sum().item()
    return min(eps, alpha * math.exp(-ent))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_typical_acceptance_threshold(temperature):
    base = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.04, 0.01])
    S = Sampling(temperature=temperature)
    logits = base.log()
    p = torch.softmax(logits / temperature, -1)
    torch.testing.assert_close(S.probs(logits), p)
    g = torch.Generator().manual_seed(0)
    for eps, alpha in [(0.09, 0.3), (0.03, 0.3), (0.09, 0.05)]:
        thr = _typical_threshold(p, eps, alpha)
        above = [t for t in range(6) if p[t] > thr]
        below = [t for t in range(6) if p[t] <= thr]
        assert above and below, (eps, alpha, thr)
        rows = torch.stack([logits, logits, logits])
        for x in range(6):  # one child: accepted exactly when p(x) clears the threshold
            acc = accept_typical(shape_of((-1, 0)), [PENDING, x], rows[:2], sampling=S, generator=g,
                                 epsilon=eps, alpha=alpha)
            assert (acc.path == [0, 1]) == (x in above), (x, float(p[x]), thr)
            if x in below:  # the extra token comes from the typical set
                assert acc.next_token in above
        # siblings: the first one that clears the threshold wins, even after a sub-threshold one
        acc = accept_typical(shape_of((-1, 0, 0)), [PENDING, below[0], above[-1]], rows, sampling=S,
                             generator=g, epsilon=eps, alpha=alpha)
        assert acc.path == [0, 2]
    # the two branches of min(): a loose epsilon lets alpha * exp(-H) decide, and the other way round
    t1, t2 = _typical_threshold(p, 0.9, 0.3), _typical_threshold(p, 0.001, 0.3)
    assert t1 == pytest.approx(0.3 * math.exp(-float(-(p * p.log()).sum())))
    assert t2 == 0.001


def test_greedy_acceptor_follows_argmax():
    L0 = torch.tensor([0.0, 3.0, 1.0, 2.0])
    L1 = torch.tensor([5.0, 0.0, 1.0, 2.0])
    rows = torch.stack([L0, L1, L1, L1])
    # children of node 0: 3 and 1 (argmax of L0 is 1), under node 2 (token 1): token 0 = argmax of L1
    shape = shape_of((-1, 0, 0, 2))
    acc = accept_greedy(shape, [PENDING, 3, 1, 0], rows)
    assert acc.path == [0, 2, 3] and acc.next_token == 0
    acc = accept_greedy(shape, [PENDING, 3, 2, 0], rows)
    assert acc.path == [0] and acc.next_token == 1


# ---- Sampling.probs ---------------------------------------------------------------------------------


def test_sampling_probs_top_k_top_p():
    logits = torch.tensor([2.0, 4.0, 1.0, 3.0, 0.0])
    assert Sampling().greedy and not Sampling(temperature=0.5).greedy
    torch.testing.assert_close(Sampling(temperature=1.0).probs(logits), logits.softmax(-1))
    torch.testing.assert_close(Sampling(temperature=0.5).probs(logits), (logits / 0.5).softmax(-1))

    p = Sampling(temperature=1.0, top_k=2).probs(logits)
    assert (p > 0).tolist() == [False, True, False, True, False]
    torch.testing.assert_close(p[[1, 3]], torch.tensor([4.0, 3.0]).softmax(-1))
    assert torch.equal(Sampling(temperature=1.0, top_k=5).probs(logits), Sampling(temperature=1.0).probs(logits))

    probs = torch.tensor([0.3, 0.5, 0.15, 0.05])
    lg = probs.log()
    # top_p 0.75: 0.5 alone is short of 0.75, 0.5 + 0.3 reaches it -> keep {1, 0}
    p = Sampling(temperature=1.0, top_p=0.75).probs(lg)
    torch.testing.assert_close(p, torch.tensor([0.375, 0.625, 0.0, 0.0]))
    # top_p 0.4: the most likely token alone suffices
    torch.testing.assert_close(Sampling(temperature=1.0, top_p=0.4).probs(lg), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    # top_p 0.9: 0.5 + 0.3 = 0.8 < 0.9, add 0.15 -> keep three
    p = Sampling(temperature=1.0, top_p=0.9).probs(lg)
    assert (p > 0).tolist() == [True, True, True, False]
    torch.testing.assert_close(p.sum(), torch.tensor(1.0))
    # top_k first, then top_p on what is left: top_k=3 renormalises to (.3, .5, .15)/.95
    p = Sampling(temperature=1.0, top_k=3, top_p=0.85).probs(lg)
    assert (p > 0).tolist() == [True, True, True, False]  # .5/.95 + .3/.95 = .842 < .85
    # batched rows are warped independently
    pb = Sampling(temperature=1.0, top_k=1).probs(torch.stack([logits, -logits]))
    assert pb.argmax(-1).tolist() == [1, 4] and torch.equal(pb.sum(-1), torch.ones(2))
