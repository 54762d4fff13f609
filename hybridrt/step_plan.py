"""What the scheduler hands the runner for one step: which requests run, how many tokens each.

| object | holds |
| --- | --- |
| ScheduledSeq | one request's part of a step: tokens fed, drafts verified, checkpoints written |
| StepPlan | the step's sequences, and the requests it preempted or failed |
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridrt.request import Request
from hybridrt.statecache.manager import PendingCheckpoint


@dataclass(slots=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # tokens fed this step, drafts included
    sample: bool  # this step reaches the end of the known tokens: a new token is sampled
    num_drafts: int = 0  # > 0: verify this many of the request's drafts
    start: int = 0  # the first position fed (num_computed_tokens before the step)
    # a chained step's (hybridrt.async_chain): its one input is the previous step's sampled
    # token, still on the device, at the position after the request's known tokens
    chained: bool = False
    # prefix-cache checkpoints this step writes: the GDN state after ``num_tokens`` tokens
    checkpoints: list[PendingCheckpoint] = field(default_factory=list)


@dataclass(slots=True)
class StepPlan:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # finished with req.error: can never be scheduled, or its grammar did not compile
    failed: list[Request] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """prefill (any prompt token), verify (any drafts) or decode: see specdec.StepCosts."""
        if any(s.start < s.request.num_prompt_tokens for s in self.seqs):
            return "prefill"
        return "verify" if any(s.num_drafts for s in self.seqs) else "decode"
