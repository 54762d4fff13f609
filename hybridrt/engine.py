"""The engine: ``step()`` = schedule -> prepare -> run -> sample -> update."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridrt.config import ModelConfig
from hybridrt.model import Qwen35ForCausalLM
from hybridrt.output_processor import OutputProcessor
from hybridrt.request import Request
from hybridrt.runner import ModelRunner
from hybridrt.sampler import Sampler, make_generator
from hybridrt.sampling_params import SamplingParams
from hybridrt.scheduler import ScheduledSeq, Scheduler, StepPlan
from hybridrt.session import Session, common_prefix
from hybridrt.specdec.mtp import MTPProposer
from hybridrt.specdec.stats import SpecStats, StepCosts
from hybridrt.specdec.verify import settle_verified, verify_requests
from hybridrt.statecache import HybridCacheManager


@dataclass(slots=True)
class Emitted:
    token_ids: list[int]
    logprobs: list | None  # RowLogprobs per token, when asked for
    num_accepted: int | None  # drafts accepted (verify steps only)


@dataclass(slots=True)
class _Sampled:
    """A step's sampled tokens: the plain rows' (``normal``: their sequence indices) as a
    device tensor being copied to the host, the verified drafts' already on the host."""

    num_seqs: int
    normal: list[int]
    tokens: torch.Tensor | None = None
    logprobs: list | None = None
    verified: list = field(default_factory=list)
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


@dataclass(slots=True)
class _Launched:
    plan: StepPlan
    batch: Any
    hidden: torch.Tensor
    sampled: _Sampled


@dataclass(slots=True)
class EngineConfig:
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")


