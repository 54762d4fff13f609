"""Adaptive speculation: each step, how many drafts each request verifies (0 when it would not
pay), from its own measured acceptance and a model of what a step costs per row.

Acceptance (``Acceptance``, one per request, kept in its ``SpecStats``): per draft source the
chance that a draft is accepted given the ones before it were, estimated from the request's
own verify rounds (every draft tried is an accepted / rejected event) with a Beta(1, 1) prior
and exponential forgetting, so the estimate follows a request whose text changes; a request
that drafts nothing forgets a little each step, so it tries again later.

Cost (``CostModel``): seconds of a step in units of a one-row decode step, ``1 + row * (rows -
1)``, plus ``verify`` when the step verifies anything, ``ctx_row`` per row per 1024 tokens of
its context (attention), and ``draft_pass`` per MTP draft pass. The defaults are the 0.8B
shape's CPU measurements (docs/performance.md: a verify step of 2..5 rows 1.13..1.19 decode
steps, a draft pass 0.075); ``hybridrt bench spec`` measures them on a machine.

The choice (``choose_ks``): the batch's tokens per unit of cost, ``(B + sum E_i) / cost``, with
E_i the expected accepted drafts of request i, ``sum_j prod_{m<=j} alpha_i(m)``; from k = 0 for
every request, the best-paying extension of one request (any number of further drafts, so
that a fixed cost paid once can pay) is taken while it raises the ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

FORGET = 0.95  # weight kept by the earlier events at each new event
IDLE_FORGET = 0.9  # weight kept at each step that drafts nothing


@dataclass(slots=True)
class Acceptance:
    """Decayed accepted / rejected draft counts per source."""

    accepted: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, float] = field(default_factory=dict)

    def alpha(self, source: str) -> float:
        """The estimated chance that a draft of ``source`` is accepted (Beta(1, 1) prior)."""
        a, r = self.accepted.get(source, 0.0), self.rejected.get(source, 0.0)
        return (a + 1.0) / (a + r + 2.0)

    def observe(self, source: str, accepted: bool) -> None:
        a, r = self.accepted.get(source, 0.0), self.rejected.get(source, 0.0)
        self.accepted[source] = a * FORGET + accepted
        self.rejected[source] = r * FORGET + (not accepted)

    def idle(self) -> None:
        for d in (self.accepted, self.rejected):
            for s in d:
                d[s] *= IDLE_FORGET


@dataclass(frozen=True, slots=True)
class CostModel:
    """A step's cost in one-row decode steps (the module's docstring)."""

    row: float = 0.02
    verify: float = 0.11
    ctx_row: float = 0.008
    draft_pass: float = 0.075

    def row_cost(self, context_len: int) -> float:
        return self.row + self.ctx_row * context_len / 1024


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
    """k per candidate for a step of ``batch_rows`` rows without drafts (the module's
    docstring)."""
    ks = [0] * len(cands)
    tokens = float(batch_rows)
    spent = 1.0 + cost.row * (batch_rows - 1) + sum(
        cost.ctx_row * c.context_len / 1024 for c in cands)
    verifying = False
    passes = [0] * (max((c.cap for c in cands), default=0) + 1)  # MTP rows per draft depth
    while True:
        best = None
        for i, c in enumerate(cands):
            k0 = ks[i]
            gain = extra = 0.0
            depth = list(passes)
            for k in range(k0 + 1, c.cap + 1):
                gain = expected_gain(c.alphas, k) - expected_gain(c.alphas, k0)
                extra += cost.row_cost(c.context_len)
                if c.mtp[k - 1]:
                    extra += cost.draft_pass if depth[k] == 0 else cost.row
                    depth[k] += 1
                total = extra + (0.0 if verifying else cost.verify)
                ratio = (tokens + gain) / (spent + total)
                if ratio > tokens / spent and (best is None or ratio > best[0]):
                    best = (ratio, i, k, gain, total)
        if best is None:
            return ks
        _, i, k, gain, total = best
        for j in range(ks[i] + 1, k + 1):
            if cands[i].mtp[j - 1]:
                passes[j] += 1
        ks[i], tokens, spent, verifying = k, tokens + gain, spent + total, True
