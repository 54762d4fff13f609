"""Adaptive speculation: each step, how many drafts each request verifies (0 when it would not
pay), from its own measured acceptance and a model of what a step costs per row.

Acceptance (``Acceptance``, one per request, kept in its ``SpecStats``): per draft source the
chance that a draft is accepted given the ones before it were, estimated from the request's
own verify rounds (every draft tried is an accepted / rejected event) with a Beta(1, 1) prior
and exponential forgetting, so the estimate follows a request whose text changes; a request
that drafts nothing forgets a little each step, so it tries again later.

Cost (``CostModel``): a step in units of a one-row decode step: ``1 + row * (rows - 1)``
while reading the weights bounds it, ``compute_row * rows`` once the rows' arithmetic does
(whichever is larger), plus ``verify`` when the step verifies anything, ``ctx_row`` per row
per 1024 tokens of its context (attention), and ``draft_pass`` per MTP draft. ``row``,
``verify`` and ``draft_pass`` are the 0.8B shape's CPU measurements (docs/performance.md: a
verify step of 2..5 rows 1.13..1.19 decode steps, a draft pass 0.075); ``compute_row`` and
``ctx_row`` are estimates (two cores' bf16 arithmetic for a row of the 0.8B shape; the KV
bytes of a row at 1024 tokens against the weights' bytes) that ``hybridrt bench spec``'s
verify cost per row count checks on a machine.

The choice (``choose_ks``): the ks that maximise the batch's expected tokens per unit of
cost, ``(B + sum E_i) / cost``, with E_i the expected accepted drafts of request i,
``sum_j prod_{m<=j} alpha_i(m)``; 0 for every request unless drafting raises that ratio.
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
    compute_row: float = 0.15
    verify: float = 0.11
    ctx_row: float = 0.008
    draft_pass: float = 0.075

    def step(self, rows: int, ctx_rows: float = 0.0, verifying: bool = False) -> float:
        """A step of ``rows`` rows whose contexts sum to ``ctx_rows`` tokens."""
        t = max(1.0 + self.row * (rows - 1), self.compute_row * rows)
        return t + self.ctx_row * ctx_rows / 1024 + (self.verify if verifying else 0.0)

    @classmethod
    def for_device(cls, device) -> CostModel:
        """The defaults for a device (a torch.device or its name): the CPU's above; a GPU's
        rows stay cheap to hundreds (its arithmetic is ~100x a CPU's, its bytes ~30x)."""
        if str(device).startswith("cuda"):
            return cls(row=0.005, compute_row=0.003, verify=0.05, ctx_row=0.004)
        return cls()

    def row_slope(self, rows: int) -> float:
        """What one more row costs a step of ``rows`` rows (context aside)."""
        memory_bound = 1.0 + self.row * (rows - 1) >= self.compute_row * rows
        return self.row if memory_bound else self.compute_row


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
    the step's expected tokens per unit of cost, found by Dinkelbach's iteration (at the
    current ratio every request alone picks the k that gains most over what its rows cost;
    the ratio of that choice is the next one), the fixed verify cost and the
    compute-bound slope checked on the whole choice. All 0 unless that pays."""
    def ratio(ks: list[int]) -> float:
        tokens = batch_rows + sum(expected_gain(c.alphas, k) for c, k in zip(cands, ks))
        ctx = sum((1 + k) * c.context_len for c, k in zip(cands, ks))
        passes = sum(sum(c.mtp[:k]) for c, k in zip(cands, ks))
        spent = cost.step(batch_rows + sum(ks), ctx, any(ks)) + cost.draft_pass * passes
        return tokens / spent

    best = [0] * len(cands)
    best_ratio = ratio(best)
    lam, rows = best_ratio, batch_rows
    for _ in range(8):
        slope = cost.row_slope(rows)
        ks = []
        for c in cands:
            row = slope + cost.ctx_row * c.context_len / 1024
            value = [expected_gain(c.alphas, k)
                     - lam * (k * row + cost.draft_pass * sum(c.mtp[:k]))
                     for k in range(c.cap + 1)]
            ks.append(max(range(c.cap + 1), key=lambda k: (value[k], -k)))
        r = ratio(ks)
        if r <= best_ratio:
            break
        best, best_ratio, lam, rows = ks, r, r, batch_rows + sum(ks)
    return best
