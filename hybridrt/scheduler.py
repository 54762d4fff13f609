"""One token budget per step, no prefill/decode phases (vLLM v1 style).

Each scheduled request advances ``num_computed_tokens`` towards ``len(token_ids)``: a decode
is 1 token, a prompt is as many as the budget allows (long prompts are chunked across steps).
Running requests go first, then waiting ones in arrival order. A request being admitted starts
from the longest prefix of its tokens the prefix cache holds (``HybridCacheManager.admit``),
and each scheduled chunk saves the GDN checkpoints that fall inside it
(``ScheduledSeq.checkpoints``), with the state slots left once every request the step runs has
its own. When KV blocks or state slots run out, cached blocks and
checkpoints nobody holds are evicted first (inside the cache manager), then idle sessions' pins
(least recently used first); then the newest running request is preempted: its blocks and state
slots are released (its state kept as a checkpoint where there is room) and it is recomputed
from its tokens later. A waiting request that does not fit even when nothing else holds any
cache can never run: it fails (``StepPlan.failed``) instead of waiting forever.

Admission control (``_room_for``), so that preemption makes progress: a preempted GDN request
loses all of its state (there is no prefix of it to keep), so a request admitted only to be
preempted a few steps later costs its whole recompute. While others run, a waiting request is
admitted only when the cache holds all the known tokens of the running requests and of it,
plus one block of growth each (not only this step's chunk), and not at all between a
preemption and the next finish (the workload behind this rule: docs/server.md).

A request with images also draws on the step's encoder budget (``encoder_budget`` image
tokens, hybridrt.vision.budget): its chunk stops before an image that does not fit, which
waits for a later step while the others decode.

| invariant | |
| --- | --- |
| waiting for grammar | holds no cache; joins waiting once compiled (fails if it does not) |
| running | holds KV blocks covering num_computed_tokens (+ this step's) and its state slots |
| waiting | holds no cache resources; num_computed_tokens == 0 |
| preempted | goes back to the front of waiting, oldest first; no admission until a finish |
| finished | released by ``finish`` after the step's drafts (its MTP KV is final then) |

A step is applied in one place, ``update`` (nano-vllm's ``postprocess``, vLLM's
``update_from_output``): the tokens into the requests (``OutputProcessor.update``: tokens,
``num_computed_tokens``, stops), the proposer's next drafts, the prefix cache's commit
(``HybridCacheManager.commit_step``), then the finished requests released (``finish``).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from hybridrt.async_chain import can_chain, chained_plan
from hybridrt.output_processor import OutputProcessor, StepUpdate
from hybridrt.request import Request, RequestStatus
from hybridrt.session_manager import SessionManager
from hybridrt.specdec.stats import SpecStats
from hybridrt.statecache import CacheCapacityError, HybridCacheManager
from hybridrt.statecache.branch_points import BranchPoints
from hybridrt.step_plan import ScheduledSeq, StepPlan
from hybridrt.vision.budget import EncoderBudget

if TYPE_CHECKING:
    from hybridrt.engine_args import EngineArgs
    from hybridrt.sampled_tokens import LaunchedStep
    from hybridrt.specdec.mtp import MTPProposer
    from hybridrt.structured_outputs import PendingGrammar


class Scheduler:
    """Owns the request queues (waiting for a grammar, waiting, running) and applies each step
    (``update``); counts what it did in ``stats`` and the finished requests' ``spec_stats``."""

    def __init__(self, cache: HybridCacheManager, args: EngineArgs,
                 output_processor: OutputProcessor, sessions: SessionManager | None = None):
        self.cache = cache
        self.max_num_seqs = args.max_num_seqs
        self.max_num_batched_tokens = args.max_num_batched_tokens
        self.max_model_len = args.max_model_len
        self.output_processor = output_processor
        self.sessions = sessions  # None: no sessions
        self.waiting_for_grammar: list[tuple[Request, PendingGrammar]] = []
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.under_pressure = False  # a preemption since the last finish: admit nothing
        # False: admit whatever this step's chunk fits (the earlier rule, and vLLM's);
        # tests of the preemption path set it to make preemptions happen
        self.admission_control = True
        # image tokens one step may encode (hybridrt.vision.budget), vLLM's default for its
        # max_num_encoder_input_tokens
        self.encoder_budget = args.max_num_batched_tokens
        self.stats = {"num_steps": 0, "num_preemptions": 0, "num_prefill_tokens": 0,
                      "num_decode_tokens": 0, "num_session_evictions": 0,
                      "num_chained_steps": 0, "num_cached_tokens": 0}
        self.spec_stats = SpecStats(args.speculative_tokens)  # of the finished requests
        # where the held prompts share a prefix: checkpoints there (None: caching off)
        self.branch_points = BranchPoints() if cache.prefix_caching else None

    def add(self, request: Request, grammar: PendingGrammar | None = None) -> None:
        """Queue a request; with ``grammar`` (its constraint compiling) it waits for that
        first (``WAITING_FOR_GRAMMAR``), and ``schedule`` moves it on once compiled."""
        if self.branch_points is not None:
            self.branch_points.add(request)
        if grammar is not None:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append((request, grammar))
            return
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_grammar)

    def schedule(self) -> StepPlan:
        """The next step: requests whose grammar compiled join the waiting queue, running
        requests go first, then waiting ones in arrival order (the module docstring)."""
        plan = StepPlan()
        self._admit_compiled(plan)
        self._schedule(plan)
        self._reserve_checkpoints(plan)
        if self.sessions is not None:
            self.stats["num_session_evictions"] = self.sessions.num_evictions
        return plan

    def _schedule(self, plan: StepPlan) -> None:
        budget = self.max_num_batched_tokens
        encoder = EncoderBudget(self.encoder_budget)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            pending = len(req.token_ids) - req.num_computed_tokens
            drafts = len(req.draft_token_ids) if pending == 1 else 0
            n = min(pending + drafts, budget)
            if req.vision is not None and not (n := encoder.fit(req, n)):
                i += 1  # its next image waits for a step with encoder budget left
                continue
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
            return
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self._prefix_in_flight(req):
                break
            n = self._admit(req, budget)
            if n is None:
                if not self.running:  # nothing else holds any cache: it never fits
                    self._fail(req, len(req.token_ids) + req.spec_k, plan)
                    continue
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.vision is not None and not (n := encoder.fit(req, n)):
                continue  # admitted; its next image waits for encoder budget
            plan.seqs.append(self._scheduled(req, n, 0))
            budget -= n

    def schedule_chained(self, plan: StepPlan) -> StepPlan | None:
        """With async scheduling: the decode step after ``plan``, to launch before ``plan``'s
        tokens are read (``hybridrt.async_chain``) -> it, or None when it is not known yet."""
        if not can_chain(plan, self, self.max_model_len):
            return None
        chained = chained_plan(plan, self.cache)
        if chained is not None:
            self.stats["num_chained_steps"] += 1
        return chained

    def update(self, launched: LaunchedStep, proposer: MTPProposer | None = None,
               keep_running: Collection[Request] = (),
               clock: Callable[[], float] = time.perf_counter) -> StepUpdate:
        """Apply a launched step, the one place a step's results land: its tokens into its
        requests (``OutputProcessor.update``; waits for them to reach the host), the
        proposer's next drafts, the prefix cache's commit (``HybridCacheManager.commit_step``,
        after the drafts: the MTP layer's KV of the step's positions is written then), and
        the requests that finished released (their state not kept where ``keep_running``, the
        chained step launched after this one, still writes it). ``StepUpdate.applied_at`` /
        ``drafted_at``: ``clock()`` when the tokens were in / the drafts were picked."""
        plan = launched.plan
        up = self.output_processor.update(plan, launched.sampled.emitted(), time.perf_counter())
        up.applied_at = clock()
        self.stats["num_prefill_tokens"] += up.num_prompt_tokens
        self.stats["num_decode_tokens"] += up.num_output_tokens
        if proposer is not None and any(s.request.spec_k for s in plan.seqs):
            self.output_processor.apply_drafts(proposer.propose(
                plan, launched.batch.query_starts, launched.hidden, up.settled))
            up.drafted_at = clock()
        kept = self.cache.commit_step(plan.seqs, launched.batch.query_starts, launched.hidden,
                                      up.settled)
        for s, hidden in zip(plan.seqs, kept):
            s.request.mtp_carry = None  # a cache hit's carry: spent by the first drafts
            if hidden is not None:
                s.request.last_hidden = hidden
        for req in up.finished:
            self.finish(req, keep_state=req not in keep_running)
        self.stats["num_steps"] += 1
        return up

    def spoil(self, plan: StepPlan) -> None:
        """A step failed midway: what it was writing is not kept by the prefix cache (its
        requests' states, the checkpoints it reserved)."""
        for s in plan.seqs:
            s.request.cache_dirty = True
            for ck in s.checkpoints:
                self.cache.drop_pending(ck)
            s.checkpoints = []

    def _admit_compiled(self, plan: StepPlan) -> None:
        """Requests whose grammar is compiled join the waiting queue, each with its matcher;
        those whose grammar failed or timed out finish with the error (``plan.failed``). When
        nothing else is queued, waits up to 50 ms for a compile, rather than spin."""
        if not self.waiting_for_grammar:
            return
        if not (self.waiting or self.running):
            concurrent.futures.wait([g.future for _, g in self.waiting_for_grammar],
                                    timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
        now, still = time.perf_counter(), []
        for req, grammar in self.waiting_for_grammar:
            try:
                req.grammar = grammar.matcher(req.eos_token_ids,
                                              now - req.metrics.arrival_time)
            except ValueError as e:
                req.error = e
                self.finish(req, "error")
                plan.failed.append(req)
                continue
            if req.grammar is None:
                still.append((req, grammar))
            else:
                req.status = RequestStatus.WAITING
                self.waiting.append(req)
        self.waiting_for_grammar = still

    def _reserve_checkpoints(self, plan: StepPlan) -> None:
        """Slots for the checkpoints that fall inside the step's chunks, once every request
        the step runs has its own: a checkpoint takes what is left. (Reserved at each
        admission, one admission's pending checkpoint would hold the slot the next waiting
        request needs, and a burst of requests would be admitted half at a time.)"""
        if not self.cache.prefix_caching:
            return
        for seq in plan.seqs:
            req, c = seq.request, seq.start
            for p in req.checkpoint_at or ():
                if c < p <= c + seq.num_new_tokens - seq.num_drafts:
                    pending = self.cache.reserve_checkpoint(req.token_ids, req.block_hashes, p)
                    if pending is not None:
                        seq.checkpoints.append(pending)

    def finish(self, request: Request, reason: str | None = None,
               keep_state: bool = True) -> None:
        """Release a running or waiting request (finished, aborted or failed): its final full
        blocks stay cached and, with ``keep_state``, its GDN state becomes a checkpoint (a
        session pins both); the rest is freed. ``reason``: the finish reason, unless the update
        step has set it (stop, length)."""
        if reason is not None:
            request.finish_reason = reason
        self._release(request, keep_state, finished=True)
        if self.branch_points is not None:
            self.branch_points.remove(request)
        if request.session is not None:
            self.sessions.release(request)
            request.session = None
        if request.status is RequestStatus.WAITING_FOR_GRAMMAR:
            self.waiting_for_grammar = [(r, g) for r, g in self.waiting_for_grammar
                                        if r is not request]
        elif request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self.stats["num_cached_tokens"] += request.metrics.num_cached_tokens
        if request.spec_stats is not None:
            self.spec_stats.merge(request.spec_stats)
        self.under_pressure = False
        request.reset_speculation()
        request.metrics.finished_time = time.perf_counter()

    def _release(self, req: Request, keep_state: bool, finished: bool = False) -> None:
        """The request's cache back to the manager; what stays cached of a finished session
        request is pinned by its session."""
        # MTP rows still waiting (specdec.mtp's lazy rows): blocks indexed up to them, no state
        keep = (keep_state and not req.cache_dirty and self.cache.prefix_caching
                and req.mtp_pending is None)
        session = req.session if finished and keep else None
        self.cache.release(req.request_id, req.token_ids, req.block_hashes,
                           0 if req.cache_dirty else req.mtp_written,
                           req.slot_cursor if keep else None, req.last_hidden)
        if session is not None:
            self.sessions.keep(req)

    def _admit(self, req: Request, budget: int) -> int | None:
        """State slots and KV blocks for a waiting request, from the longest cached prefix of
        its tokens (idle sessions' pins given up while that helps) -> the tokens it computes
        this step, or None when it does not fit beside the running ones."""
        if not self._room_for(req):
            return None

        def cover(hit: int) -> int:
            return hit + min(len(req.token_ids) - hit, budget) + req.spec_k

        while True:
            got = self.cache.admit(req.request_id, req.token_ids, req.block_hashes,
                                   1 + req.spec_k, cover)
            if got is not None:
                break
            if not self._evict_idle_session():
                return None
        req.num_computed_tokens = got.num_tokens
        if self.branch_points is not None:
            self.branch_points.admitted(req, self.cache.prefix, got.num_tokens)
        if got.num_tokens:
            self.cache.touch_checkpoints(req.token_ids, req.block_hashes,
                                         [p for p in req.checkpoint_at if p < got.num_tokens])
        req.mtp_carry = got.hidden if req.spec_k else None
        req.cache_dirty = False
        req.metrics.num_cached_tokens = got.num_tokens
        if req.session is not None:
            self.sessions.admitted(req)
        return min(len(req.token_ids) - got.num_tokens, budget)

    def _prefix_in_flight(self, req: Request) -> bool:
        """Whether a running request is prefilling a prefix of ``req``'s tokens and will save a
        checkpoint past what the cache gives ``req`` now (by a block or more): then ``req``
        waits and resumes from it, rather than compute the same tokens beside it (requests
        that share a system prompt arriving together, the choices of an n > 1 request)."""
        if req.block_hashes is None or req.num_computed_tokens:
            return False
        prefilling = [r for r in self.running
                      if r.num_computed_tokens < r.num_prompt_tokens and r.checkpoint_at]
        if not prefilling:
            return False
        hit = self.cache.peek(req.token_ids, req.block_hashes)
        have = hit.num_tokens if hit is not None else 0
        tokens = req.token_ids
        for r in prefilling:
            if r.block_hashes.lookahead != req.block_hashes.lookahead:
                continue  # they cannot share blocks
            common = _common_prefix(tokens, r.token_ids, len(tokens) - 1)
            if any(r.num_computed_tokens < p <= common and p >= have + self.cache.block_size
                   for p in r.checkpoint_at):
                return True
        return False

    def _room_for(self, req: Request) -> bool:
        """Whether ``req`` may be admitted beside the running requests: the cache (idle
        sessions' pins given up while that helps) holds all their known tokens and its, with a
        block of growth each; never between a preemption and the next finish. With nothing
        running it may always try (a request too large for the cache fails then)."""
        if not (self.running and self.admission_control):
            return True
        if self.under_pressure:
            return False
        grow = self.cache.block_size
        while True:
            short = sum(self.cache.blocks_needed(r.request_id,
                                                 len(r.token_ids) + r.spec_k + grow)
                        for r in self.running)
            short += self.cache.blocks_to_admit(req.token_ids, req.block_hashes,
                                                len(req.token_ids) + req.spec_k + grow)
            if short <= self.cache.usage().num_free_blocks:
                return True
            if not self._evict_idle_session():
                return False

    def _evict_idle_session(self) -> bool:
        return self.sessions is not None and self.sessions.evict_idle()

    def _fail(self, req: Request, need: int, plan: StepPlan) -> None:
        s = self.cache.sizing
        req.error = CacheCapacityError(
            f"request {req.request_id} can never be scheduled: it needs "
            f"{-(-need // s.block_size)} KV blocks and {1 + req.spec_k} state slots, and the "
            f"cache has {s.num_blocks} blocks and {s.num_request_slots + s.num_checkpoint_slots} "
            f"slots in all"
        )
        self.waiting.popleft()
        self.finish(req, "error")
        plan.failed.append(req)

    def _scheduled(self, req: Request, n: int, num_drafts: int) -> ScheduledSeq:
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.perf_counter()
        sample = req.num_computed_tokens + n - num_drafts == len(req.token_ids)
        return ScheduledSeq(req, n, sample, num_drafts, req.num_computed_tokens)

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self._release(req, keep_state=True)
        self.running.remove(req)
        req.num_computed_tokens = 0
        req.mtp_carry = None
        req.reset_speculation()
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.under_pressure = True
        self.stats["num_preemptions"] += 1
        self.waiting.appendleft(req)
        plan.preempted.append(req)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