class LLMEngine:
    def __init__(self, model: Qwen35ForCausalLM, config: ModelConfig, cache: HybridCacheManager,
                 engine_config: EngineConfig, tokenizer: Any = None, seed: int | None = 0,
                 device: torch.device | str = "cpu", speculative_tokens: int = 0,
                 backend: str | None = None, draft_vocab: list[int] | None = None,
                 thread_governor=None, async_scheduling: bool | None = None):
        self.model = model
        self.config = config
        self.cache = cache
        self.engine_config = engine_config
        self.tokenizer = tokenizer
        self.output = OutputProcessor(tokenizer, engine_config.max_model_len)
        self.runner = ModelRunner(model, cache, device, backend, engine_config.max_num_seqs,
                                  engine_config.max_num_batched_tokens,
                                  engine_config.max_model_len)
        self.scheduler = Scheduler(cache, engine_config.max_num_seqs,
                                   engine_config.max_num_batched_tokens, sessions=self)
        self.sampler = Sampler(seed=seed)  # shared generator for requests without a seed
        self.speculative_tokens = speculative_tokens
        self.governor = thread_governor  # hybridrt/threads.py: CPU threads fitted each step
        self.proposer = None
        if speculative_tokens > 0:
            self.proposer = MTPProposer(model, cache, self.sampler, engine_config.max_model_len,
                                        device, draft_vocab=draft_vocab)
        self.spec_stats = SpecStats(speculative_tokens)
        self.requests: dict[str, Request] = {}
        self.sessions: dict[str, Session] = {}  # open sessions, least recently used first
        self._ids = itertools.count()
        self.stats = {"num_steps": 0, "num_preemptions": 0, "num_prefill_tokens": 0,
                      "num_decode_tokens": 0, "num_session_evictions": 0,
                      "num_chained_steps": 0}
        # decode steps launched before the previous step's tokens are read (GPU: the host
        # prepares step n+1 while the device runs step n); default: on for CUDA
        self.async_scheduling = (torch.device(device).type == "cuda" if async_scheduling is None
                                 else bool(async_scheduling))
        self._inflight: _Launched | None = None
        self.step_costs = StepCosts()  # seconds in prefill, decode, verify steps and drafting

    # Requests ------------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of ints")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(
                f"prompt has token ids outside [0, {self.config.vocab_size}): {bad[:5]}"
            )
        limit = self.engine_config.max_model_len
        if len(ids) >= limit:
            raise ValueError(
                f"prompt has {len(ids)} tokens but max_model_len is {limit}: it must be "
                f"shorter than max_model_len to leave room for at least one generated token"
            )
        return ids

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                    prompt: str | None = None, request_id: str | None = None,
                    speculative_tokens: int | None = None, session: Session | None = None,
                    snapshot_at: int | None = None) -> str:
        """Validate and queue a request -> its id. Raises ValueError for bad input; nothing
        is queued then. ``speculative_tokens``: drafts per step for this request (default:
        the engine's; 0 turns speculation off for it). ``session``: continue a conversation,
        reusing its cached prefix (see hybridrt.session). ``snapshot_at``: with a session,
        the prompt length at which to save the GDN state for a later divergence (default: just
        before the last prompt token; a chat passes where its generation prompt starts, the
        point where a history-rewriting template makes the next turn diverge)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        k = self.speculative_tokens if speculative_tokens is None else speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= self.speculative_tokens:
            raise ValueError(
                f"speculative_tokens must be an integer in [0, {self.speculative_tokens}] (the "
                f"engine's speculative_tokens), got {speculative_tokens!r}"
            )
        ids = self.validate_prompt(prompt_token_ids)
        if snapshot_at is not None and (
            session is None or not isinstance(snapshot_at, int) or snapshot_at < 1
        ):
            raise ValueError(f"snapshot_at must be a positive int and needs a session, got "
                             f"{snapshot_at!r}")
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if session is not None and session.closed:
            raise ValueError("session is closed")
        if session is not None and session.busy:
            raise ValueError("session already has a running request")
        req = Request(rid, prompt, ids, params, self._stop_ids(params), spec_k=k)
        req.generator = make_generator(params)
        if session is not None:
            req.session, req.session_snapshot_at = session, snapshot_at
            session.busy = True
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    # Sessions ------------------------------------------------------------------------------
    def open_session(self) -> Session:
        """A conversation whose cache outlives its requests (see hybridrt.session)."""
        slot = self.cache.take_snapshot_slot()
        if slot is None:
            raise RuntimeError(f"all {self.cache.sizing.num_snapshot_slots} session slots are in "
                               f"use: close a session or raise max_num_sessions")
        session = Session(f"s{next(self._ids)}", slot)
        self.sessions[session.session_id] = session
        return session

    def close_session(self, session: Session) -> None:
        if session.closed:
            return
        if session.busy:
            raise ValueError("close_session: the session has a running request")
        self.cache.free(session.cache_key)
        self.cache.release_snapshot_slot(session.snapshot_slot)
        del self.sessions[session.session_id]
        session.closed = True

    def reset_session(self, session: Session) -> None:
        """Forget the cached conversation (``/clear``); the session stays usable."""
        if session.busy:
            raise ValueError("reset_session: the session has a running request")
        self.cache.free(session.cache_key)
        session.token_ids, session.slot_cursor, session.snapshot_len = [], 0, None

    def attach_session(self, req: Request) -> None:
        """Give a session request, as it is admitted, the session's cache for the longest
        reusable prompt prefix (the scheduler calls this)."""
        session, snapshot_at = req.session, req.session_snapshot_at
        cache, key = self.cache, session.cache_key
        ids = req.prompt_token_ids
        reuse = self.reusable_tokens(session, ids, req.spec_k)
        if 0 < reuse < len(session.token_ids):  # the GDN state at the snapshot
            cache.copy_state(session.snapshot_slot, cache.state_slot(key, session.slot_cursor))
        if reuse == 0:
            cache.free(key)
            session.slot_cursor, session.snapshot_len = 0, None
        else:
            cache.truncate(key, reuse)
            if session.snapshot_len is not None and session.snapshot_len > reuse:
                session.snapshot_len = None
        cache.transfer(key, req.request_id)
        req.num_computed_tokens = reuse
        req.slot_cursor = session.slot_cursor if reuse else 0
        req.session = session
        at = len(ids) - 1 if snapshot_at is None else min(snapshot_at, len(ids) - 1)
        req.snapshot_at = at if at > reuse else None
        req.session_attached = True
        req.metrics.session_cache_evicted, session.evicted = session.evicted, False
        session.last_reused_tokens = req.metrics.num_reused_prompt_tokens = reuse

    def reusable_tokens(self, session: Session, prompt_token_ids: list[int],
                        spec_k: int = 0) -> int:
        """How many leading prompt tokens a request on ``session`` would take from its cache
        now: the common prefix with the session's tokens (at most all but the last prompt
        token); where the prompt diverges inside them, the snapshot if it lies before the
        divergence, else none."""
        reuse = min(common_prefix(prompt_token_ids, session.token_ids),
                    len(prompt_token_ids) - 1)
        slots = self.cache.state_slots(session.cache_key)
        if slots and len(slots) != 1 + spec_k:
            return 0  # slot layout changed with speculative_tokens: start over
        if 0 < reuse < len(session.token_ids):
            snap = session.snapshot_len
            return snap if snap is not None and snap <= reuse else 0
        return reuse

    def detach_session(self, req: Request) -> None:
        """Undo ``attach_session`` for a request that could not be admitted after all: the
        session holds the reused prefix again and the request waits holding nothing."""
        session = req.session
        self.cache.transfer(req.request_id, session.cache_key)
        session.token_ids = req.token_ids[:req.num_computed_tokens]
        session.slot_cursor = req.slot_cursor
        req.num_computed_tokens, req.slot_cursor, req.session_attached = 0, 0, False
        req.metrics.num_reused_prompt_tokens = 0

    def evict_idle_session(self) -> bool:
        """Free the cache of the least recently used session that holds one while no request
        of it is running, one without a waiting request first; its next turn prefills from
        scratch -> whether anything was freed."""
        order = sorted(self.sessions.values(), key=lambda s: s.busy)  # stable: LRU within
        for session in order:
            if self.cache.holds(session.cache_key):
                self.cache.free(session.cache_key)
                session.token_ids, session.slot_cursor, session.snapshot_len = [], 0, None
                session.evicted = True
                self.stats["num_session_evictions"] += 1
                return True
        return False

    def _release_session(self, req: Request) -> None:
        """A finished (or aborted) session request hands its cache back to the session."""
        session = req.session
        session.busy = False
        req.session = None
        self.sessions[session.session_id] = self.sessions.pop(session.session_id)  # most recent
        if not req.session_attached:  # never admitted: the session kept its cache
            return
        self.cache.transfer(req.request_id, session.cache_key)
        session.token_ids = req.token_ids[:req.num_computed_tokens]
        session.slot_cursor = req.slot_cursor
        if session.snapshot_len is not None and session.snapshot_len > len(session.token_ids):
            session.snapshot_len = None

    def _maybe_snapshot(self, req: Request) -> None:
        if req.snapshot_at is not None and req.num_computed_tokens == req.snapshot_at:
            own = self.cache.state_slot(req.request_id, req.slot_cursor)
            self.cache.copy_state(own, req.session.snapshot_slot)
            req.session.snapshot_len = req.snapshot_at
            req.snapshot_at = None

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        req.finish_reason = "abort"
        self._finish(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_request(self, request_id: str) -> Request:
        """A request the engine holds (running, waiting, or finished and not yet popped)."""
        return self.requests[request_id]

    def pop_request(self, request_id: str) -> Request | None:
        """Forget a request (finished or aborted) -> it, or None if the engine has no such id."""
        return self.requests.pop(request_id, None)

    @property
    def cache_sizing(self):
        """How the KV blocks and state slots were sized (``statecache.CacheSizing``)."""
        return self.cache.sizing

    # Step ----------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One engine step -> the requests that made progress (new tokens or finished).

        With ``async_scheduling`` a decode step can be launched before the previous one's
        tokens reach the host (``_chain``): the call that launches it returns the previous
        step's results and the next call returns its own."""
        t0 = self.step_costs.clock()
        launched, self._inflight = self._inflight, None
        if launched is not None and any(not s.request.is_finished for s in launched.plan.seqs):
            done = self._complete(launched)
            self.step_costs.record("decode", self.step_costs.clock() - t0)
            return done
        plan = self.scheduler.schedule()
        self.stats["num_preemptions"] += len(plan.preempted)
        for req in plan.failed:
            req.finish_reason = "error"
            self._finish(req)
        if not plan.seqs:
            return plan.failed
        if self.governor is not None:
            self.governor.update()
        now = time.perf_counter()
        for s in plan.seqs:
            if s.request.metrics.first_scheduled_time is None:
                s.request.metrics.first_scheduled_time = now
        launched = self._launch(plan, self.runner.prepare(plan))
        done = self._complete(launched, t0)
        return plan.failed + done

    def _launch(self, plan: StepPlan, batch, rows: list | None = None) -> _Launched:
        """Run the model on ``batch`` and sample, leaving the sampled tokens on the device."""
        hidden = self.runner.forward(batch)
        logits = self.runner.logits(hidden, batch)
        return _Launched(plan, batch, hidden, self._sample_launch(plan, logits, rows))

    def _complete(self, launched: _Launched, t0: float | None = None) -> list[Request]:
        """Chain the next decode step when allowed, then read ``launched``'s tokens and apply
        them -> the requests that made progress."""
        plan = launched.plan
        nxt = self._chain(launched) if self._can_chain(plan) else None
        emitted = self._sample_collect(launched.sampled)
        settled = self._update(plan, emitted)
        t1 = self.step_costs.clock()
        if t0 is not None:  # (a chained step's time is recorded by the call completing it)
            self.step_costs.record(_step_kind(plan), t1 - t0)
        if self.proposer is not None and any(s.request.spec_k for s in plan.seqs):
            self.proposer.propose(plan, launched.batch.query_starts, launched.hidden, settled)
            self.step_costs.record("draft", self.step_costs.clock() - t1)
        self.stats["num_steps"] += 1
        if nxt is not None and any(not s.request.is_finished for s in nxt.plan.seqs):
            self._inflight = nxt  # else every request of it finished: nothing to wait for
        return [s.request for s in plan.seqs if s.sample or s.num_drafts]

    def _can_chain(self, plan: StepPlan) -> bool:
        """Whether the step after ``plan`` is known before its tokens are: every running
        request decodes one token and then another, whatever the token (no waiting request,
        no drafts, sessions, logprobs or penalties, no request at its length limit)."""
        if not self.async_scheduling or self.scheduler.waiting:
            return False
        if len(plan.seqs) != len(self.scheduler.running):
            return False
        limit = self.engine_config.max_model_len
        for s in plan.seqs:
            r, p = s.request, s.request.params
            if (s.num_new_tokens != 1 or not s.sample or s.num_drafts or r.spec_k
                    or r.session is not None or r.is_finished or p.logprobs is not None
                    or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                    or p.presence_penalty != 0.0):
                return False
            if (p.max_tokens is not None and r.num_output_tokens + 1 >= p.max_tokens) or (
                    len(r.token_ids) + 1 >= limit):
                return False
        return True

    def _chain(self, launched: _Launched) -> _Launched | None:
        """Launch the decode step after ``launched`` while its tokens are still on the
        device: each request's next input is its sampled token, copied on the device. The
        requests' host state is advanced by a placeholder token while the batch and the
        sampling rows are built, and restored before ``launched`` is applied. None when some
        request's KV blocks cannot grow (the next step is then scheduled as usual)."""
        reqs = [s.request for s in launched.plan.seqs]
        for r in reqs:
            if not self.cache.allocate_blocks(r.request_id, r.num_computed_tokens + 2):
                return None
        for r in reqs:
            r.token_ids.append(0)
            r.num_computed_tokens += 1
        try:
            plan = StepPlan([ScheduledSeq(r, 1, True, 0, r.num_computed_tokens) for r in reqs])
            batch = self.runner.prepare(plan)
            rows = [r.sampling_row() for r in reqs]
        finally:
            for r in reqs:
                r.token_ids.pop()
                r.num_computed_tokens -= 1
        batch.input_ids.copy_(launched.sampled.tokens, non_blocking=True)
        self.stats["num_chained_steps"] += 1
        return self._launch(plan, batch, rows)

    def _sample_launch(self, plan: StepPlan, logits: torch.Tensor,
                       rows: list | None = None) -> _Sampled:
        """Sample every sequence's tokens; the plain rows' stay on the device (their copy to
        the host is started), drafts are verified at once. ``rows``: the sampling rows of the
        plain rows, when the requests' state is not theirs now (a chained step)."""
        normal, verify = [], []
        r = 0
        for b, s in enumerate(plan.seqs):
            if s.num_drafts:
                verify.append((b, r))
                r += s.num_new_tokens
            elif s.sample:
                normal.append((b, r))
                r += 1
        out = _Sampled(len(plan.seqs), [b for b, _ in normal])
        if normal:
            sel = logits
            if len(normal) < logits.shape[0]:  # verify rows follow: pick the sampling rows
                sel = logits[torch.tensor([r for _, r in normal], device=logits.device)]
            if rows is None:
                rows = [plan.seqs[b].request.sampling_row() for b, _ in normal]
            res = self.sampler.sample(sel, rows)
            out.tokens, out.logprobs = res.token_ids, res.logprobs
            out.start_copy()
        if verify:
            entries = [(plan.seqs[b].request, plan.seqs[b].num_drafts, r0) for b, r0 in verify]
            out.verified = list(zip([b for b, _ in verify],
                                    verify_requests(self.sampler, logits, entries)))
        return out

    @staticmethod
    def _sample_collect(sampled: _Sampled) -> list[Emitted | None]:
        """Per scheduled sequence: the tokens it emits this step (None: mid-prompt chunk)."""
        emitted: list[Emitted | None] = [None] * sampled.num_seqs
        if sampled.normal:
            toks = sampled.host_tokens()
            for n, b in enumerate(sampled.normal):
                lp = None if sampled.logprobs is None else [sampled.logprobs[n]]
                emitted[b] = Emitted([toks[n]], lp, None)
        for b, (toks, lp, a) in sampled.verified:
            emitted[b] = Emitted(toks, lp, a)
        return emitted

    def _update(self, plan: StepPlan, emitted: list[Emitted | None]) -> list[int]:
        """Apply a step's results -> per sequence the number of positions now settled."""
        now = time.perf_counter()
        settled = []
        for s, em in zip(plan.seqs, emitted):
            req = s.request
            if req.is_finished:  # a chained step's request that finished (or was aborted)
                settled.append(0)  # meanwhile: its last token is dropped
                continue
            if s.start < req.num_prompt_tokens:
                computed_prompt = min(s.num_new_tokens, req.num_prompt_tokens - s.start)
                req.metrics.num_computed_prompt_tokens += computed_prompt
                self.stats["num_prefill_tokens"] += computed_prompt
            n = s.num_new_tokens
            if s.num_drafts:
                n = s.num_new_tokens - s.num_drafts + settle_verified(req, s.num_drafts,
                                                                      em.num_accepted)
            req.num_computed_tokens += n
            settled.append(n)
            if req.session is not None:
                self._maybe_snapshot(req)
            req.draft_token_ids, req.draft_probs = [], None
            if em is None:
                continue
            for i, tok in enumerate(em.token_ids):
                lp = em.logprobs[i] if em.logprobs is not None else None
                if lp is not None and req.logprobs is not None:
                    req.logprobs.append({**dict(lp.top), lp.token_id: lp.logprob})
                self._append_token(req, tok, now)
                if req.is_finished:
                    break
        return settled

    def _append_token(self, req: Request, tok: int, now: float) -> None:
        self.stats["num_decode_tokens"] += 1
        if self.output.append(req, tok, now):
            self._finish(req)

    def _finish(self, req: Request) -> None:
        if req.session is not None:
            self._release_session(req)
        self.scheduler.finish(req)
        req.reset_speculation()
        req.metrics.finished_time = time.perf_counter()
        if req.spec_stats is not None:
            self.spec_stats.merge(req.spec_stats)

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        ids = [] if params.ignore_eos else list(self.config.eos_token_ids)
        for t in params.stop_token_ids or []:
            if t not in ids:
                ids.append(t)
        return ids

    # Outputs -------------------------------------------------------------------------------
    make_output = staticmethod(OutputProcessor.make_output)


def _step_kind(plan: StepPlan) -> str:
    """prefill (any prompt token), verify (any drafts) or decode: see StepCosts."""
    if any(s.start < s.request.num_prompt_tokens for s in plan.seqs):
        return "prefill"
    return "verify" if any(s.num_drafts for s in plan.seqs) else "decode"

