"""The drafter chosen per sequence and step by measured payoff (method ``auto``).

A sequence holds every drafter available (prompt lookup always; suffix decoding; a draft model, heads, a
predicted output where given) and each step takes the one expected to give the most tokens per second,
or none (plain decoding). What decides, all measured on this machine and this sequence:

- the verify cost curve c(n): one target forward over n new tokens (hydraspec.verify_cost), measured on one
  row (where it was measured for this drafter, kept current by the one-row steps' own times: LearntCurve); a
  step of several rows, or of one beside a prompt chunk, runs packed and costs more per token: there c(n) is
  the packed steps' own cost, learnt from their times (hydraspec.packed_cost);
- each drafter's seconds per proposal (an average over its recent calls);
- each drafter's acceptance on this sequence by depth: r_d, the chance that a draft at depth d is accepted
  once the one above it was, from discounted counts (DECAY per observation) of the drafts that reached
  depth d and of those accepted there, with every sequence's counts as the prior (each depth's prior leans
  on the depth above). A node at depth d is worth r_1 ... r_d: a long match (a repeated answer) keeps its
  deep drafts where one rate for all depths would cut them;
- each drafter's calibration by depth: the tokens its chosen drafts realised over what was predicted for
  them (discounted sums, hydraspec.tally.Calibration), which scales its chances: the rows choosing the
  highest estimates choose the overestimated ones (the winner's curse);
- a proposal's grade (``DraftTree.grade``, e.g. suffix decoding's match length): the counts and the
  calibration are kept per drafter and grade, so that a long match's proposal is valued as long matches
  fare and a one-token match's as those do;
- whether the other cheap drafters agree: an offer whose top token another offer of the step shares is right far
  more often than one whose top differs from every other (drafters that copy the same span, or a head and a
  copy that reach the same token). Every sequence's first drafts are also counted by agreement (``AGREE``,
  ``DIFFER``), and an offer's first-depth rate on its sequence is scaled by its case's rate over all of them
  (``lift``); the sequence's own counts stay whole, so it keeps learning as fast (``agreement``);
- the step's node limit a row may keep (``Drafter.limit``, from the engine's step bound).

Drafters whose proposals cost next to nothing (``cheap``) propose every step, and where their proposal is not
verified it is still scored against the tokens decoded next (greedy: exactly what verification would have
accepted), so their estimates stay current at no cost; so is the whole of a chosen chain that the cut shortened,
so that the rates past the cut keep being measured (counted only where verified, a depth's rate once pulled down
would stay there and the cut never grow again). A drafter with a forward of its own is run only when
chosen; one not tried on a sequence for EXPLORE steps is tried once if its optimistic estimate could beat the best
and the time it would save over the rest of the answer outweighs what trying costs: a drafter with a forward of
its own first reads every token it has not seen (on first use, the prompt less what it takes from earlier
sequences: ``Drafter.known``), at its measured seconds per token read, and its step may give fewer tokens per
second than the best option. Whether such tries pay is measured too: each one-row step that chose a costly drafter
is scored against the option it beat (``Trial``, pooled over sequences): the seconds its tokens would have taken
at that option's expected rate, less what the step cost, its catch-up read included (the try's estimate assumes
the whole budget is left to write; short answers, and tries that end soon, never repay their read). While a
drafter's account is below zero, new sequences do not try it, but for one in KEEP_EXPLORE; the steps where it pays
on its own estimate (read already done) still choose it. The rows choose in turn (the most promising first) on the
batch's expected tokens per second: with T tokens already in the step's forward (one a row, the prompt chunks read
beside them, the drafts of the rows that chose before) and E tokens expected from it, a row's option is worth (E +
its expected extra tokens) / (c(T + its nodes) + drafting seconds), plain decoding E / c(T): a draft that pays
alone does not when others already fill the forward. A costly drafter's proposal is cut to the nodes that pay, as
a cheap one's is. On a greedy row the cheap drafters' other offers (a head's node, prompt lookup's chain beside
suffix decoding's) can join the chosen one's tree as branches of their own where their top tokens differ: the
events that each branch's first draft is right are disjoint then, so a branch adds its chances, and it joins where
that gives the batch more tokens per second (its proposal is already paid for). Those chances are learnt apart
(``BESIDE``): a drafter whose top token differs from the chosen one's is right less often than on average (where
drafters agree they are right more often). The output never depends on the choice: every proposal is verified by
the target.

A drafter that is cheap only because it follows every step (an EAGLE head reading each committed token) is paid
every step whether it is chosen or not. Its account (``Keep``, pooled over sequences) weighs the tokens the steps
committed and their seconds against the tokens its own nodes alone gave and what it cost (its proposal, the verify
rows of its nodes); a new sequence follows it while the steps give more tokens per second with it than they would
have without it, and once it does not pay, one new sequence in KEEP_EXPLORE still does, to keep measuring. A
sequence keeps an account of its own too, and stops following the drafter for the rest of it once ROW_EVIDENCE
of its steps say that the drafter does not pay on this text (a translation, where the head is seldom right).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field, replace

from ..packed_cost import PackedCost
from ..tally import DEPTHS, Calibration, Tally, reach, shadow_accepted
from ..tree import DraftTree, shape_of, side_by_side
from ..verify_cost import Curve, LearntCurve
from .base import DecodeState, Drafter, RowStates, Verdict, capacity_of

DECAY = 0.9  # weight of older observations of a drafter on one sequence, per new observation
PRIOR_WEIGHT = 3.0  # the all-sequences estimate counts as this many observations of a sequence
EXPLORE = 16  # steps after which a drafter not tried on a sequence is tried once, if it could pay
MARGIN = 1.02  # a drafter must be expected to beat plain decoding by this
RUN = 8  # steps a costly drafter is expected to stay chosen: its catch-up read is spread over them
READ_GUESS = 0.03  # seconds to read one token, as a fraction of one target step, until measured
CALIBRATION_DECAY = 0.98  # weight of older verified proposals in a drafter's calibration, per new one
CALIBRATION_WEIGHT = 2.0  # its prior: this many tokens predicted and realised at every depth
NEUTRAL = [1.0] * DEPTHS  # the calibration factors with no evidence: as predicted
BESIDE = "/beside"  # where a drafter's offers whose top token differs from the chosen proposal's are counted
WHOLE = "/whole"  # a row's shadow of its chosen chain, cut before verification, counted whole
AGREE, DIFFER = "/agree", "/differ"  # every sequence's offers that another offer's top token agrees with, or not
LIFT_WEIGHT = 8.0  # first drafts an agreement case counts as having seen at the drafter's overall rate
KEEP_DECAY = 0.995  # weight of older steps in a following drafter's account, per step
KEEP_EVIDENCE = 64.0  # steps counted before a following drafter may be left out of new sequences
ROW_EVIDENCE = 16.0  # a sequence's steps counted before it may stop following a drafter that does not pay on it
KEEP_EXPLORE = 4  # while a following or costly drafter does not pay, one new sequence in this many still asks it
TRIAL_DECAY = 0.99  # weight of older steps in a costly drafter's trial account, per step that chose it
TRIAL_EVIDENCE = 8.0  # steps counted before new sequences may stop trying a costly drafter


@dataclass
class Load:
    """The step's forward as the rows have chosen so far: tokens in it, tokens expected from it, and the
    drafting seconds it waits for."""

    tokens: float
    expect: float
    seconds: float = 0.0

    def add(self, nodes: int, gained: float, seconds: float) -> "Load":
        return Load(self.tokens + nodes, self.expect + gained, self.seconds + seconds)


@dataclass
class Cut:
    keep: int  # the offer's first nodes verified
    rate: float  # the batch's expected tokens per second with them
    gained: float  # the tokens they are expected to add


def stat_key(name: str, grade: int) -> str:
    """Where a proposal's acceptance is counted: its drafter's name, and its grade where it has one."""
    return f"{name}:{grade}" if grade else name


@dataclass
class Choice:
    name: str | None  # the drafter (None: plain decoding)
    tree: DraftTree  # a cheap drafter's proposal as cut (a costly one's comes later)
    rate: float  # the batch's expected tokens per second
    after: Load  # the step's load with this row's choice in it
    extras: tuple = ()  # (drafter, its cut offer): other cheap offers verified beside it
    beat: float = 0.0  # a costly drafter's: the rate of the best option it beat


@dataclass
class Part:
    """One drafter's share of a verified tree: where its acceptance is counted (the first: what its value came
    from), its nodes' indices in the tree (ascending) and their depths."""

    name: str
    stats: tuple[str, ...]
    nodes: list[int]
    depths: list[int]
    whole: bool = False  # its proposal was cut, and is counted whole as a shadow instead (``_shadow``)
    agree: str = ""  # AGREE or DIFFER where other cheap offers came beside its own (``agreement``)


