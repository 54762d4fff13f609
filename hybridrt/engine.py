"""The engine: ``step()`` = schedule -> execute -> update (drafts included).

| piece (file) | owns |
| --- | --- |
| Scheduler (scheduler.py) | the queues; admission, preemption, finish; applying a step |
| ModelRunner (runner.py) | running a step: batch, forward, logits, sample / verify; the sampler |
| MTPProposer / SpecProposer (specdec/) | the next drafts (the scheduler's update asks for them) |
| SessionManager (session_manager.py) | open sessions and what they pin between turns |
| StructuredOutputs (structured_outputs.py) | constraints compiled (requests wait in scheduler) |
| HybridCacheManager (statecache/) | KV blocks, state slots, the prefix cache (engine: reads only) |

The engine validates and queues requests and runs steps; it never touches the cache during a
step. Prefix caching (statecache/prefix.py): a request is admitted from the longest cached
prefix of its tokens; the GDN checkpoints its chunks reach are written during the forward
(``ForwardBatch.gdn_checkpoints``) and indexed at the end of the step
(``HybridCacheManager.commit_step``, called by ``Scheduler.update``), with its newly final full
blocks, after the MTP layer has written its KV for the step's positions; a request that
finishes is released then too, its state kept as a checkpoint.

Extension point: ``LLMEngine.observer`` (default None; the runner holds it). When set, an object
whose ``phase(name)`` returns a context manager; ``step`` runs each phase inside it, in this
order: "schedule", "prepare", "forward", "logits", "sample" (the runner's), "update" (the
scheduler's: tokens, drafts, cache commit, finishes). A decode step that async scheduling
chains (``async_chain``) is seen as "prepare", "forward", "logits", "sample" inside the step
that launches it, between that step's "sample" and "update", and its own "update" in the next
call. A benchmark uses it to time the phases (``python -m hybridrt.bench.cuda``); with None the
cost is one attribute check per phase. An observer may also define ``executed(launched,
logits)`` (the runner calls it after "sample") and ``applied(launched, update)`` (called after
"update"): ``hybridrt.trace`` records the step's variables from them.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from typing import Any

from hybridrt.config import ModelConfig
from hybridrt.engine_args import EngineArgs, check_int
from hybridrt.model import Qwen35ForCausalLM
from hybridrt.output_processor import OutputProcessor
from hybridrt.request import Request, stop_token_ids, validate_prompt
from hybridrt.runner import ModelRunner
from hybridrt.sampled_tokens import LaunchedStep
from hybridrt.sampler import make_generator
from hybridrt.sampling_params import SamplingParams
from hybridrt.scheduler import Scheduler
from hybridrt.session import Session
from hybridrt.session_manager import SessionManager
from hybridrt.specdec.proposer import build_proposer
from hybridrt.specdec.stats import StepCosts
from hybridrt.statecache import HybridCacheManager
from hybridrt.statecache.prefix import checkpoint_positions, message_start_ids
from hybridrt.structured_outputs import StructuredOutputs


class LLMEngine:
    def __init__(self, model: Qwen35ForCausalLM, config: ModelConfig, cache: HybridCacheManager,
                 args: EngineArgs, tokenizer: Any = None, draft_vocab: list[int] | None = None,
                 probe_vocab: list[int] | None = None, thread_governor=None,
                 checkpoint_boundary_ids: Sequence[int] | None = None):
        """``args``: resolved (``EngineArgs.resolved``). ``checkpoint_boundary_ids``: where
        prompts' GDN states are saved (statecache.prefix.checkpoint_positions), before each of
        these tokens (default: a chat template's message start) and every
        ``args.checkpoint_interval`` tokens."""
        self.config = config
        self.cache = cache
        self.args = args
        self.tokenizer = tokenizer
        self.session_manager = SessionManager(cache, args.max_num_sessions)
        if checkpoint_boundary_ids is None:
            checkpoint_boundary_ids = message_start_ids(tokenizer)
        self.checkpoint_boundary_ids = frozenset(checkpoint_boundary_ids)
        self.runner = ModelRunner(model, cache, args)
        self.scheduler = Scheduler(cache, args, OutputProcessor(tokenizer, args.max_model_len),
                                   sessions=self.session_manager)
        self.speculative_tokens = args.speculative_tokens
        self.governor = thread_governor  # hybridrt/threads.py: CPU threads fitted each step
        self.proposer = build_proposer(args, model, cache, self.runner.sampler, draft_vocab,
                                       probe_vocab)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        # decode steps launched before the previous step's tokens are read (GPU: the host
        # prepares step n+1 while the device runs step n)
        self.async_scheduling = args.async_scheduling_on
        self._inflight: LaunchedStep | None = None
        self.step_costs = StepCosts()  # seconds in prefill, decode, verify steps and drafting
        self._structured: StructuredOutputs | None = None  # built by the first constraint

    @property
    def engine_config(self) -> EngineArgs:
        """The resolved options (``args``), under the name the server and CLI read."""
        return self.args

    @property
    def observer(self):
        """Sees the phases of every step (the module docstring); the runner holds it."""
        return self.runner.observer

    @observer.setter
    def observer(self, value) -> None:
        self.runner.observer = value

    @property
    def sampler(self):
        return self.runner.sampler

    @property
    def stats(self) -> dict:
        """Counts of steps, preemptions, tokens, evictions (the scheduler's)."""
        return self.scheduler.stats

    @property
    def spec_stats(self):
        """Speculation's counts over the finished requests."""
        return self.scheduler.spec_stats

    # Requests ------------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt as a list of ids; ValueError if it cannot be a request's prompt."""
        return validate_prompt(prompt_token_ids, self.config.vocab_size, self.args.max_model_len)

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                    prompt: str | None = None, request_id: str | None = None,
                    speculative_tokens: int | None = None, session: Session | None = None,
                    snapshot_at: int | None = None, parent_id: str | None = None,
                    vision=None) -> str:
        """Validate and queue a request -> its id. Raises ValueError for bad input; nothing
        is queued then. ``speculative_tokens``: drafts per step for this request (default:
        the engine's; 0 turns speculation off for it). ``session``: continue a conversation,
        its cache pinned between requests (see hybridrt.session). ``snapshot_at``: a prompt
        length at which to keep a GDN checkpoint besides the usual ones (a chat passes where its
        generation prompt starts, the point where a history-rewriting template makes the next
        turn diverge; a session pins it). ``params.structured_outputs``: the request waits in
        the scheduler (``WAITING_FOR_GRAMMAR``) until its constraint is compiled; one that does
        not compile finishes it with an error. ``parent_id``: the request is one choice of an
        n > 1 request (hybridrt.parallel_sampling); ``params.n`` must be 1 here. ``vision``:
        the prompt's images (hybridrt.vision.tower.VisionInputs, from ``VisionTower.prepare``);
        its image tokens are keyed in the prefix cache by the images' content
        (``VisionInputs.keyed``)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(f"the engine runs one choice per request (n={params.n}): "
                             f"split it with hybridrt.parallel_sampling.ParentRequest")
        k = self.speculative_tokens if speculative_tokens is None else speculative_tokens
        check_int("speculative_tokens", k, lo=0, hi=self.speculative_tokens,
                  hint=" (the engine's speculative_tokens)")
        ids = self.validate_prompt(prompt_token_ids)
        if snapshot_at is not None:
            check_int("snapshot_at", snapshot_at, lo=1)
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if session is not None:
            self.session_manager.claim(session)
        stop_ids = stop_token_ids(params, self.config.eos_token_ids)
        req = Request(rid, prompt, ids, params, stop_ids, spec_k=k,
                      generator=make_generator(params), session=session,
                      requested_snapshot_at=snapshot_at, parent_id=parent_id, vision=vision)
        if vision is not None:
            req.token_ids = vision.keyed(ids)
        if self.cache.prefix_caching:
            req.block_hashes = self.cache.block_hashes(mtp=k > 0 and self.args.mtp_drafts)
            req.checkpoint_at = checkpoint_positions(
                ids, self.checkpoint_boundary_ids, self.args.checkpoint_interval,
                () if snapshot_at is None else (snapshot_at,))
        so = params.structured_outputs
        self.scheduler.add(req, None if so is None else self.structured_outputs.pending(so))
        self.requests[rid] = req
        return rid

    @property
    def structured_outputs(self) -> StructuredOutputs:
        """The grammar compiler (built on first use: it reads the whole vocabulary)."""
        if self._structured is None:
            self._structured = StructuredOutputs(self.tokenizer, self.config.vocab_size,
                                                 self.config.eos_token_ids)
        return self._structured

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        inflight = self._inflight is not None and any(
            s.request is req for s in self._inflight.plan.seqs)  # still writing its state
        self.scheduler.finish(req, "abort", keep_state=not inflight)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_request(self, request_id: str) -> Request:
        """A request the engine holds (running, waiting, or finished and not yet popped)."""
        return self.requests[request_id]

    def pop_request(self, request_id: str) -> Request | None:
        """Forget a request (finished or aborted) -> it, or None if the engine has no such id."""
        return self.requests.pop(request_id, None)

    # Sessions (hybridrt.session) and the cache, for the API ---------------------------------
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

    def cached_tokens(self, prompt_token_ids: Sequence[int],
                      speculative_tokens: int | None = None) -> int:
        """How many leading tokens of this prompt a request would take from the prefix cache
        now (0 with caching off)."""
        k = self.speculative_tokens if speculative_tokens is None else speculative_tokens
        if not self.cache.prefix_caching:
            return 0
        hit = self.cache.peek(list(prompt_token_ids),
                              self.cache.block_hashes(mtp=k > 0 and self.args.mtp_drafts))
        return 0 if hit is None else hit.num_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget what the prefix cache holds that no request or session pins -> whether
        nothing is left (vLLM's ``reset_prefix_cache``)."""
        return self.cache.clear_prefix_cache()

    @property
    def cache_sizing(self):
        """How the KV blocks and state slots were sized (``statecache.CacheSizing``)."""
        return self.cache.sizing

    # Step ----------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One engine step -> the requests that made progress (new tokens or finished).

        schedule -> execute (the runner: batch, forward, logits, sample / verify) -> update
        (the scheduler: tokens, drafts, cache commit, finishes). With ``async_scheduling`` a
        decode step can be launched before the previous one's tokens reach the host: the call
        that launches it returns the previous step's results and the next call applies it."""
        t0 = self.step_costs.clock()
        launched, self._inflight, failed = self._inflight, None, []
        if launched is None or all(s.request.is_finished for s in launched.plan.seqs):
            with self._phase("schedule"):
                plan = self.scheduler.schedule()
            failed = plan.failed
            if not plan.seqs:
                return failed
            if self.governor is not None:
                self.governor.update()
            launched = self._execute(plan)
        plan = launched.plan
        try:
            chained = None
            if self.async_scheduling:
                ahead = self.scheduler.schedule_chained(plan)
                chained = None if ahead is None else self._execute(ahead, launched)
            with self._phase("update"):
                up = self.scheduler.update(launched, self.proposer,
                                           () if chained is None else
                                           [s.request for s in chained.plan.seqs],
                                           self.step_costs.clock)
        except BaseException:
            self.scheduler.spoil(plan)
            raise
        if self.observer is not None and hasattr(self.observer, "applied"):
            self.observer.applied(launched, up)  # a tracer (hybridrt.trace) reads it
        self.step_costs.record(plan.kind, up.applied_at - t0)
        if up.drafted_at is not None:
            self.step_costs.record("draft", up.drafted_at - up.applied_at)
        if chained is not None and any(not s.request.is_finished for s in chained.plan.seqs):
            self._inflight = chained  # else every request of it finished: nothing to wait for
        return failed + [s.request for s in plan.seqs if s.sample or s.num_drafts]

    def _execute(self, plan, after: LaunchedStep | None = None) -> LaunchedStep:
        """The runner's step; what it was writing is not kept when it fails."""
        try:
            return self.runner.execute(plan, after)
        except BaseException:
            self.scheduler.spoil(plan)
            raise

    def _phase(self, name: str):
        """The observer's context for one phase of ``step`` (see the module docstring)."""
        return _NO_PHASE if self.observer is None else self.observer.phase(name)

    # Outputs -------------------------------------------------------------------------------
    make_output = staticmethod(OutputProcessor.make_output)


_NO_PHASE = contextlib.nullcontext()
