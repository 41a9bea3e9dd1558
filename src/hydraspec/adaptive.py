"""Speculation that follows the load: how many draft tokens each row gets per step.

With R running rows each drafting k tokens, one verify forward holds R (k + 1) tokens and costs c(R (k + 1))
(measured at start-up: one forward over 1, 2, 3, ... 16, 20, 24, 32 new tokens after a short prefix; linear
between and beyond the points). If each drafted token is accepted with probability a given the ones before it, a row
emits on average (1 - a^(k+1)) / (1 - a) tokens per step. Before drafting, the rule picks the k in 0..k_max
that maximises R (1 - a^(k+1)) / (1 - a) / c(R (k + 1)), the expected tokens per second of the whole batch;
k = 0 (plain decoding) wins when the forward's cost grows faster than acceptance pays, and unless drafting is
expected to beat it by PAY_MARGIN (the model leaves out per-row drafting and acceptance work, which grows with
the rows). A drafter whose proposals cost next to nothing (prompt lookup) always gets k_max here.

After drafting, :meth:`AdaptiveDraft.widths` cuts each row's actual proposal with each row's own rates by
depth (hydraspec.tally; its own counts, with every row's as prior), counted apart for each grade of proposal
(``DraftTree.grade``: suffix decoding's match length, so a one-token match's tree is valued as those fare and a
long match's as long matches do): where the engine verifies rows packed
(each row's nodes cost only themselves) the i-th draft of row b is worth the chance of reaching it,
r_1 ... r_i, and the rule keeps the drafts worth most as
long as expected tokens per second still grow; with padded rows it picks one common length. So in a full
batch the rows whose lookups keep hitting still draft, and the others cost nothing. ``a`` starts from a
prior of 0.5 worth 20 draws (hydraspec.policy).

The model is then checked against the clock: the engine reports every step's wall time and emitted tokens
(:meth:`AdaptiveDraft.observe`), and per number of rows the rule keeps the tokens per second of the steps that
asked the drafter (however much of its proposals was kept) and of those that did not (averaged over the last
~EWMA_STEPS of each). Where the model says "draft", one step in PROBE_EVERY decodes plainly instead (one in
4 x PROBE_EVERY once MIN_STEPS are in); once both sides have MIN_STEPS steps and the drafting steps are
measured slower, that row count decodes plainly, still trying the model's draft length one step in
PROBE_EVERY in case acceptance has changed; so does every larger row count not yet measured itself. So the
rule is never slower than plain decoding for long, whatever the model leaves out (drafting work, Python
overhead, padding, a server's own costs).
"""
from __future__ import annotations

from .backend import rows_per_pass
from .drafters.base import DecodeState
from .policy import AcceptanceBook, BudgetPolicy, DraftPolicy, LatencyCap, StepReport
from .tally import reach
from .tree import DraftTree, shape_of
from .verify import can_pack
from .verify_cost import SIZES, Curve, measure_verify_cost

PAY_MARGIN = 1.15
PROBE_EVERY, MIN_STEPS, EWMA_STEPS = 10, 8, 32


class ClockCheck(DraftPolicy):
    """The clock's side of the module docstring: per number of rows, the tokens per second of the steps that
    drafted and of those that did not, and whether drafting was measured slower."""

    def __init__(self):
        # per number of rows: [tokens/s, steps] of drafting steps and of plain ones, and a step counter
        self.measured: dict[int, dict[str, list[float]]] = {}
        self.calls: dict[int, int] = {}

    def observe(self, rows: int, k: int, seconds: float, tokens: int) -> None:
        """One engine step at ``rows`` rows that drafted up to ``k`` tokens a row took ``seconds`` and emitted
        ``tokens`` tokens."""
        if seconds <= 0:
            return
        side = self.measured.setdefault(rows, {}).setdefault("draft" if k else "plain", [0.0, 0])
        rate, n = side
        w = 1.0 / min(n + 1, EWMA_STEPS)
        side[0], side[1] = rate + w * (tokens / seconds - rate), n + 1

    def _verdict(self, rows: int) -> bool | None:
        m = self.measured.get(rows, {})
        d, p = m.get("draft"), m.get("plain")
        if not (d and p and d[1] >= MIN_STEPS and p[1] >= MIN_STEPS):
            return None
        return d[0] < p[0]

    def drafting_loses(self, rows: int) -> bool:
        """Whether drafting steps at ``rows`` rows were measured slower than plain ones (enough of each); with
        too few steps at ``rows``, whether they were at some smaller row count (a wider batch only makes the
        verify forward's extra tokens cost more)."""
        own = self._verdict(rows)
        if own is not None:
            return own
        return any(self._verdict(r) for r in self.measured if r < rows)

    def probe(self, rows: int) -> bool:
        """Count a step at ``rows`` rows; whether it is one that goes against the current verdict: a draft
        where drafting was measured slower (one step in PROBE_EVERY), a plain step to compare with where it
        was not (one in PROBE_EVERY until MIN_STEPS plain ones are in, then one in 4 x PROBE_EVERY)."""
        n = self.calls[rows] = self.calls.get(rows, 0) + 1
        if self.drafting_loses(rows):
            return n % PROBE_EVERY == 0
        plain = self.measured.get(rows, {}).get("plain", [0.0, 0])[1]
        return n % (PROBE_EVERY if plain < MIN_STEPS else 4 * PROBE_EVERY) == 0


