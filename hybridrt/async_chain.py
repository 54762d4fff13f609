"""Async scheduling: decode step n + 1 launched while step n's tokens are still on the device.

Without it the host waits for step n's sampled tokens, applies them, and only then builds and
launches step n + 1, so on a GPU the device idles while the host works. When step n + 1 is
known before its tokens are (``can_chain``: every running request decodes one token and then
another, whatever the token), the engine launches it at once (``Scheduler.schedule_chained``,
then ``ModelRunner.execute``): ``chained_plan`` schedules each request one position further
than its state says, its one input the token step n sampled, copied on the device into the
batch. Nothing is written into
the requests for this lookahead: the plan carries the positions (``ScheduledSeq.start``,
``chained``) and ``lookahead_rows`` the sampling rows, as if the token were already emitted.
Step n's results are then applied as usual, and step n + 1's by the next ``step`` call
(its tokens, ``hybridrt.sampled_tokens.SampledTokens``, stay on the device until then).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridrt.sampler import SamplingRow
from hybridrt.statecache import HybridCacheManager
from hybridrt.step_plan import ScheduledSeq, StepPlan

if TYPE_CHECKING:
    from hybridrt.scheduler import Scheduler

# the token a chained step's sampling rows see in place of the one still on the device: only
# its count matters (the rows of a chained step have no penalties, see ``can_chain``)
PLACEHOLDER_TOKEN = 0


def can_chain(plan: StepPlan, scheduler: Scheduler, max_model_len: int) -> bool:
    """Whether the step after ``plan`` is known before its tokens are: every running request
    decodes one token and then another, whatever the token (no request waiting, for the cache
    or for its grammar; no drafts, sessions, logprobs, penalties or grammars, no request at its
    length limit)."""
    if (scheduler.waiting or scheduler.waiting_for_grammar
            or len(plan.seqs) != len(scheduler.running)):
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