@dataclass
class Rationed:
    """An account that, while its drafter does not pay, lets one new sequence in KEEP_EXPLORE ask it still (to keep
    measuring)."""

    left_out: int = 0  # new sequences left without it since one asked it

    def pays(self) -> bool:
        raise NotImplementedError

    def admit(self) -> bool:
        """Whether a new sequence asks the drafter."""
        if self.pays():
            return True
        self.left_out += 1
        if self.left_out < KEEP_EXPLORE:
            return False
        self.left_out = 0
        return True


@dataclass
class Keep(Rationed):
    """A following drafter's account over the steps of the sequences that follow it (discounted by step): the
    tokens the steps committed and their seconds (the verify curve's and the drafting's), and of these the tokens
    its nodes gave that no other offer had, and the seconds it cost."""

    tokens: float = 0.0
    seconds: float = 0.0
    added: float = 0.0
    spent: float = 0.0
    steps: float = 0.0

    def add(self, tokens: float, seconds: float, added: float, spent: float) -> None:
        k = KEEP_DECAY
        self.tokens, self.seconds = k * self.tokens + tokens, k * self.seconds + seconds
        self.added, self.spent, self.steps = k * self.added + added, k * self.spent + spent, k * self.steps + 1

    def pays(self, evidence: float = KEEP_EVIDENCE) -> bool:
        """Whether the steps gave at least as many tokens per second with it as they would have without (always,
        before ``evidence`` steps)."""
        if self.steps < evidence or self.spent >= self.seconds:
            return True
        return self.tokens / self.seconds >= (self.tokens - self.added) / (self.seconds - self.spent)


