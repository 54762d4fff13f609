"""Acceptance statistics for speculative decoding.

mean acceptance length = 1 + accepted / rounds (the bonus or correction token included);
per-position acceptance rate i = drafts accepted at position i / rounds. Drafts and accepted
drafts are also counted by source (``SOURCES``: prompt lookup, the MTP layer), and every
drafting decision's k (``k_chosen``: how many steps asked for 0, 1, .. drafts; with adaptive
speculation k moves between 0 and the request's maximum).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .adaptive import Acceptance

SOURCES = ("ngram", "mtp")


@dataclass(slots=True)
class SpecStats:
    k: int
    num_rounds: int = 0  # verify steps
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafts_by_source: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    accepted_by_source: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(SOURCES, 0))
    k_chosen: list[int] = field(default_factory=list)  # [j]: drafting decisions of k = j
    pending_ngram: int = 0  # the pending drafts' leading prompt-lookup ones
    acceptance: Acceptance = field(default_factory=Acceptance)  # adaptive k reads it

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.k
        if not self.k_chosen:
            self.k_chosen = [0] * (self.k + 1)

    def proposed(self, k: int, num_ngram: int) -> None:
        """A drafting decision: ``k`` drafts asked for, the first ``num_ngram`` of those
        proposed from prompt lookup (the rest from the MTP)."""
        self.k_chosen[k] += 1
        self.pending_ngram = num_ngram
        if k == 0:
            self.acceptance.idle()

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_rounds += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        ngram = min(self.pending_ngram, num_drafts)
        self.drafts_by_source["ngram"] += ngram
        self.drafts_by_source["mtp"] += num_drafts - ngram
        self.accepted_by_source["ngram"] += min(ngram, num_accepted)
        self.accepted_by_source["mtp"] += num_accepted - min(ngram, num_accepted)
        self.pending_ngram = 0
        for i in range(min(num_accepted + 1, num_drafts)):  # the drafts tried
            self.acceptance.observe("ngram" if i < ngram else "mtp", i < num_accepted)

    def merge(self, other: SpecStats) -> None:
        if other.k > self.k:
            self.accepted_per_position += [0] * (other.k - self.k)
            self.k = other.k
        self.num_rounds += other.num_rounds
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted += other.num_accepted
        for i, a in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += a
        for src in SOURCES:
            self.drafts_by_source[src] += other.drafts_by_source[src]
            self.accepted_by_source[src] += other.accepted_by_source[src]
        self.k_chosen += [0] * (len(other.k_chosen) - len(self.k_chosen))
        for j, n in enumerate(other.k_chosen):
            self.k_chosen[j] += n

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted / self.num_rounds if self.num_rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_k_chosen(self) -> float:
        """The mean k of the drafting decisions (0.0 when there was none)."""
        n = sum(self.k_chosen)
        return sum(j * c for j, c in enumerate(self.k_chosen)) / n if n else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        n = self.num_rounds
        return [a / n if n else 0.0 for a in self.accepted_per_position]

    def counters(self) -> dict[str, int]:
        """The /metrics counters (hybridrt.server.metrics reads them by these names)."""
        out = {"spec_draft_tokens": self.num_draft_tokens,
               "spec_accepted_tokens": self.num_accepted,
               "spec_k_chosen": sum(j * c for j, c in enumerate(self.k_chosen)),
               "spec_drafting_decisions": sum(self.k_chosen)}
        for src in SOURCES:
            out[f"spec_{src}_draft_tokens"] = self.drafts_by_source[src]
            out[f"spec_{src}_accepted_tokens"] = self.accepted_by_source[src]
        return out

    def as_dict(self) -> dict:
        return {
            "k": self.k,
            "num_rounds": self.num_rounds,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted": self.num_accepted,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance,
            "drafts_by_source": dict(self.drafts_by_source),
            "accepted_by_source": dict(self.accepted_by_source),
            "k_chosen": list(self.k_chosen),
            "mean_k_chosen": self.mean_k_chosen,
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
