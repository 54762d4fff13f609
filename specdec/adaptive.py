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
per MTP draft. The defaults are a prior: the 0.8B shape's CPU measurements (docs/performance.md:
a verify step of 2..5 rows 1.13..1.19 decode steps) and estimates of ``compute_row`` and
``ctx_row``; the proposer prices a draft pass at its weights' bytes over a decode step's
(``MTPProposer.draft_bytes``: batch 1 reads its weights, and the full head's pass reads several
times the reduced head's).

Measured cost (``MeasuredCosts``, fed by the proposer after every step): the engine's own step
times, fitted as two lines in the step's rows, ``a + b * rows`` for steps that verify and for
those that do not (least squares over the recent steps, the prior's slope a weak pull where the
rows hardly vary), and the seconds per MTP draft; ``model()`` turns them into a ``CostModel``
in units of the fitted one-row step. The lines hold the attention of the contexts their steps
had (``ctx_row`` 0: a verification row 16k tokens deep costs what the verify line's slope
says, not that plus the prior's context term again). A draft pass of more than
``proposer.PASS_ROWS`` input rows per drafting request (a request's first draft after its
prompt runs the prompt's rows through the MTP layer; a lazy request's waiting rows) is not
timed: that is not what a draft costs, and charged to the draft it can stop all drafting, after
which no draft comes to correct it (docs/speculation.md). Where a line has fewer than
``MIN_STEPS`` steps, the other one plus the prior's difference between them stands in (the
prior's shape scaled to the steps seen where neither has); the verify line's slope is pulled
towards the plain line's, where its rows hardly vary. (Off in the batch-invariant mode, whose
choices must not depend on time.)

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

    def step(self, rows: int, ctx_rows: float = 0.0, verifying: bool = False) -> float:
        """A step of ``rows`` rows whose contexts sum to ``ctx_rows`` tokens."""
        t = max(1.0 + self.row * (rows - 1), self.compute_row * rows)
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
        """What one more row costs a verifying step of ``rows`` rows (context aside)."""
        memory_bound = 1.0 + self.row * (rows - 1) >= self.compute_row * rows
        return (self.row if memory_bound else self.compute_row) + self.verify_row


class LineFit:
    """``seconds ~ a + b * rows`` by least squares over the observations, each weighing
    ``forget`` of the next, with the slope pulled towards ``prior_slope`` (weight ``pull``,
    which decides it where the rows hardly vary)."""

    def __init__(self, forget: float = 0.97, pull: float = 2.0):
        self.forget, self.pull = forget, pull
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def observe(self, rows: float, seconds: float) -> None:
        f = self.forget
        self.w, self.x, self.y = f * self.w + 1, f * self.x + rows, f * self.y + seconds
        self.xx, self.xy = f * self.xx + rows * rows, f * self.xy + rows * seconds

    @property
    def weight(self) -> float:
        return self.w

    def line(self, prior_slope: float) -> tuple[float, float]:
        """(a, b); call only after an observation."""
        w, x, y = self.w, self.x, self.y
        b = ((self.xy - x * y / w + self.pull * prior_slope)
             / (self.xx - x * x / w + self.pull))
        return (y - b * x) / w, b

    def mean(self) -> tuple[float, float]:
        return self.x / self.w, self.y / self.w


class MeasuredCosts:
    """The engine's own step and draft times (the module's docstring). ``observe_step``: a
    step of ``rows`` rows (verifying or not) took ``seconds`` from the end of the drafting
    after the previous step to the drafting after it; ``observe_drafts``: the MTP drafting of a
    step made ``drafts`` MTP drafts in ``seconds``."""

    MIN_STEPS = 4  # steps of a kind before their line replaces the prior's
    OUTLIER = 4.0  # a step over this many times the fitted time is not counted (a pause)

    def __init__(self, prior: CostModel):
        self.prior = prior
        self.lines = {False: LineFit(), True: LineFit()}
        self.draft_seconds = 0.0
        self.drafts = 0.0

    def _prior_shape(self, rows: float, verifying: bool) -> float:
        return self.prior.step(max(1, round(rows)), 0.0, verifying)

    def _unit(self) -> float | None:
        """Seconds of the prior's one-row plain step, from the best-observed line."""
        best = max(self.lines, key=lambda v: self.lines[v].weight)
        fit = self.lines[best]
        if fit.weight == 0:
            return None
        rows, secs = fit.mean()
        return secs / self._prior_shape(rows, best)

    def _lines(self) -> tuple[float, tuple | None, tuple | None] | None:
        """(unit, the plain line's (a, b), the verify line's), a line None before
        ``MIN_STEPS`` steps of it; None before any step. The slope's pull (what decides it
        where the rows hardly vary): the plain line's towards the prior's, the verify line's
        towards the plain line's where that one is measured. (A batch of 32, 16k deep: rows
        cost their context's attention, 0.4 one-row steps each; verification measured at 33
        rows alone and pulled to the prior's 0.02 put the slopes' difference times 33 into
        its fixed cost.)"""
        unit = self._unit()
        if unit is None:
            return None
        fits = []
        slope = self.prior.row * unit
        for verifying in (False, True):
            fit = self.lines[verifying]
            fits.append(fit.line(slope) if fit.weight >= self.MIN_STEPS else None)
            if fits[0] is not None:
                slope = fits[0][1] + self.prior.verify_row * unit
        return unit, fits[0], fits[1]

    def predict(self, rows: float, verifying: bool, lines=None) -> float | None:
        """Seconds of a step of ``rows`` rows (``lines``: ``_lines()``, if at hand)."""
        lines = lines or self._lines()
        if lines is None:
            return None
        unit, *fits = lines
        own, other = fits[verifying], fits[not verifying]
        if own is not None:
            return own[0] + own[1] * rows
        if other is not None:  # the measured line plus the prior's difference between them
            # (the prior's shape scaled alone would give the other kind the prior's row cost,
            # not the measured one: 16k deep, verification looked cheaper than plain steps)
            return other[0] + other[1] * rows + unit * (
                self._prior_shape(rows, verifying) - self._prior_shape(rows, not verifying))
        return unit * self._prior_shape(rows, verifying)

    def observe_step(self, rows: int, verifying: bool, seconds: float) -> None:
        want = self.predict(rows, verifying)
        if want is not None and seconds > self.OUTLIER * want:
            return
        self.lines[verifying].observe(rows, seconds)

    def observe_drafts(self, drafts: int, seconds: float) -> None:
        if drafts > 0:
            self.draft_seconds = 0.9 * self.draft_seconds + seconds
            self.drafts = 0.9 * self.drafts + drafts

    def model(self) -> CostModel:
        """The measured costs as a ``CostModel`` in units of a fitted one-row plain step (the
        prior until a step was seen)."""
        lines = self._lines()
        plain1 = self.predict(1, False, lines)
        if plain1 is None or plain1 <= 0:
            return self.prior
        verify1 = self.predict(1, True, lines)
        plain2, verify2 = self.predict(2, False, lines), self.predict(2, True, lines)
        draft = (self.draft_seconds / self.drafts / plain1 if self.drafts
                 else self.prior.draft_pass)
        return CostModel(row=max(plain2 - plain1, 0.0) / plain1, compute_row=0.0,
                         verify=(verify1 - plain1) / plain1,
                         verify_row=max((verify2 - verify1) - (plain2 - plain1),
                                        -max(plain2 - plain1, 0.0)) / plain1,
                         ctx_row=0.0, draft_pass=draft)


@dataclass(slots=True)
class Candidate:
    """A request that may draft this step: its cap on k, its context length, and the
    estimated acceptance of each of its possible drafts (``alphas[j]``: draft j + 1's, given
    the earlier ones were accepted) and whether that draft needs an MTP pass."""

    cap: int
    context_len: int
    alphas: list[float]
    mtp: list[bool]


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
    can have: docs/speculation.md; where rows turn compute-bound either start can stop short.)"""
    def ratio(ks: list[int]) -> float:
        tokens = batch_rows + sum(expected_gain(c.alphas, k) for c, k in zip(cands, ks))
        ctx = sum((1 + k) * c.context_len for c, k in zip(cands, ks))
        passes = sum(sum(c.mtp[:k]) for c, k in zip(cands, ks))
        spent = cost.step(batch_rows + sum(ks), ctx, any(ks)) + cost.draft_pass * passes
        return tokens / spent

    def pick(lam: float, rows: int) -> list[int]:
        """Each request's k at ratio ``lam`` (its gain over what its rows and drafts cost), at
        least one draft in all."""
        slope = cost.row_slope(rows)
        values = []
        for c in cands:
            row = slope + cost.ctx_row * c.context_len / 1024
            values.append([expected_gain(c.alphas, k)
                           - lam * (k * row + cost.draft_pass * sum(c.mtp[:k]))
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
