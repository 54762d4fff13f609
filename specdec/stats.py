"""Acceptance statistics for speculative decoding.

mean acceptance length = 1 + accepted / rounds (the bonus or correction token included);
per-position acceptance rate i = drafts accepted at position i / rounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecStats:
    k: int
    num_rounds: int = 0  # verify steps
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.k

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_rounds += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: SpecStats) -> None:
        if other.k > self.k:
            self.accepted_per_position += [0] * (other.k - self.k)
            self.k = other.k
        self.num_rounds += other.num_rounds
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted += other.num_accepted
        for i, a in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += a

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted / self.num_rounds if self.num_rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        n = self.num_rounds
        return [a / n if n else 0.0 for a in self.accepted_per_position]

    def as_dict(self) -> dict:
        return {
            "k": self.k,
            "num_rounds": self.num_rounds,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted": self.num_accepted,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance,
        }


KINDS = ("prefill", "decode", "verify", "draft")


@dataclass(slots=True)
class StepCosts:
    """Where the engine's time goes (``LLMEngine.step_costs``): wall seconds and counts of
    engine steps by kind, and of the MTP passes after them. A step is ``prefill`` when it
    computes any prompt token, else ``verify`` when it verifies any drafts, else ``decode``
    (one new token per request); its time runs from scheduling to the emitted tokens.
    ``draft`` is the proposer's time after a step (the MTP passes and picking the drafts).
    ``clock``: wall time by default; ``time.process_time`` gives this process's CPU time."""

    clock: Callable[[], float] = time.perf_counter
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def record(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += seconds
        self.counts[kind] += 1

    def merge(self, other: StepCosts) -> None:
        for k in KINDS:
            self.seconds[k] += other.seconds[k]
            self.counts[k] += other.counts[k]

    def mean(self, kind: str) -> float | None:
        """Mean seconds of one step (or one drafting) of this kind; None if there was none."""
        return self.seconds[kind] / self.counts[kind] if self.counts[kind] else None

    def as_dict(self) -> dict:
        return {f"{k}_{what}": d[k] for k in KINDS
                for what, d in (("seconds", self.seconds), ("count", self.counts))}
