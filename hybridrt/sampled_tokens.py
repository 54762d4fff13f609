"""What the runner's step returns: its sampled tokens, left on the device until read.

``sample_step`` samples a step and leaves the plain rows' tokens on the device (their copy to
the host started); ``SampledTokens.emitted`` reads them when the step is applied. Every step
goes through these two, chained (``hybridrt.async_chain``) or not.

| object | holds |
| --- | --- |
| Emitted | what one scheduled sequence emits in a step: tokens, logprobs, verification |
| SampledTokens | a step's sampled tokens: plain rows' on the device, verified drafts' on the host |
| LaunchedStep | a step launched and not yet applied: plan, batch, hidden states, SampledTokens |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hybridrt.sampler import Sampler, SamplingRow
from hybridrt.specdec.verify import Settled, verify_requests
from hybridrt.step_plan import StepPlan


@dataclass(slots=True)
class Emitted:
    """What one scheduled sequence emits in a step."""

    token_ids: list[int]
    logprobs: list | None  # RowLogprobs per token, when asked for
    verified: Settled | None = None  # what verifying its drafts settled (verify steps only)


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
    token were emitted: ``async_chain.lookahead_rows``)."""
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