class PacedCheck(ClockCheck):
    """A drafter that paces itself (``auto``, which weighs each row's drafts on the step's fitted cost) checked
    against the clock as :class:`AdaptiveDraft` checks its model: at two or more decoding rows, the steps that
    verified drafts against those that verified none (steps that also read a prompt chunk are left out);
    where drafting is measured slower, that row count decodes plainly, but for a probe. One row keeps the
    drafter's own choice."""

    def limit(self, rows: int, extra: int = 0) -> int | None:
        if rows < 2:
            return None
        plain = self.drafting_loses(rows) != self.probe(rows)
        return 0 if plain else None

    def update(self, report: StepReport) -> None:
        if report.rows >= 2 and not report.readers and not report.joined:
            self.observe(report.rows, int(report.tokens > report.rows), report.seconds, report.emitted)


class AdaptiveDraft(ClockCheck):
    """The policy of the module docstring over measured costs ``cost`` ({tokens: seconds}) and the acceptance
    it counts itself (:class:`hydraspec.policy.AcceptanceBook`). packed: the engine verifies rows packed."""

    def __init__(self, cost: dict[int, float], k_max: int, check: bool = True, cheap: bool = False,
                 packed: bool = False):
        super().__init__()
        self.curve = Curve(cost)
        self.k_max = max(0, int(k_max))
        self.cheap, self.check, self.packed = cheap, check, packed
        self.book = AcceptanceBook()  # proposals without a grade, and every rate the rule asks before drafting
        self.graded: dict[int, AcceptanceBook] = {}  # grade -> its own book (DraftTree.grade)
        self.grade_of: dict[int, int] = {}  # sequence -> the grade of its last proposal
        self.last: dict[int, int] = {}

    def cost(self, n: int) -> float:
        return self.curve(n)

    @property
    def points(self) -> list[tuple[int, float]]:
        return self.curve.points

    @points.setter
    def points(self, points: list[tuple[int, float]]) -> None:
        self.curve = Curve(dict(points))

    def rate(self) -> float:
        return self.book.rate()

    def best_k(self, rows: int, a: float | None = None, extra: int = 0) -> int:
        """Draft nodes a row: the most expected tokens per second at ``rows`` rows, ``extra`` prompt tokens
        read in the same forward."""
        a = min(self.rate() if a is None else a, 0.999)
        plain = rows / self.cost(rows + extra)
        best, best_k = plain * PAY_MARGIN, 0
        for k in range(1, self.k_max + 1):
            gain = rows * (1 - a ** (k + 1)) / (1 - a) / self.cost(rows * (k + 1) + extra)
            if gain > best * 1.0001:
                best, best_k = gain, k
        return best_k

    def widths(self, rows: int, lengths: list[int], rates: list, extra: int = 0) -> list[int]:
        """How many of its ``lengths[b]`` proposed nodes row b keeps this step, given each row's acceptance
        (a rate, or rates by depth as hydraspec.tally counts them): the choice with the most expected tokens
        per second of the verify forward (see the module docstring), or none where plain decoding is expected
        to win by PAY_MARGIN; ``extra`` prompt tokens are read in the same forward. Packed verification (each
        row's nodes cost only themselves): rows keep different lengths, the i-th draft of row b being worth
        the chance of reaching it. Padded: one common length."""
        if not any(lengths):
            return list(lengths)
        worth = [reach([min(max(a, 0.0), 0.999) for a in (r if isinstance(r, list) else [r])], n)
                 for r, n in zip(rates, lengths)]
        if self.packed:
            return self._packed_widths(rows, worth, extra)
        best, keep = rows / self.cost(rows + extra) * PAY_MARGIN, [0] * rows
        for m in range(1, max(lengths) + 1):
            value = rows + sum(sum(w[:m]) for w in worth)
            step = self.cost(rows * (m + 1) + extra)
            if value / step > best * 1.0001:
                best, keep = value / step, [min(n, m) for n in lengths]
        return keep

    def _packed_widths(self, rows: int, worth: list[list[float]], extra: int) -> list[int]:
        best, keep = rows / self.cost(rows + extra) * PAY_MARGIN, [0] * rows
        ranked = sorted(((w, b) for b, ws in enumerate(worth) for w in ws), reverse=True)
        value, count = float(rows), 0
        for j, (w, _) in enumerate(ranked):
            value += w
            step = self.cost(rows + extra + j + 1)
            if value / step > best * 1.0001:
                best, count = value / step, j + 1
        for _, b in ranked[:count]:
            keep[b] += 1
        return keep

    def limit(self, rows: int, extra: int = 0) -> int:
        k = self.k_max if self.cheap else self.best_k(rows, extra=extra)
        if k and self.check and self.drafting_loses(rows) != self.probe(rows):
            k = 0  # measured slower (but for a probe), or a plain step to compare with
        self.last[rows] = k
        return k

    def book_of(self, grade: int) -> AcceptanceBook:
        """Where proposals of ``grade`` are counted: graded ones apart, so that a long match's proposal is valued
        as long matches fare (hydraspec.drafters.suffix.match_grade)."""
        return self.book if not grade else self.graded.setdefault(grade, AcceptanceBook())

    def cut(self, trees: list[DraftTree], states: list[DecodeState], extra: int = 0) -> list[DraftTree]:
        """Each row keeps :meth:`widths` of its proposal; a cut chain is scored later as if verified."""
        for tree, s in zip(trees, states):
            self.grade_of[s.key] = tree.grade
        books = [self.book_of(t.grade) for t in trees]
        keep = self.widths(len(trees), [len(t) for t in trees], [b.row_rates(s.key) for b, s in zip(books, states)],
                           extra)
        out = []
        for tree, s, w, book in zip(trees, states, keep, books):
            if w < len(tree):
                if shape_of(tree.with_root()).is_chain:
                    book.shadow(s.key, len(s.tokens), tree.tokens.tolist())
                tree = tree.head(w)
            out.append(tree)
        return out

    def update(self, report: StepReport) -> None:
        steps = report.row_steps
        grades = [self.grade_of.get(s.key, 0) for s in steps]
        for grade, book in [(0, self.book), *self.graded.items()]:
            book.update([s for s, g in zip(steps, grades) if g == grade])
            book.settle([s for s, g in zip(steps, grades) if g != grade])
        for s in report.row_steps:
            if s.done:
                self.grade_of.pop(s.key, None)
        self.observe(report.rows, int(report.drafted), report.seconds, report.emitted)

    def describe(self) -> str:
        costs = ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in self.points)
        ks = ", ".join(f"{r} rows -> {self.best_k(r)}" for r in (1, 2, 4, 8))
        text = f"verify cost by tokens {{{costs}}}; acceptance rate {self.rate():.2f}; draft tokens per row: {ks}"
        seen = [f"{r} rows: drafting {m['draft'][0]:.1f} vs plain {m['plain'][0]:.1f} tokens/s"
                for r, m in sorted(self.measured.items()) if "draft" in m and "plain" in m]
        return text + ("; measured " + ", ".join(seen) if seen else "")


