"""Async scheduling: decode step n + 1 launched while step n's tokens are still on the device.

``sample_step`` samples a step and leaves the plain rows' tokens on the device (their copy to
the host started); ``SampledTokens.emitted`` reads them when the step is applied. Every step
goes through these two, chained or not.

Without it the host waits for step n's sampled tokens, applies them, and only then builds and
launches step n + 1, so on a GPU the device idles while the host works. When step n + 1 is
known before its tokens are (``can_chain``: every running request decodes one token and then
another, whatever the token), the engine launches it at once (``LLMEngine._chain``):
``chained_plan`` schedules each request one position further than its state says, its one
input the token step n sampled, copied on the device into the batch. Nothing is written into
the requests for this lookahead: the plan carries the positions (``ScheduledSeq.start``,
``chained``) and ``lookahead_rows`` the sampling rows, as if the token were already emitted.
Step n's results are then applied as usual, and step n + 1's by the next ``step`` call.

| object | holds |
| --- | --- |
| SampledTokens | a step's sampled tokens: plain rows' on the device, verified drafts' on the host |
| LaunchedStep | a step launched and not yet applied: plan, batch, hidden states, SampledTokens |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hybridrt.output_processor import Emitted
from hybridrt.sampler import Sampler, SamplingRow
from hybridrt.scheduler import ScheduledSeq, Scheduler, StepPlan
from hybridrt.specdec.verify import verify_requests
from hybridrt.statecache import HybridCacheManager

# the token a chained step's sampling rows see in place of the one still on the device: only
# its count matters (the rows of a chained step have no penalties, see ``can_chain``)
PLACEHOLDER_TOKEN = 0


@dataclass(slots=True)
class SampledTokens:
    """A step's sampled tokens: the plain rows' (``normal``: their sequence indices) as a
    device tensor being copied to the host, the verified drafts' already on the host."""

    num_seqs: int
    normal: list[int]
    tokens: torch.Tensor | None = None
    logprobs: list | None = None
    verified: list = field(default_factory=list)  # (sequence index, specdec.verify.Settled)
    _host: torch.Tensor | None = None
    _event: Any = None

    def start_copy(self) -> None:
        if self.tokens.device.type == "cuda":
            self._host = torch.empty(self.tokens.shape, dtype=self.tokens.dtype,
                                     pin_memory=True)
            self._host.copy_(self.tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def host_tokens(self) -> list[int]:
        if self._event is None:
            return self.tokens.tolist()
        self._event.synchronize()  # this copy only, not the work queued after it
        return self._host.tolist()

    def emitted(self) -> list[Emitted | None]:
        """Per scheduled sequence: the tokens it emits (None: mid-prompt chunk); waits for the
        copy to the host."""
        out: list[Emitted | None] = [None] * self.num_seqs
        if self.normal:
            toks = self.host_tokens()
            for n, b in enumerate(self.normal):
                lp = None if self.logprobs is None else [self.logprobs[n]]
                out[b] = Emitted([toks[n]], lp)
        for b, v in self.verified:
            out[b] = Emitted(v.token_ids, v.logprobs, v)
        return out


def sample_step(sampler: Sampler, plan: StepPlan, logits: torch.Tensor,
                rows: list[SamplingRow]) -> SampledTokens:
    """Sample every sequence's tokens; the plain rows' stay on the device (their copy to the
    host is started), drafts are verified at once. ``rows``: the sampling rows of the plain
    rows (sampling, not verifying), in the plan's order (a chained step's as if its input
    token were emitted: ``lookahead_rows``)."""
    normal, verify = [], []
    r = 0
    for b, s in enumerate(plan.seqs):
        if s.num_drafts:
            verify.append((b, r))
            r += s.num_new_tokens
        elif s.sample:
            normal.append((b, r))
            r += 1
    out = SampledTokens(len(plan.seqs), [b for b, _ in normal])
    if normal:
        sel = logits
        if len(normal) < logits.shape[0]:  # verify rows follow: pick the sampling rows
            sel = logits[torch.tensor([r for _, r in normal], device=logits.device)]
        res = sampler.sample(sel, rows)
        out.tokens, out.logprobs = res.token_ids, res.logprobs
        out.start_copy()
    if verify:
        entries = [(plan.seqs[b].request, plan.seqs[b].num_drafts, r0) for b, r0 in verify]
        out.verified = list(zip([b for b, _ in verify],
                                verify_requests(sampler, logits, entries)))
    return out


@dataclass(slots=True)
class LaunchedStep:
    plan: StepPlan
    batch: Any  # ForwardBatch
    hidden: torch.Tensor
    sampled: SampledTokens


def can_chain(plan: StepPlan, scheduler: Scheduler, max_model_len: int) -> bool:
    """Whether the step after ``plan`` is known before its tokens are: every running request
    decodes one token and then another, whatever the token (no waiting request, no drafts,
    sessions, logprobs, penalties or grammars, no request at its length limit)."""
    if scheduler.waiting or len(plan.seqs) != len(scheduler.running):
        return False
    for s in plan.seqs:
        r, p = s.request, s.request.params
        if (s.num_new_tokens != 1 or not s.sample or s.num_drafts or r.spec_k
                or r.session is not None or r.is_finished or p.logprobs is not None
                or r.grammar is not None
                or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0):
            return False
        if (p.max_tokens is not None and r.num_output_tokens + 1 >= p.max_tokens) or (
                len(r.token_ids) + 1 >= max_model_len):
            return False
    return True


def chained_plan(plan: StepPlan, cache: HybridCacheManager) -> StepPlan | None:
    """The decode step after ``plan`` (which ``can_chain`` allowed): each request one token
    at the position after the one ``plan`` computes, its KV blocks grown to cover it. None
    when some request's blocks cannot grow (the next step is then scheduled as usual)."""
    reqs = [s.request for s in plan.seqs]
    for r in reqs:
        if not cache.allocate_blocks(r.request_id, r.num_computed_tokens + 2):
            return None
    return StepPlan([ScheduledSeq(r, 1, True, 0, r.num_computed_tokens + 1, chained=True)
                     for r in reqs])


def lookahead_rows(plan: StepPlan) -> list[SamplingRow]:
    """A chained plan's sampling rows: each request as if its pending token were emitted."""
    return [s.request.sampling_row([PLACEHOLDER_TOKEN]) for s in plan.seqs]