@dataclass
class Trial(Rationed):
    """A costly drafter's account over the steps that chose it (discounted by step): the seconds they saved against
    the options they beat (negative where they lost)."""

    saved: float = 0.0
    steps: float = 0.0

    def add(self, saved: float) -> None:
        self.saved, self.steps = TRIAL_DECAY * self.saved + saved, TRIAL_DECAY * self.steps + 1

    def pays(self) -> bool:
        return self.steps < TRIAL_EVIDENCE or self.saved >= 0.0


@dataclass
class Trying:
    """A row's step that chose a costly drafter: the rate of the option it beat, and its proposal's seconds."""

    name: str
    beat: float
    seconds: float = 0.0


@dataclass
class Ledger:
    """One row's step as a following drafter's account sees it: the verified tree, the step's offers (a token
    another drafter offered too is not the follower's own gain), the row's drafting seconds, and per following
    drafter its nodes in the tree and their extra verify seconds."""

    tree: DraftTree
    offers: dict[str, DraftTree]
    drafting: float
    parts: dict[str, tuple[list[int], float]]


@dataclass
class AutoRow:
    tallies: dict[str, Tally] = field(default_factory=dict)
    chosen: str | None = None  # the drafter whose proposal was verified last step
    parts: list[Part] = field(default_factory=list)  # each drafter's share of that step's tree
    tried: dict[str, int] = field(default_factory=dict)  # costly drafter -> steps since this sequence used it
    seen: dict[str, int] = field(default_factory=dict)  # costly drafter -> tokens it had read at its last use
    known: dict[str, int] = field(default_factory=dict)  # costly drafter not yet used -> Drafter.known, asked once
    shadows: dict[str, tuple[int, list[int], tuple, str]] = field(default_factory=dict)  # unverified cheap chains
    follow: dict[str, bool] | None = None  # following drafter -> whether this sequence asks it (set once)
    ledger: Ledger | None = None  # the last step, for the following drafters' accounts
    trying: Trying | None = None  # the last step, where it chose a costly drafter, for its trial account
    tries: dict[str, bool] = field(default_factory=dict)  # costly drafter -> whether this sequence may try it
    kept: dict[str, Keep] = field(default_factory=dict)  # following drafter -> its account on this sequence
    agree: dict[str, str] = field(default_factory=dict)  # cheap drafter -> AGREE or DIFFER this step (absent: alone)