def make_policy(model, drafter, *, greedy: bool = True, acceptor: str | None = None, budget: int | None = None,
                adaptive: bool = True, serving: bool = False, max_step_cost: float = 0.0) -> DraftPolicy:
    """The draft policy (:func:`draft_policy`); a server's with ``max_step_cost`` > 0 also bounds every step's
    cost to that many plain steps (:class:`hydraspec.policy.LatencyCap`)."""
    policy = draft_policy(model, drafter, greedy=greedy, acceptor=acceptor, budget=budget, adaptive=adaptive,
                          serving=serving)
    if serving and max_step_cost > 0:
        return LatencyCap(policy, Curve(measure_verify_cost(model, sizes=SIZES)), max_step_cost, rows_per_pass(model))
    return policy


def draft_policy(model, drafter, *, greedy: bool = True, acceptor: str | None = None, budget: int | None = None,
                 adaptive: bool = True, serving: bool = False) -> DraftPolicy:
    """The one place the draft policy is chosen. ``budget``: a fixed verify budget (BudgetPolicy). Otherwise
    the adaptive rule where it applies, on the CPU: greedy decoding with greedy acceptance (a server also
    for sampled requests) and a drafter whose proposals cost next to nothing (a server: any drafter, whose
    drafts it cuts by the load). Sampling keeps the drafter's own lengths elsewhere: which drafts are
    verified decides which random numbers are drawn, and a seed must give the same text on every run.
    A drafter that paces itself keeps its own choice, checked against the clock at several rows where the
    same conditions hold (PacedCheck). Otherwise every proposal is verified whole (DraftPolicy)."""
    if budget is not None:
        return BudgetPolicy(budget)
    if not adaptive or drafter.max_nodes < 1 or model.device.type != "cpu":
        return DraftPolicy()
    exact = greedy and acceptor in (None, "greedy")
    if drafter.paced:
        return PacedCheck() if serving or exact else DraftPolicy()
    if not serving and (not exact or not drafter.cheap):
        return DraftPolicy()
    return AdaptiveDraft(measure_verify_cost(model, sizes=SIZES), drafter.max_nodes, cheap=drafter.cheap,
                         packed=can_pack(model))
