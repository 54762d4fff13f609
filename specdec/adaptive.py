"""Adaptive speculation: each step, how many drafts each request verifies (0 when it would not
pay), from its own measured acceptance and a model of what a step costs per row.

Acceptance (``Acceptance``, one per request, kept in its ``SpecStats``): per draft source the
chance that a draft is accepted given the ones before it were, estimated from the request's
own verify rounds (every draft tried is an accepted / rejected event) with a prior of
``PRIOR`` events at 1/2 and exponential forgetting, so the estimate follows a request whose
text changes; a request that drafts nothing forgets a little each step, so it tries again
later. The choice takes the estimate plus ``BONUS / sqrt(events + PRIOR)`` (``optimistic``): a
request with few rounds of its own tries a draft or two before it gives up, so one rejected
draft does not end its drafting where drafts pay; and a round's MTP drafts are at most one more
than the request's accepted ones (``earned``), so finding out costs one draft a round. Only
the request's own rounds count: another request's acceptance never moves its k. The
constants trade what finding out costs where drafts do not pay against what stopping too
early costs where they do, chosen on ``python -m hybridrt.bench.adaptive_sim`` (a request's
choices against drawn acceptance, at the 0.8B shape's measured costs).

Cost (``CostModel``): a step in units of a one-row decode step: ``1 + row * (rows - 1)``
while reading the weights bounds it, ``compute_row * rows`` once the rows' arithmetic does
(whichever is larger), plus ``verify`` (and ``verify_row`` per row) when the step verifies
anything, ``ctx_row`` per row per 1024 tokens of its context (attention), and ``draft_pass``
per MTP draft (``probe_pass`` for a round of one draft through the probe head). The defaults
are a prior: the 0.8B shape's CPU measurements (docs/performance.md: a verify step of 2..5 rows
1.13..1.19 decode steps) and estimates of ``compute_row`` and ``ctx_row``; the proposer prices a
draft pass at its weights' bytes over a decode step's (``MTPProposer.draft_bytes``: batch 1
reads its weights, and the full head's pass reads several times the reduced head's).

Probes (``Candidate.probe_round``): where the MTP drafts through a full head of a large
vocabulary (``specdec.proposer``), a round of one MTP draft goes through the probe head, the
int8 rows of the most frequent tokens, at about a quarter of the full head's pass (the 0.8B
shape: 0.10 of a decode step against 0.36), and is priced at that; deeper rounds go through
the full head. One draft's gain is its acceptance, under 1: through the full head it pays
only where the acceptance is above about a third, through the probe head from about a tenth.
The probe's drafts count towards the same acceptance as the full head's; coming from fewer
tokens, they are accepted at most about as often, so the estimate that prices deeper rounds
errs low.

Measured cost (``MeasuredCosts``, fed by the proposer after every step): the engine's own step
times, fitted by least squares over the recent steps as a plain step of S sequences,
``a + b S``, plus, for a step that verifies D drafts, ``c + d D`` (weak pulls where the steps
do not decide: the prior's row, a draft row costing a sequence's, the prior's verify cost),
and the seconds per MTP draft (and per probe); ``model()`` turns them into a ``CostModel`` in
units of the fitted one-row step, ``draft_row`` apart from ``row``. The fit holds the attention
of the contexts its steps had (``ctx_row`` 0: a verification row 16k tokens deep costs what the
fit says, not that plus the prior's context term again). A draft pass of more than
``proposer.PASS_ROWS`` input rows per drafting request (a request's first draft after its
prompt runs the prompt's rows through the MTP layer; a lazy request's waiting rows) is not
timed: that is not what a draft costs, and charged to the draft it can stop all drafting, after
which no draft comes to correct it (docs/speculation.md). (Off in the batch-invariant mode,
whose choices must not depend on time.)

The choice (``choose_ks``): the ks that maximise the batch's expected tokens per unit of
cost, ``(B + sum E_i) / cost``, with E_i the expected accepted drafts of request i,
``sum_j prod_{m<=j} alpha_i(m)``, the verify step's fixed cost counted once; 0 for every
request unless drafting raises that ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

FORGET = 0.95  # weight kept by the earlier events at each new event
IDLE_FORGET = 0.99  # weight kept at each step that drafts nothing
PRIOR = 3.0  # events' weight of the prior (1/2) in a request's estimate
BONUS = 0.2  # the choice's optimism: BONUS / sqrt(events + PRIOR) over the estimate


@dataclass(slots=True)
class Acceptance:
    """Decayed accepted / rejected draft counts per source."""

    accepted: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, float] = field(default_factory=dict)

    def alpha(self, source: str) -> float:
        """The estimated chance that a draft of ``source`` is accepted (``PRIOR`` events at
        1/2 besides the request's own)."""
        a, r = self.accepted.get(source, 0.0), self.rejected.get(source, 0.0)
        return (a + PRIOR / 2) / (a + r + PRIOR)

    def optimistic(self, source: str) -> float:
        """What the choice takes: the estimate plus ``BONUS / sqrt(events + PRIOR)``, so that
        a request with few rounds of its own tries a draft or two before it gives up (one
        rejected draft must not end a request's drafting where they pay)."""
        n = self.accepted.get(source, 0.0) + self.rejected.get(source, 0.0)
        return min(1.0, self.alpha(source) + BONUS / (n + PRIOR) ** 0.5)

    def observe(self, source: str, accepted: bool) -> None:
        a, r = self.accepted.get(source, 0.0), self.rejected.get(source, 0.0)
        self.accepted[source] = a * FORGET + accepted
        self.rejected[source] = r * FORGET + (not accepted)

    def earned(self, source: str) -> int:
        """The drafts of ``source`` a round may try: one more than the request's accepted ones
        (decayed, rounded down). A request finds out with one draft a round and drafts deeper
        only as its drafts are accepted: where they are not, each round of finding out costs
        one draft, not the two to four the prior's optimism would pick (what that cost:
        docs/speculation.md)."""
        return 1 + int(self.accepted.get(source, 0.0))

    def idle(self) -> None:
        for d in (self.accepted, self.rejected):
            for s in d:
                d[s] *= IDLE_FORGET


@dataclass(frozen=True, slots=True)
class CostModel:
    """A step's cost in one-row decode steps (the module's docstring)."""

    row: float = 0.02
    compute_row: float = 0.15
    verify: float = 0.11
    ctx_row: float = 0.008
    draft_pass: float = 0.075
    verify_row: float = 0.0
    # a drafted row's cost in a verifying step, where it differs from a sequence's row (the
    # measured model's: a draft row shares its sequence's context); None: ``row``'s
    draft_row: float | None = None
    # a round of one MTP draft through the probe head (``Candidate.probe``); None: no probe
    # head, such a round costs ``draft_pass``
    probe_pass: float | None = None

    def step(self, rows: int, ctx_rows: float = 0.0, verifying: bool = False,
             drafts: int = 0) -> float:
        """A step of ``rows`` rows, ``drafts`` of them drafts, whose contexts sum to
        ``ctx_rows`` tokens."""
        seqs = rows if self.draft_row is None else rows - drafts
        t = max(1.0 + self.row * (seqs - 1), self.compute_row * seqs)
        if self.draft_row is not None:
            t += self.draft_row * drafts
        if verifying:
            t += self.verify + self.verify_row * (rows - 1)
        return t + self.ctx_row * ctx_rows / 1024

    @classmethod
    def for_device(cls, device) -> CostModel:
        """The defaults for a device (a torch.device or its name): the CPU's above; a GPU's
        rows stay cheap to hundreds (its arithmetic is ~100x a CPU's, its bytes ~30x)."""
        if str(device).startswith("cuda"):
            return cls(row=0.005, compute_row=0.003, verify=0.05, ctx_row=0.004)
        return cls()

    def row_slope(self, rows: int) -> float:
        """What one more draft row costs a verifying step of ``rows`` rows (context aside)."""
        if self.draft_row is not None:
            return self.draft_row + self.verify_row
        memory_bound = 1.0 + self.row * (rows - 1) >= self.compute_row * rows
        return (self.row if memory_bound else self.compute_row) + self.verify_row


class MeasuredCosts:
    """The engine's own step and draft times (the module's docstring). ``observe_step``: a
    step of ``seqs`` sequences verifying ``drafts`` drafts in all took ``seconds`` from the end
    of the drafting after the previous step to the drafting after it; ``observe_drafts``: the
    MTP drafting of a step made ``drafts`` MTP drafts in ``seconds``.

    One least-squares fit over every observed step, each weighing ``FORGET`` of the next:
    ``seconds ~ a + b seqs + (c + d drafts if drafts)``, ``a + b seqs`` the plain step and ``c``
    and ``d`` a verifying step's fixed cost and cost per draft row. Weak pulls decide what the
    steps do not: ``b`` towards the prior's row (sequences that hardly vary), ``d`` towards
    ``b`` (draft counts that hardly vary: a batch where every request drafts k), ``c`` towards
    the prior's verify cost (before any verify step, the prior's). A draft row is priced apart
    from a sequence: counted as one more, fixed k = 1 at batch 32, 16k deep, put every verify
    step at 64 rows, a 33-row step came out cheap on 32 sequences' slope, and adaptive
    requests drafted where nothing paid (docs/speculation.md)."""

    FORGET = 0.97
    # the pulls' weights, in the squares of the steps' counts: b's and d's weak (they decide
    # only where sequences or drafts hardly vary); c's next to nothing, so that it decides c
    # only where nothing else does (no verify step yet; every step verifying) and never pulls
    # a measured verify cost, which the rows' slopes would then bend to meet
    PULL_ROW, PULL_DRAFT_ROW, PULL_VERIFY = 2.0, 0.5, 1e-3
    # a step over this many times its expected time is not counted (a pause between two calls,
    # another process on the cores): the fitted time where the fit has seen steps as large,
    # else the largest such step's scaled by the prior's shape (a batch of 32 16k deep takes 14
    # times one request's step, where a fit from one request says 1.6; a first verify step
    # slowed down 8 times by a busy machine, counted, priced verification out of every later
    # step, and no verify step came to correct it). After PAUSES such steps in a row the next
    # is counted: the costs changed.
    OUTLIER = 4.0
    PAUSES = 2

    def __init__(self, prior: CostModel):
        self.prior = prior
        self.xx = [[0.0] * 4 for _ in range(4)]  # decayed sums of x x^T, x = (1, S, V, D)
        self.xy = [0.0] * 4
        self.shape = 0.0  # decayed sum of the prior's shape of each step (``_unit``)
        self.weights = {False: 0.0, True: 0.0}  # decayed steps observed, plain / verifying
        self.largest = (0, 0)  # the most sequences and drafts of a step observed
        self.pauses = 0  # steps in a row not counted (``OUTLIER``)
        self.draft_seconds = 0.0
        self.drafts = 0.0
        self.probe_seconds = 0.0  # the same for probe rounds' passes
        self.probes = 0.0
        self._theta: tuple[float, float, float, float] | None = None

    def _unit(self) -> float | None:
        """Seconds of the prior's one-row plain step, scaled to the steps seen."""
        return self.xy[0] / self.shape if self.shape > 0 else None

    def _fit(self) -> tuple[float, float, float, float] | None:
        """(a, b, c, d), None before any step."""
        if self._theta is None and (unit := self._unit()) is not None:
            m = [row[:] for row in self.xx]
            r = self.xy[:]
            m[1][1] += self.PULL_ROW  # b -> the prior's row
            r[1] += self.PULL_ROW * self.prior.row * unit
            for i, j, v in ((1, 1, 1), (3, 3, 1), (1, 3, -1), (3, 1, -1)):  # d -> b
                m[i][j] += self.PULL_DRAFT_ROW * v
            m[2][2] += self.PULL_VERIFY  # c -> the prior's verify cost
            r[2] += self.PULL_VERIFY * self.prior.verify * unit
            self._theta = tuple(_solve(m, r))
        return self._theta

    def predict(self, seqs: float, drafts: float = 0) -> float | None:
        """Seconds of a step of ``seqs`` sequences verifying ``drafts`` drafts."""
        theta = self._fit()
        if theta is None:
            return None
        a, b, c, d = theta
        return a + b * seqs + (c + d * drafts if drafts else 0.0)

    def _expected(self, seqs: int, drafts: int) -> float | None:
        """What a step should take, for the pause filter (``OUTLIER``)."""
        want = self.predict(seqs, drafts)
        most = self.largest[0]
        if want is None or (seqs <= most and drafts <= self.largest[1]):
            return want
        base = min(seqs, most)
        return max(want, self.predict(base, 0) * self.prior.step(seqs + drafts, 0.0, drafts > 0)
                   / self.prior.step(base))

    def observe_step(self, seqs: int, drafts: int, seconds: float) -> None:
        want = self._expected(seqs, drafts)
        if want is not None and seconds > self.OUTLIER * want and self.pauses < self.PAUSES:
            self.pauses += 1
            return
        self.pauses = 0
        self.largest = (max(seqs, self.largest[0]), max(drafts, self.largest[1]))
        f, x = self.FORGET, (1.0, float(seqs), float(drafts > 0), float(drafts))
        for i in range(4):
            self.xy[i] = f * self.xy[i] + x[i] * seconds
            for j in range(4):
                self.xx[i][j] = f * self.xx[i][j] + x[i] * x[j]
        self.shape = f * self.shape + self.prior.step(seqs + drafts, 0.0, drafts > 0)
        for v in self.weights:
            self.weights[v] *= f
        self.weights[drafts > 0] += 1
        self._theta = None

    def observe_drafts(self, drafts: int, seconds: float) -> None:
        if drafts > 0:
            self.draft_seconds = 0.9 * self.draft_seconds + seconds
            self.drafts = 0.9 * self.drafts + drafts

    def observe_probes(self, probes: int, seconds: float) -> None:
        if probes > 0:
            self.probe_seconds = 0.9 * self.probe_seconds + seconds
            self.probes = 0.9 * self.probes + probes

    def model(self) -> CostModel:
        """The measured costs as a ``CostModel`` in units of a fitted one-row plain step (the
        prior until a step was seen)."""
        theta = self._fit()
        if theta is None or theta[0] + theta[1] <= 0:
            return self.prior
        a, b, c, d = theta
        plain1 = a + b
        draft = (self.draft_seconds / self.drafts / plain1 if self.drafts
                 else self.prior.draft_pass)
        probe = (self.probe_seconds / self.probes / plain1
                 if self.probes and self.prior.probe_pass is not None else self.prior.probe_pass)
        return CostModel(row=max(b, 0.0) / plain1, compute_row=0.0, verify=c / plain1,
                         ctx_row=0.0, draft_pass=draft, draft_row=max(d, 0.0) / plain1,
                         probe_pass=probe)


def _solve(m: list[list[float]], r: list[float]) -> list[float]:
    """x with m x = r (Gaussian elimination with partial pivoting; m is 4 x 4 and, with the
    pulls, positive definite)."""
    n = len(r)
    a = [m[i][:] + [r[i]] for i in range(n)]
    for col in range(n):
        p = max(range(col, n), key=lambda i: abs(a[i][col]))
        a[col], a[p] = a[p], a[col]
        for i in range(col + 1, n):
            f = a[i][col] / a[col][col]
            for j in range(col, n + 1):
                a[i][j] -= f * a[col][j]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (a[i][n] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x


@dataclass(slots=True)
class Candidate:
    """A request that may draft this step: its cap on k, its context length, and the
    estimated acceptance of each of its possible drafts (``alphas[j]``: draft j + 1's, given
    the earlier ones were accepted) and whether that draft needs an MTP pass. ``probe``: a
    round of one MTP draft goes through the probe head (``probe_round``)."""

    cap: int
    context_len: int
    alphas: list[float]
    mtp: list[bool]
    probe: bool = False

    def probe_round(self, k: int) -> bool:
        """Whether a round of ``k`` drafts drafts through the probe head: one MTP draft, no
        prompt-lookup draft before it, where the request has a probe head."""
        return self.probe and k == 1 and self.mtp[:1] == [True]

    def pass_cost(self, k: int, cost: CostModel) -> float:
        """What drafting ``k`` costs in draft passes: the probe head's for a probe round (where
        the model prices one), else ``draft_pass`` per MTP draft."""
        if cost.probe_pass is not None and self.probe_round(k):
            return cost.probe_pass
        return cost.draft_pass * sum(self.mtp[:k])


def expected_gain(alphas: Sequence[float], k: int) -> float:
    """Expected accepted drafts of the first ``k``: sum_j prod_{m <= j} alphas[m]."""
    total, run = 0.0, 1.0
    for a in alphas[:k]:
        run *= a
        total += run
    return total


def choose_ks(cands: Sequence[Candidate], batch_rows: int, cost: CostModel) -> list[int]:
    """k per candidate for a step of ``batch_rows`` rows without drafts: the ks that maximise
    the step's expected tokens per unit of cost, 0 for all unless that beats drafting nothing.
    A step that verifies pays the fixed verify cost once whatever its ks, so among choices that
    verify the ratio is a sum over requests over a sum over requests plus a constant: found by
    Dinkelbach's iteration (at the current ratio each request alone picks the k that gains most
    over what its rows and drafts cost; the ratio of that choice is the next one), at least
    one draft kept, from two starts: one draft each, and each request's choice at the ratio of
    drafting nothing; the best is compared with drafting nothing. (Starting from no drafts
    alone would leave out a fixed cost below zero, which a deep context's measured verify line
    can have: docs/speculation.md; where rows turn compute-bound either start can stop short.)
    One request alone: every k compared (exact, and cheaper)."""
    def ratio(ks: list[int]) -> float:
        tokens = batch_rows + sum(expected_gain(c.alphas, k) for c, k in zip(cands, ks))
        ctx = sum((1 + k) * c.context_len for c, k in zip(cands, ks))
        spent = (cost.step(batch_rows + sum(ks), ctx, any(ks), sum(ks))
                 + sum(c.pass_cost(k, cost) for c, k in zip(cands, ks)))
        return tokens / spent

    def pick(lam: float, rows: int) -> list[int]:
        """Each request's k at ratio ``lam`` (its gain over what its rows and drafts cost), at
        least one draft in all."""
        slope = cost.row_slope(rows)
        values = []
        for c in cands:
            row = slope + cost.ctx_row * c.context_len / 1024
            values.append([expected_gain(c.alphas, k) - lam * (k * row + c.pass_cost(k, cost))
                           for k in range(c.cap + 1)])
        ks = [max(range(len(v)), key=lambda k, v=v: (v[k], -k)) for v in values]
        if not any(ks):  # the step must verify something: the draft that loses least
            i = max((i for i, c in enumerate(cands) if c.cap),
                    key=lambda i: max(values[i][1:]))
            ks[i] = 1 + max(range(cands[i].cap), key=lambda k: (values[i][k + 1], -k))
        return ks

    none = [0] * len(cands)
    if not any(c.cap for c in cands):
        return none
    if len(cands) == 1:  # one request: every k (the fewest drafts among equals)
        return [max(range(cands[0].cap + 1), key=lambda k: (ratio([k]), -k))]
    plain = ratio(none)
    best, best_ratio = none, plain
    # two starts: one draft each, and each request's choice at the ratio of drafting nothing
    # (where rows turn compute-bound the ratio is not a sum over requests, and either start
    # can stop short of the other's choice)
    for ks in ([min(1, c.cap) for c in cands], pick(plain, batch_rows)):
        r = ratio(ks)
        for _ in range(8):
            nxt = pick(r, batch_rows + sum(ks))
            nr = ratio(nxt)
            if nr <= r:
                break
            ks, r = nxt, nr
        if r > best_ratio:
            best, best_ratio = ks, r
    return best