class AutoDrafter(Drafter):
    """See the module docstring. ``drafters``: name -> Drafter; ``cost``: the target's verify cost, measured
    points {n: seconds} (hydraspec.verify_cost); ``block``: the target's kernels' rows per pass over a weight
    (hydraspec.backend.rows_per_pass); ``learn``: keep the one-row curve current by the steps' times."""

    name = "auto"
    paced = True

    def __init__(self, drafters: dict[str, Drafter], cost: dict[int, float], block: int | None = None,
                 learn: bool = False):
        self.drafters = drafters
        self.cheap = {n: d for n, d in drafters.items() if d.cheap}
        self.costly = {n: d for n, d in drafters.items() if not d.cheap}
        self.max_nodes = max([d.max_nodes for d in drafters.values()] + [0])
        self.needs_hidden = any(d.needs_hidden for d in drafters.values())
        self.cost = LearntCurve(cost) if learn else Curve(cost)
        self.packed = PackedCost(self.cost, block)  # steps of several rows, learnt from their own times
        self.step = self.cost  # this step's curve: the one-row one, or the packed one for its rows
        self.totals: dict[str, Tally] = defaultdict(Tally)  # every sequence's counts, undiscounted (stat_key)
        self.calibration: dict[str, Calibration] = defaultdict(Calibration)  # realised over predicted, chosen drafts
        self.trust: dict[str, list[float]] = {}  # calibration factors, kept per update
        self.seconds = {n: 0.0 for n in drafters}  # recent seconds per proposal of one row
        self.sizes = {n: 4.0 for n in drafters}  # recent nodes per proposal of the costly drafters
        self.read = {n: 0.0 for n in self.costly}  # seconds per token a costly drafter reads to catch up
        self.keeps = {n: Keep() for n, d in self.cheap.items() if getattr(d, "follows", False)}  # their accounts
        self.trials = {n: Trial() for n in self.costly}
        self.row_evidence = ROW_EVIDENCE  # (infinite: sequences never stop following; a probe's setting)
        self.whole_chains = True  # a cut chosen chain scored whole (False: only where verified; a probe's setting)
        self.agreement = True  # first rates scaled by whether offers agree (False: not; a probe's setting)
        self.rows: RowStates[AutoRow] = RowStates(lambda s: AutoRow())

    # -- proposing --------------------------------------------------------------------------------------
    def propose(self, states: list[DecodeState]) -> list[DraftTree]:
        rows = [self.rows.of(s) for s in states]
        forward_rows = len(states) + self.readers
        self.step = self.packed.forward(forward_rows)
        for row, s in zip(rows, states):
            self._score_shadows(row, s)
            if row.follow is None:  # a new sequence: which drafters its accounts let it ask
                row.follow = {n: keep.admit() for n, keep in self.keeps.items()}
                row.kept = {n: Keep() for n in self.keeps}
                row.tries = {n: trial.admit() for n, trial in self.trials.items()}
        cheap = {n: self._timed(n, states, [r.follow.get(n, True) for r in rows]) for n in self.cheap}
        offers = [{n: t[b] for n, t in cheap.items()} for b in range(len(states))]
        for row, offer in zip(rows, offers):
            row.agree = agreement(offer) if self.agreement else {}
        out = [DraftTree.empty() for _ in states]
        wants: dict[str, list[int]] = {n: [] for n in self.costly}
        before: list[Load] = [Load(0, 0)] * len(states)  # the load each row chose on
        extras: list[tuple] = [()] * len(states)
        whole = [False] * len(states)
        for b, load, choice in self._in_turn(rows, states, offers):
            before[b], rows[b].chosen, out[b], extras[b] = load, choice.name, choice.tree, choice.extras
            if choice.name in wants:
                wants[choice.name].append(b)
                if len(states) == 1 and not self.beside:  # scored where the rates are one row's
                    rows[b].trying = Trying(choice.name, choice.beat)
            whole[b] = self._shadow(rows[b], states[b], offers[b], choice)
        for n, picked in wants.items():
            if picked:
                for b, tree in zip(picked, self._costly(n, [rows[b] for b in picked], [states[b] for b in picked])):
                    out[b] = tree.head(self._best_cut(tree, rows[b], n, before[b]).keep)
        for b, row in enumerate(rows):
            out[b], row.parts = self._parts(row, out[b], extras[b])
            if whole[b]:
                row.parts[0] = replace(row.parts[0], whole=True)
            if any(row.follow.values()):
                row.ledger = self._ledger(row, out[b], offers[b])
            for n in self.costly:
                if n == row.chosen:
                    row.tried[n] = 0
                elif n in row.tried:
                    row.tried[n] += 1
        return out

    def _in_turn(self, rows: list[AutoRow], states: list[DecodeState], offers: list[dict[str, DraftTree]]):
        """(row, the load it chose on, its Choice), the rows in order of what each would give alone (one a
        row and the prompt chunks read beside them), the load growing by every row's choice."""
        alone = Load(len(states) + self.beside, len(states))
        first = [self._choose(rows[b], states[b], alone, offers[b]) for b in range(len(states))]
        load = alone
        for b in sorted(range(len(states)), key=lambda b: -first[b].rate):
            choice = first[b] if load is alone else self._choose(rows[b], states[b], load, offers[b])
            choice = self._beside(rows[b], states[b], offers[b], choice)
            yield b, load, choice
            load = choice.after

    def _beside(self, row: AutoRow, s: DecodeState, offers: dict[str, DraftTree], choice: Choice) -> Choice:
        """The choice with other cheap offers beside it, each cut to what pays on the load so far, where their
        top tokens differ from those already in (greedy rows; not beside a costly drafter's tree)."""
        others = {n: o for n, o in offers.items() if n != choice.name and len(o)}
        if not others or choice.name in self.costly or not s.sampling.greedy:
            return choice
        trees, extras, rate, after = [choice.tree], [], choice.rate, choice.after
        for n, offer in others.items():
            room = (self.limit or self.max_nodes) - sum(len(t) for t in trees)
            if room <= 0 or not _apart(trees, offer):
                continue
            cut = self._best_cut(offer, row, n, after, seconds=0.0, room=room, beside=len(choice.tree) > 0)
            if cut.rate > rate:
                kept = offer.head(cut.keep)
                trees.append(kept)
                extras.append((n, kept))
                rate, after = cut.rate, after.add(cut.keep, cut.gained, 0.0)
        return replace(choice, rate=rate, after=after, extras=tuple(extras)) if extras else choice

    @staticmethod
    def _parts(row: AutoRow, tree: DraftTree, extras: tuple) -> tuple[DraftTree, list[Part]]:
        """The tree to verify (the row's chosen proposal, extras beside it) and each drafter's part of it (an
        extra's counted as beside the proposal too where there is one)."""
        chosen = row.chosen
        if chosen is None and not extras:
            return tree, []
        parts = ([(chosen, tree)] if chosen is not None else []) + list(extras)
        joined, owner = side_by_side([t for _, t in parts]) if extras else (tree, [0] * len(tree))
        depth = shape_of(joined.with_root()).depth.tolist()[1:]
        out = []
        for i, (n, t) in enumerate(parts):
            stat = stat_key(n, t.grade)
            beside = i > 0 and len(tree) > 0
            out.append(Part(n, (stat + BESIDE, stat) if beside else (stat,), [j for j, k in enumerate(owner) if k == i],
                            [d for d, k in zip(depth, owner) if k == i], agree=row.agree.get(n, "")))
        return joined, out

    def _timed(self, name: str, states: list[DecodeState], asked: list[bool]) -> list[DraftTree]:
        """The drafter's proposals for the rows ``asked`` (the others get none), timed per row."""
        ask = [s for s, a in zip(states, asked) if a]
        if not ask:
            return [DraftTree.empty() for _ in states]
        t0 = time.perf_counter()
        trees = iter(self.drafters[name].propose(ask))
        self._keep_seconds(name, (time.perf_counter() - t0) / len(ask))
        return [next(trees) if a else DraftTree.empty() for a in asked]

    def _ledger(self, row: AutoRow, tree: DraftTree, offers: dict[str, DraftTree]) -> Ledger:
        c, size = self.step, len(tree)
        drafting = sum(self.seconds[n] for n in self.cheap if row.follow.get(n, True))
        drafting += self.seconds[row.chosen] if row.chosen in self.costly else 0.0
        parts = {}
        for name in (n for n, asked in row.follow.items() if asked):
            nodes = next((p.nodes for p in row.parts if p.name == name), [])
            parts[name] = (nodes, c(1 + size) - c(1 + size - len(nodes)) if nodes else 0.0)
        return Ledger(tree, offers, drafting, parts)

    def _settle(self, row: AutoRow, v: Verdict) -> None:
        """A following drafter's account after a row's step (the other offers' top tokens looked at only where
        the accepted path starts at one of its nodes)."""
        led, row.ledger = row.ledger, None
        if led is None:
            return
        seconds = self.step(1 + len(led.tree)) + led.drafting
        first = v.accepted[0] if v.accepted else None
        for n, (nodes, extra) in led.parts.items():
            others = (o for m, o in led.offers.items() if m != n)
            own = first in nodes and int(led.tree.tokens[first]) not in _tops(others)
            added = sum(i in nodes for i in v.accepted) if own else 0
            for keep in (self.keeps[n], row.kept[n]):
                keep.add(len(v.accepted) + 1, seconds, added, self.seconds[n] + extra)
            if not row.kept[n].pays(self.row_evidence):
                row.follow[n] = False  # for the rest of this sequence

    def _score_trial(self, row: AutoRow, v: Verdict) -> None:
        """A costly drafter's step against the option it beat: the seconds its tokens would have taken at that
        option's rate, less the step's verify seconds and its proposal's."""
        t, row.trying = row.trying, None
        self.trials[t.name].add((len(v.accepted) + 1) / t.beat - self.step(1 + v.verified) - t.seconds)

    def _keep_seconds(self, name: str, each: float) -> None:
        self.seconds[name] = each if not self.seconds[name] else 0.8 * self.seconds[name] + 0.2 * each

    def _costly(self, name: str, rows: list[AutoRow], states: list[DecodeState]) -> list[DraftTree]:
        """A costly drafter's proposals; the tokens it first reads to catch up (less those it takes from
        earlier sequences: ``Drafter.reused``) are timed apart from them."""
        d = self.drafters[name]
        unseen, reused = sum(self._gap(r, s, name, pooled=False) for r, s in zip(rows, states)), d.reused
        t0 = time.perf_counter()
        trees = d.propose(states)
        took, usual = time.perf_counter() - t0, self.seconds[name] * len(states)
        gaps = max(0, unseen - (d.reused - reused))  # what it read: not what it took from earlier sequences
        if gaps and usual:  # a catch-up with a known usual cost: what reading a token costs
            rate = max(0.0, took - usual) / gaps
            self.read[name] = 0.8 * self.read[name] + 0.2 * rate if self.read[name] else rate
        elif not gaps:  # a usual proposal (one with a catch-up says nothing sure of it)
            self._keep_seconds(name, took / len(states))
        for r, s, tree in zip(rows, states, trees):
            if r.trying is not None:
                r.trying.seconds = took / len(states)
            r.seen[name] = len(s.tokens)
            self.sizes[name] = 0.8 * self.sizes[name] + 0.2 * len(tree)
        return trees

    def _gap(self, row: AutoRow, s: DecodeState, name: str, pooled: bool = True) -> int:
        """Tokens a costly drafter must read before it proposes, beyond a usual step's few (on first use, with
        ``pooled``, less those it expects to take from earlier sequences: ``Drafter.known``)."""
        if name in row.seen:
            seen = row.seen[name]
        elif pooled:
            if name not in row.known:
                row.known[name] = self.drafters[name].known(s)
            seen = row.known[name]
        else:
            seen = 0
        return max(0, len(s.tokens) - seen - round(self.sizes[name]) - 1)

    def _choose(self, row: AutoRow, s: DecodeState, load: Load, offers: dict[str, DraftTree]) -> Choice:
        """The option with the most expected tokens per second of the batch on ``load`` (see the module
        docstring)."""
        c = self.step
        best = Choice(None, DraftTree.empty(), load.expect / (c(load.tokens) + load.seconds) * MARGIN, load)
        for n, offer in offers.items():
            cut = self._best_cut(offer, row, n, load)
            if cut.rate > best.rate:
                best = Choice(n, offer.head(cut.keep), cut.rate, load.add(cut.keep, cut.gained, self.seconds[n]))
        for n in self.costly:
            rates, size = self.rates(row, n), max(1, min(round(self.sizes[n]), self.limit or self.max_nodes))
            catch_up = self._gap(row, s, n) * (self.read[n] or READ_GUESS * c(1))
            step = c(load.tokens + size) + load.seconds + self.seconds[n]
            gained = sum(self.chances(row, n, size))
            value = (load.expect + gained) / (step + catch_up / RUN)
            if row.tried.get(n, EXPLORE) >= EXPLORE and row.tries.get(n, True):
                hope = (load.expect + gain([min(0.95, r + 0.2) for r in rates], size)) / step
                left = max(0, capacity_of(s) - len(s.tokens) - self.max_nodes)
                loss = catch_up + max(0.0, step - (load.expect + gained) / best.rate)  # if it does no better
                if hope > best.rate and 0.5 * load.expect * left * (1 / best.rate - 1 / hope) > loss:
                    value = max(value, best.rate * 1.0001)  # worth one try: it may pay back its catch-up
            if value > best.rate:
                best = Choice(n, DraftTree.empty(), value, load.add(size, gained, self.seconds[n]), beat=best.rate)
        return best

    def _best_cut(self, offer: DraftTree, row: AutoRow, name: str, load: Load, seconds: float | None = None,
                  room: int | None = None, beside: bool = False) -> Cut:
        """How many of drafter ``name``'s offer's first nodes (at most ``room``, else the step's limit) to
        verify on ``load``: the batch's expected tokens per second with them (``seconds`` the proposal's, by
        default the drafter's usual; ``beside`` a chosen proposal whose top tokens differ), and the tokens
        they are expected to add."""
        if not len(offer):
            return Cut(0, 0.0, 0.0)
        depth = shape_of(offer.with_root()).depth.tolist()[1:]
        stat = stat_key(name, offer.grade)
        p = self.chances(row, stat + BESIDE, max(depth)) if beside else \
            self.chances(row, stat, max(depth), row.agree.get(name, ""))
        seconds = self.seconds[name] if seconds is None else seconds
        c, best, value = self.step, Cut(0, 0.0, 0.0), load.expect
        for i, d in enumerate(depth[:room or self.limit]):
            value += p[d - 1]
            v = value / (c(load.tokens + i + 1) + load.seconds + seconds)
            if v > best.rate:
                best = Cut(i + 1, v, value - load.expect)
        return best

    def chances(self, row: AutoRow, stat: str, depth: int, agree: str = "") -> list[float]:
        """The chance that a draft at each depth 1..depth is accepted on this sequence, for proposals counted
        at ``stat`` (a drafter, or a drafter's grade: stat_key) in agreement case ``agree``: its rates' product
        down to it, scaled by what such chosen drafts realised against such predictions."""
        return [min(0.99, p * f) for p, f in zip(reach(self.rates(row, stat, agree), depth),
                                                 self.trust.get(stat, NEUTRAL))]

    def rates(self, row: AutoRow, stat: str, agree: str = "") -> list[float]:
        prior = self.totals[stat].own_rates()
        tally = row.tallies.get(stat)
        out = tally.rates(prior, PRIOR_WEIGHT) if tally is not None else prior
        if agree:
            out[0] *= self.lift(stat, agree)
        return [min(0.99, r) for r in out]

    def lift(self, stat: str, agree: str) -> float:
        """How much more (or less) often every sequence's first drafts counted at ``stat`` were accepted in
        agreement case ``agree`` than in all cases, the case's counts pulled towards the overall rate."""
        overall = self.totals[stat].own_rates()[0]
        case = self.totals.get(stat + agree)
        if case is None or overall <= 0.0:
            return 1.0
        return (case.accepted[0] + overall * LIFT_WEIGHT) / (case.reached[0] + LIFT_WEIGHT) / overall

    # -- learning -----------------------------------------------------------------------------------------
    def observe(self, states: list[DecodeState], verdicts: list[Verdict]) -> None:
        by: dict[str, tuple[list[DecodeState], list[Verdict]]] = {}
        for s, v in zip(states, verdicts):
            row = self.rows.get(s)
            if row is not None and row.ledger is not None:
                self._settle(row, v)
            if row is not None and row.trying is not None:
                self._score_trial(row, v)
            for part in row.parts if row is not None else ():
                own = Verdict([part.nodes.index(i) for i in v.accepted if i in part.nodes],
                              sum(i < v.verified for i in part.nodes))  # a breadth-first cut keeps a prefix
                by.setdefault(part.name, ([], []))[0].append(s)
                by[part.name][1].append(own)
                if own.verified:
                    self._calibrate(row, part.stats[0], part.depths, own, part.agree)
                    for stat in () if part.whole else part.stats:  # a whole one is counted as a shadow
                        self._count(row, stat, len(own.accepted), max(part.depths[:own.verified]), part.agree)
        for n, (ss, vs) in by.items():
            self.drafters[n].observe(ss, vs)

    def step_took(self, rows: int, tokens: int, seconds: float) -> None:
        self.packed.learn(rows, tokens, seconds)
        if rows == 1:
            self.cost.learn(tokens, seconds)

    def forget(self) -> None:
        """Each drafter's memory of earlier answers goes; what was learnt of their acceptance and cost stays."""
        for d in self.drafters.values():
            d.forget()

    def _calibrate(self, row: AutoRow, stat: str, depths: list[int], v: Verdict, agree: str = "") -> None:
        """Compare the chances predicted (before calibration) for the verified nodes (of ``depths``, one a node of
        the proposal) with what was accepted."""
        depths = depths[:v.verified]
        p = reach(self.rates(row, stat, "" if stat.endswith(BESIDE) else agree), max(depths))
        hits = set(v.accepted)
        self.calibration[stat].add(depths, [p[d - 1] for d in depths], [i in hits for i in range(len(depths))],
                                   CALIBRATION_DECAY)
        self.trust[stat] = self.calibration[stat].factors(CALIBRATION_WEIGHT)

    def _count(self, row: AutoRow, stat: str, accepted: int, depth: int, agree: str = "") -> None:
        row.tallies.setdefault(stat, Tally()).add(accepted, depth, decay=DECAY)
        self.totals[stat].add(accepted, depth, decay=1.0)
        if agree and not stat.endswith(BESIDE):  # every sequence's first drafts by agreement: what ``lift`` reads
            self.totals[stat + agree].add(min(accepted, 1), 1, decay=1.0)

    def _shadow(self, row: AutoRow, s: DecodeState, offers: dict[str, DraftTree], choice: Choice) -> bool:
        """Greedy rows: a cheap drafter's chain that is not verified is scored once the next tokens are known
        (also as beside the chosen proposal where its top token differs from that one's). So is the chosen
        chain where it was cut, whole: the drafts past the cut are counted as if verified (their depths'
        rates would otherwise stay where they were when the cut began); returns whether it was."""
        if not s.sampling.greedy:
            return False
        verified = [choice.name] + [n for n, _ in choice.extras]
        for n, tree in offers.items():
            if n not in verified and len(tree) and n not in row.shadows and shape_of(tree.with_root()).is_chain:
                stat = stat_key(n, tree.grade)
                apart = len(choice.tree) and _apart([choice.tree], tree)
                row.shadows[n] = (len(s.tokens), tree.tokens.tolist(), (stat, stat + BESIDE) if apart else (stat,),
                                  row.agree.get(n, ""))
        offer, key = offers.get(choice.name), f"{choice.name}{WHOLE}"
        cut = offer is not None and len(choice.tree) < len(offer) and shape_of(offer.with_root()).is_chain
        if not (self.whole_chains and cut) or key in row.shadows:
            return False
        row.shadows[key] = (len(s.tokens), offer.tokens.tolist(), (stat_key(choice.name, offer.grade),),
                            row.agree.get(choice.name, ""))
        return True

    def _score_shadows(self, row: AutoRow, s: DecodeState) -> None:
        for n, (at, tokens, stats, agree) in list(row.shadows.items()):
            m = shadow_accepted(tokens, s.tokens[at:])
            if m is not None:
                for stat in stats:
                    self._count(row, stat, m, len(tokens), agree)
                del row.shadows[n]


def agreement(offers: dict[str, DraftTree]) -> dict[str, str]:
    """Each offer's drafter -> AGREE where another offer's top tokens meet its own, DIFFER where none does; none
    where it is the only offer."""
    tops = {n: _tops([t]) for n, t in offers.items() if len(t)}
    if len(tops) < 2:
        return {}
    return {n: AGREE if mine & set().union(*(t for m, t in tops.items() if m != n)) else DIFFER
            for n, mine in tops.items()}


def _tops(trees) -> set[int]:
    """The tokens at the top (depth 1) of ``trees``."""
    return {int(t.tokens[i]) for t in trees for i, p in enumerate(t.parents) if p < 0}


def _apart(trees: list[DraftTree], offer: DraftTree) -> bool:
    """Whether ``offer``'s top tokens are all different from those of ``trees``."""
    return not _tops(trees) & _tops([offer])


def gain(rates: list[float], k: int) -> float:
    """Expected accepted tokens of a k-token chain with acceptance ``rates`` by depth."""
    return sum(reach(rates, k))
