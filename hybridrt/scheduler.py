"""One token budget per step, no prefill/decode phases (vLLM v1 style).

Each scheduled request advances ``num_computed_tokens`` towards ``len(token_ids)``: a decode
is 1 token, a prompt is as many as the budget allows (long prompts are chunked across steps).
Running requests go first, then waiting ones in arrival order. When KV blocks or state slots
run out, idle sessions' caches are evicted first (least recently used first); then the newest
running request is preempted: its blocks and state slots are freed and it is recomputed from its
tokens later. A waiting request that does not fit even when nothing else holds any cache can
never run: it fails (``StepPlan.failed``) instead of waiting forever.

Admission control (``_room_for``), so that preemption makes progress: a preempted GDN request
loses all of its state (there is no prefix of it to keep), so a request admitted only to be
preempted a few steps later costs its whole recompute. While others run, a waiting request is
admitted only when the cache holds all the known tokens of the running requests and of it,
plus one block of growth each (not only this step's chunk), and not at all between a
preemption and the next finish (the workload behind this rule: docs/server.md).

| invariant | |
| --- | --- |
| running | holds KV blocks covering num_computed_tokens (+ this step's) and its state slots |
| waiting | holds no cache resources; num_computed_tokens == 0 |
| preempted | goes back to the front of waiting, oldest first; no admission until a finish |
| session request | takes over its session's cache when admitted (``SessionManager.attach``) |

Request progress has two writers: the scheduler (admission, preemption, finish: status,
``num_computed_tokens`` reset or reused, speculation reset, finish reason) and the update step
(``OutputProcessor.update``: tokens, ``num_computed_tokens``, drafts, stop).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from hybridrt.request import Request, RequestStatus
from hybridrt.session_manager import SessionManager
from hybridrt.statecache import CacheCapacityError, HybridCacheManager


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


@dataclass(slots=True)
class StepPlan:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # can never be scheduled (req.error)


class Scheduler:
    def __init__(self, cache: HybridCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, sessions: SessionManager | None = None):
        if max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {max_num_batched_tokens}"
            )
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.sessions = sessions  # None: no sessions
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.under_pressure = False  # a preemption since the last finish: admit nothing
        # False: admit whatever this step's chunk fits (the earlier rule, and vLLM's);
        # tests of the preemption path set it to make preemptions happen
        self.admission_control = True

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            pending = len(req.token_ids) - req.num_computed_tokens
            drafts = len(req.draft_token_ids) if pending == 1 else 0
            n = self._stop_at_snapshot(req, min(pending + drafts, budget))
            # KV for this step, plus room for the MTP layer to write its next drafts.
            need = req.num_computed_tokens + n + req.spec_k
            while not self.cache.allocate_blocks(req.request_id, need):
                if self._evict_idle_session():
                    continue
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is req:
                    break
            else:
                plan.seqs.append(self._scheduled(req, n, max(0, n - pending)))
                budget -= n
                i += 1

        if plan.preempted:
            return plan
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.session is not None and not req.session_attached:
                self._attach(req)
            n = self._stop_at_snapshot(req, min(len(req.token_ids) - req.num_computed_tokens,
                                                budget))
            need = req.num_computed_tokens + n + req.spec_k
            if not (self._room_for(req) and self._allocate(req, need)):
                if req.session_attached and req.num_computed_tokens:
                    self._detach(req)  # the session keeps its cache meanwhile
                else:
                    self.cache.free(req.request_id)
                    req.num_computed_tokens = 0
                if not self.running:  # nothing else holds any cache: it never fits
                    self._fail(req, need, plan)
                    continue
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan.seqs.append(self._scheduled(req, n, 0))
            budget -= n
        return plan

    def finish(self, request: Request, reason: str | None = None) -> None:
        """Release a running or waiting request (finished, aborted or failed): a session
        request's cache goes back to its session, the rest is freed. ``reason``: the finish
        reason, unless the update step has set it (stop, length)."""
        if reason is not None:
            request.finish_reason = reason
        if request.session is not None:
            self.sessions.release(request)
            request.session = None
        self.cache.free(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self.under_pressure = False
        request.reset_speculation()
        request.metrics.finished_time = time.perf_counter()

    def _attach(self, req: Request) -> None:
        """A session request being admitted takes over its session's cache."""
        got = self.sessions.attach(req)
        req.num_computed_tokens, req.slot_cursor = got.num_computed_tokens, got.slot_cursor
        req.pending_snapshot_at = got.pending_snapshot_at
        req.session_attached = True
        req.metrics.session_cache_evicted = got.cache_evicted
        req.metrics.num_reused_prompt_tokens = got.num_computed_tokens

    def _detach(self, req: Request) -> None:
        """Undo ``_attach``: the request waits holding nothing."""
        self.sessions.detach(req)
        req.num_computed_tokens, req.slot_cursor, req.session_attached = 0, 0, False
        req.metrics.num_reused_prompt_tokens = 0

    def _allocate(self, req: Request, num_tokens: int) -> bool:
        """State slots and KV blocks for ``num_tokens`` tokens of a request being admitted,
        evicting idle sessions' caches while that helps -> whether it got them."""
        while not (self.cache.allocate_state(req.request_id, 1 + req.spec_k)
                   and self.cache.allocate_blocks(req.request_id, num_tokens)):
            if not self._evict_idle_session():
                return False
        return True

    def _room_for(self, req: Request) -> bool:
        """Whether ``req`` may be admitted beside the running requests: the cache (idle
        sessions' evicted while that helps) holds all their known tokens and its, with a
        block of growth each; never between a preemption and the next finish. With nothing
        running it may always try (a request too large for the cache fails then)."""
        if not (self.running and self.admission_control):
            return True
        if self.under_pressure:
            return False
        grow = self.cache.block_size
        short = sum(self.cache.blocks_needed(r.request_id, len(r.token_ids) + r.spec_k + grow)
                    for r in (*self.running, req))
        while short > self.cache.usage().num_free_blocks:
            if not self._evict_idle_session():
                return False
        return True

    def _evict_idle_session(self) -> bool:
        return self.sessions is not None and self.sessions.evict_idle()

    def _fail(self, req: Request, need: int, plan: StepPlan) -> None:
        s = self.cache.sizing
        req.error = CacheCapacityError(
            f"request {req.request_id} can never be scheduled: it needs "
            f"{-(-need // s.block_size)} KV blocks and {1 + req.spec_k} state slots, and the "
            f"cache has {s.num_blocks} blocks and {s.num_slots - 1 - s.num_snapshot_slots} "
            f"request slots in all"
        )
        self.waiting.popleft()
        plan.failed.append(req)

    @staticmethod
    def _stop_at_snapshot(req: Request, n: int) -> int:
        """A session request's prefill stops where its GDN state is to be saved."""
        at = req.pending_snapshot_at
        if at is not None and req.num_computed_tokens < at:
            return min(n, at - req.num_computed_tokens)
        return n

    def _scheduled(self, req: Request, n: int, num_drafts: int) -> ScheduledSeq:
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.perf_counter()
        sample = req.num_computed_tokens + n - num_drafts == len(req.token_ids)
        return ScheduledSeq(req, n, sample, num_drafts, req.num_computed_tokens)

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.cache.free(req.request_id)
        self.running.remove(req)
        req.num_computed_tokens = 0
        req.reset_speculation()
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.under_pressure = True
        self.waiting.appendleft(req)
        plan.preempted.append(req)
