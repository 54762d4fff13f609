"""The engine: ``step()`` = schedule -> prepare the batch -> run -> sample / verify -> update
-> draft.

| piece | owns | file |
| --- | --- | --- |
| Scheduler | waiting / running queues; admission, preemption, finish | scheduler.py |
| ModelRunner | the step's ForwardBatch; forward and logits | runner.py |
| sample_step | sampling and draft verification; tokens left on the device | async_chain.py |
| OutputProcessor | the update step: request progress, stops, text | output_processor.py |
| MTPProposer | the next drafts | specdec/mtp.py |
| SessionManager | open sessions and their cache between turns | session_manager.py |
| HybridCacheManager | KV blocks and state slots per owner | statecache/manager.py |

Extension point: ``LLMEngine.observer`` (default None). When set, an object whose
``phase(name)`` returns a context manager; ``step`` runs each phase inside it, in this order:
"schedule", "prepare", "forward", "logits", "sample", "update" (drafting follows "update",
outside the phases). A decode step that async scheduling chains (``async_chain``) is seen as
"prepare", "forward", "logits", "sample" inside the step that launches it, between that step's
"sample" and "update", and its own "update" in the next call. A benchmark uses it to time the
phases (``python -m hybridrt.bench.cuda``); with None the cost is one attribute check per phase.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridrt.async_chain import (
    LaunchedStep,
    can_chain,
    chained_plan,
    lookahead_rows,
    sample_step,
)
from hybridrt.config import ModelConfig
from hybridrt.model import Qwen35ForCausalLM
from hybridrt.output_processor import OutputProcessor
from hybridrt.request import Request, stop_token_ids, validate_prompt
from hybridrt.runner import ModelRunner
from hybridrt.sampler import Sampler, make_generator
from hybridrt.sampling_params import SamplingParams
from hybridrt.scheduler import Scheduler, StepPlan
from hybridrt.session import Session
from hybridrt.session_manager import SessionManager
from hybridrt.specdec.mtp import MTPProposer
from hybridrt.specdec.stats import SpecStats, StepCosts
from hybridrt.statecache import HybridCacheManager


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
                 thread_governor=None, async_scheduling: bool | None = None,
                 batch_invariant: bool = False):
        self.model = model
        self.config = config
        self.cache = cache
        self.engine_config = engine_config
        self.tokenizer = tokenizer
        self.session_manager = SessionManager(cache)
        self.output_processor = OutputProcessor(tokenizer, engine_config.max_model_len,
                                                self.session_manager)
        self.runner = ModelRunner(model, cache, device, backend, engine_config.max_num_seqs,
                                  engine_config.max_num_batched_tokens,
                                  engine_config.max_model_len, batch_invariant)
        self.scheduler = Scheduler(cache, engine_config.max_num_seqs,
                                   engine_config.max_num_batched_tokens,
                                   sessions=self.session_manager)
        # shared generator for requests without a seed; positional draws for seeded ones when
        # batch-invariant (hybridrt/sampler.py)
        self.sampler = Sampler(seed=seed, positional=batch_invariant)
        self.speculative_tokens = speculative_tokens
        self.governor = thread_governor  # hybridrt/threads.py: CPU threads fitted each step
        self.proposer = None
        if speculative_tokens > 0:
            self.proposer = MTPProposer(model, cache, self.sampler, engine_config.max_model_len,
                                        device, draft_vocab=draft_vocab)
        self.spec_stats = SpecStats(speculative_tokens)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.stats = {"num_steps": 0, "num_preemptions": 0, "num_prefill_tokens": 0,
                      "num_decode_tokens": 0, "num_session_evictions": 0,
                      "num_chained_steps": 0}
        # decode steps launched before the previous step's tokens are read (GPU: the host
        # prepares step n+1 while the device runs step n); default: on for CUDA
        self.async_scheduling = (torch.device(device).type == "cuda" if async_scheduling is None
                                 else bool(async_scheduling))
        self._inflight: LaunchedStep | None = None
        self.step_costs = StepCosts()  # seconds in prefill, decode, verify steps and drafting
        self.observer = None  # sees the phases of every step: see the module docstring

    # Requests ------------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt as a list of ids; ValueError if it cannot be a request's prompt."""
        return validate_prompt(prompt_token_ids, self.config.vocab_size,
                               self.engine_config.max_model_len)

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
        if session is not None:
            self.session_manager.claim(session)
        stop_ids = stop_token_ids(params, self.config.eos_token_ids)
        req = Request(rid, prompt, ids, params, stop_ids, spec_k=k,
                      generator=make_generator(params), session=session,
                      requested_snapshot_at=snapshot_at)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    # Sessions (hybridrt.session) -----------------------------------------------------------
    @property
    def sessions(self) -> dict[str, Session]:
        """The open sessions, least recently used first."""
        return self.session_manager.sessions

    def open_session(self) -> Session:
        """A conversation whose cache outlives its requests (see hybridrt.session)."""
        return self.session_manager.open(f"s{next(self._ids)}")

    def close_session(self, session: Session) -> None:
        self.session_manager.close(session)

    def reset_session(self, session: Session) -> None:
        """Forget the cached conversation (``/clear``); the session stays usable."""
        self.session_manager.reset(session)

    def reusable_tokens(self, session: Session, prompt_token_ids: list[int],
                        spec_k: int = 0) -> int:
        """How many leading prompt tokens a request on ``session`` would take from its cache
        now (``SessionManager.reusable_tokens``)."""
        return self.session_manager.reusable_tokens(session, prompt_token_ids, spec_k)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        self._finish(req, "abort")

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

        schedule -> prepare the batch -> forward -> logits -> sample / verify -> update ->
        draft. With ``async_scheduling`` a decode step can be launched before the previous
        one's tokens reach the host (``_chain``): the call that launches it returns the
        previous step's results and the next call applies it (update and draft only)."""
        t0 = self.step_costs.clock()
        launched, self._inflight, failed = self._inflight, None, []
        if launched is None or all(s.request.is_finished for s in launched.plan.seqs):
            with self._phase("schedule"):
                plan = self.scheduler.schedule()
                self.stats["num_preemptions"] += len(plan.preempted)
                self.stats["num_session_evictions"] = self.session_manager.num_evictions
                failed = plan.failed
                for req in failed:
                    self._finish(req, "error")
            if not plan.seqs:
                return failed
            if self.governor is not None:
                self.governor.update()
            with self._phase("prepare"):
                batch = self.runner.build_step_batch(plan)
            launched, kind = self._launch(plan, batch), _step_kind(plan)
        else:
            kind = "decode"  # a chained step, launched by the previous call
        plan = launched.plan
        chained = self._chain(launched)
        with self._phase("update"):
            emitted = launched.sampled.emitted()  # waits for the tokens to reach the host
            up = self.output_processor.update(plan, emitted, time.perf_counter())
            self.stats["num_prefill_tokens"] += up.num_prompt_tokens
            self.stats["num_decode_tokens"] += up.num_output_tokens
            for req in up.finished:
                self._finish(req)
        t1 = self.step_costs.clock()
        self.step_costs.record(kind, t1 - t0)
        if self.proposer is not None and any(s.request.spec_k for s in plan.seqs):
            self.output_processor.apply_drafts(self.proposer.propose(
                plan, launched.batch.query_starts, launched.hidden, up.settled))
            self.step_costs.record("draft", self.step_costs.clock() - t1)
        self.stats["num_steps"] += 1
        if chained is not None and any(not s.request.is_finished for s in chained.plan.seqs):
            self._inflight = chained  # else every request of it finished: nothing to wait for
        return failed + [s.request for s in plan.seqs if s.sample or s.num_drafts]

    def _phase(self, name: str):
        """The observer's context for one phase of ``step`` (see the module docstring)."""
        return _NO_PHASE if self.observer is None else self.observer.phase(name)

    def _launch(self, plan: StepPlan, batch, rows: list | None = None) -> LaunchedStep:
        """Run the model on ``batch`` and sample, leaving the sampled tokens on the device."""
        with self._phase("forward"):
            hidden = self.runner.forward(batch)
        with self._phase("logits"):
            logits = self.runner.logits(hidden, batch)
        with self._phase("sample"):
            sampled = sample_step(self.sampler, plan, logits, rows)
        return LaunchedStep(plan, batch, hidden, sampled)

    def _chain(self, launched: LaunchedStep) -> LaunchedStep | None:
        """With async scheduling, launch the decode step after ``launched`` while its tokens
        are still on the device (hybridrt.async_chain) -> it, or None."""
        if not (self.async_scheduling and can_chain(launched.plan, self.scheduler,
                                                    self.engine_config.max_model_len)):
            return None
        plan = chained_plan(launched.plan, self.cache)
        if plan is None:
            return None
        with self._phase("prepare"):
            batch = self.runner.build_step_batch(plan)
            batch.input_ids.copy_(launched.sampled.tokens, non_blocking=True)
        self.stats["num_chained_steps"] += 1
        return self._launch(plan, batch, lookahead_rows(plan))

    def _finish(self, req: Request, reason: str | None = None) -> None:
        self.scheduler.finish(req, reason)
        if req.spec_stats is not None:
            self.spec_stats.merge(req.spec_stats)

    # Outputs -------------------------------------------------------------------------------
    make_output = staticmethod(OutputProcessor.make_output)


_NO_PHASE = contextlib.nullcontext()


def _step_kind(plan: StepPlan) -> str:
    """prefill (any prompt token), verify (any drafts) or decode: see StepCosts."""
    if any(s.start < s.request.num_prompt_tokens for s in plan.seqs):
        return "prefill"
    return "verify" if any(s.num_drafts for s in plan.seqs) else "decode"

