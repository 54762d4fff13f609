"""The engine: ``step()`` = schedule -> prepare the batch -> run -> sample / verify -> update
-> draft.

| piece | owns | file |
| --- | --- | --- |
| Scheduler | waiting / running queues; admission, preemption, finish | scheduler.py |
| ModelRunner | the step's ForwardBatch; forward and logits | runner.py |
| sample_step | sampling and draft verification; tokens left on the device | async_chain.py |
| OutputProcessor | the update step: request progress, stops, text | output_processor.py |
| MTPProposer | the next drafts | specdec/mtp.py |
| SessionManager | open sessions and what they pin between turns | session_manager.py |
| HybridCacheManager | KV blocks, state slots, the prefix cache | statecache/manager.py |
| StructuredOutputs | constraints compiled (requests wait for theirs) | structured_outputs.py |

Prefix caching (statecache/prefix.py): a request is admitted from the longest cached prefix of
its tokens; the GDN checkpoints its chunks reach are written during the forward
(``ForwardBatch.gdn_checkpoints``) and indexed at the end of the step (``_commit``), with its
newly final full blocks, after the MTP layer has written its KV for the step's positions; a
request that finishes is released then too, its state kept as a checkpoint.

Extension point: ``LLMEngine.observer`` (default None). When set, an object whose
``phase(name)`` returns a context manager; ``step`` runs each phase inside it, in this order:
"schedule", "prepare", "forward", "logits", "sample", "update" (drafting follows "update",
outside the phases). A decode step that async scheduling chains (``async_chain``) is seen as
"prepare", "forward", "logits", "sample" inside the step that launches it, between that step's
"sample" and "update", and its own "update" in the next call. A benchmark uses it to time the
phases (``python -m hybridrt.bench.cuda``); with None the cost is one attribute check per phase.
"""

from __future__ import annotations

import concurrent.futures
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
from hybridrt.sampler import Sampler, make_generator, plain_greedy
from hybridrt.sampling_params import SamplingParams
from hybridrt.scheduler import Scheduler, StepPlan
from hybridrt.session import Session
from hybridrt.session_manager import SessionManager
from hybridrt.specdec.mtp import MTPProposer
from hybridrt.specdec.stats import SpecStats, StepCosts
from hybridrt.statecache import HybridCacheManager
from hybridrt.statecache.prefix import checkpoint_positions
from hybridrt.structured_outputs import StructuredOutputs


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
                 max_num_sessions: int | None = None,
                 checkpoint_boundary_ids: Sequence[int] | None = None,
                 checkpoint_interval: int = 0, batch_invariant: bool = False):
        self.model = model
        self.config = config
        self.cache = cache
        self.engine_config = engine_config
        self.tokenizer = tokenizer
        self.session_manager = SessionManager(cache, max_num_sessions)
        # where prompts' GDN states are saved (statecache.prefix.checkpoint_positions): before
        # each of these tokens (a chat template's message start) and every ``interval`` tokens
        if checkpoint_boundary_ids is None:
            checkpoint_boundary_ids = _message_start_ids(tokenizer)
        self.checkpoint_boundary_ids = frozenset(checkpoint_boundary_ids)
        if not isinstance(checkpoint_interval, int) or checkpoint_interval < 0:
            raise ValueError(f"checkpoint_interval must be an integer >= 0, got "
                             f"{checkpoint_interval!r}")
        self.checkpoint_interval = checkpoint_interval
        self.output_processor = OutputProcessor(tokenizer, engine_config.max_model_len)
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
                                        device, draft_vocab=draft_vocab,
                                        keep_kv=cache.prefix_caching)
        self.spec_stats = SpecStats(speculative_tokens)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.stats = {"num_steps": 0, "num_preemptions": 0, "num_prefill_tokens": 0,
                      "num_decode_tokens": 0, "num_session_evictions": 0,
                      "num_chained_steps": 0, "num_cached_tokens": 0}
        # decode steps launched before the previous step's tokens are read (GPU: the host
        # prepares step n+1 while the device runs step n); default: on for CUDA
        self.async_scheduling = (torch.device(device).type == "cuda" if async_scheduling is None
                                 else bool(async_scheduling))
        self._inflight: LaunchedStep | None = None
        self.step_costs = StepCosts()  # seconds in prefill, decode, verify steps and drafting
        self.observer = None  # sees the phases of every step: see the module docstring
        self._structured: StructuredOutputs | None = None  # built by the first constraint
        self._compiling: list[tuple[Request, object]] = []  # (request, Future of its grammar)

    # Requests ------------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt as a list of ids; ValueError if it cannot be a request's prompt."""
        return validate_prompt(prompt_token_ids, self.config.vocab_size,
                               self.engine_config.max_model_len)

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                    prompt: str | None = None, request_id: str | None = None,
                    speculative_tokens: int | None = None, session: Session | None = None,
                    snapshot_at: int | None = None, parent_id: str | None = None) -> str:
        """Validate and queue a request -> its id. Raises ValueError for bad input; nothing
        is queued then. ``speculative_tokens``: drafts per step for this request (default:
        the engine's; 0 turns speculation off for it). ``session``: continue a conversation,
        its cache pinned between requests (see hybridrt.session). ``snapshot_at``: a prompt
        length at which to keep a GDN checkpoint besides the usual ones (a chat passes where its
        generation prompt starts, the point where a history-rewriting template makes the next
        turn diverge; a session pins it). ``params.structured_outputs``: the request waits,
        outside the scheduler, until its constraint is compiled; one that does not compile
        finishes it with an error. ``parent_id``: the request is one choice of an n > 1 request
        (hybridrt.parallel_sampling); ``params.n`` must be 1 here."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(f"the engine runs one choice per request (n={params.n}): "
                             f"split it with hybridrt.parallel_sampling.ParentRequest")
        k = self.speculative_tokens if speculative_tokens is None else speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= self.speculative_tokens:
            raise ValueError(
                f"speculative_tokens must be an integer in [0, {self.speculative_tokens}] (the "
                f"engine's speculative_tokens), got {speculative_tokens!r}"
            )
        ids = self.validate_prompt(prompt_token_ids)
        if snapshot_at is not None and (
            not isinstance(snapshot_at, int) or isinstance(snapshot_at, bool) or snapshot_at < 1
        ):
            raise ValueError(f"snapshot_at must be a positive int, got {snapshot_at!r}")
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if session is not None:
            self.session_manager.claim(session)
        stop_ids = stop_token_ids(params, self.config.eos_token_ids)
        req = Request(rid, prompt, ids, params, stop_ids, spec_k=k,
                      generator=make_generator(params), session=session,
                      requested_snapshot_at=snapshot_at, parent_id=parent_id)
        if self.cache.prefix_caching:
            req.block_hashes = self.cache.block_hashes(mtp=k > 0)
            req.checkpoint_at = checkpoint_positions(
                ids, self.checkpoint_boundary_ids, self.checkpoint_interval,
                () if snapshot_at is None else (snapshot_at,))
        if params.structured_outputs is not None:
            fut = self.structured_outputs.submit(params.structured_outputs)
            self._compiling.append((req, fut))
        else:
            self.scheduler.add(req)
        self.requests[rid] = req
        return rid

    @property
    def structured_outputs(self) -> StructuredOutputs:
        """The grammar compiler (built on first use: it reads the whole vocabulary)."""
        if self._structured is None:
            self._structured = StructuredOutputs(self.tokenizer, self.config.vocab_size,
                                                 self.config.eos_token_ids)
        return self._structured

    def _admit_compiled(self) -> list[Request]:
        """Requests whose grammar is compiled go to the scheduler, each with its matcher;
        those whose grammar failed or timed out finish with the error -> those. When
        nothing else runs, waits up to 50 ms for a compile, rather than spin."""
        if not self._compiling:
            return []
        if not self.scheduler.has_unfinished():
            futures = [f for _, f in self._compiling]
            concurrent.futures.wait(futures, timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        so, failed, still = self._structured, [], []
        now = time.perf_counter()
        for req, fut in self._compiling:
            if req.is_finished:  # aborted while compiling
                continue
            params = req.params.structured_outputs
            waited = now - req.metrics.arrival_time
            if not fut.done() and waited < so.compile_timeout:
                still.append((req, fut))
                continue
            try:
                compiled = so.result(fut, params)
                req.grammar = so.matcher(compiled, req.eos_token_ids, params.kind)
            except ValueError as e:
                req.error = e
                self._finish(req, "error")
                failed.append(req)
                continue
            self.scheduler.add(req)
        self._compiling = still
        return failed

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

    def cached_tokens(self, prompt_token_ids: Sequence[int],
                      speculative_tokens: int | None = None) -> int:
        """How many leading tokens of this prompt a request would take from the prefix cache
        now (0 with caching off)."""
        k = self.speculative_tokens if speculative_tokens is None else speculative_tokens
        if not self.cache.prefix_caching:
            return 0
        hit = self.cache.peek(list(prompt_token_ids), self.cache.block_hashes(mtp=k > 0))
        return 0 if hit is None else hit.num_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget what the prefix cache holds that no request or session pins -> whether
        nothing is left (vLLM's ``reset_prefix_cache``)."""
        return self.cache.clear_prefix_cache()

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        inflight = self._inflight is not None and any(
            s.request is req for s in self._inflight.plan.seqs)  # still writing its state
        self._finish(req, "abort", keep_state=not inflight)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling)

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
        launched, self._inflight, failed = self._inflight, None, self._admit_compiled()
        if launched is None or all(s.request.is_finished for s in launched.plan.seqs):
            with self._phase("schedule"):
                plan = self.scheduler.schedule()
                self.stats["num_preemptions"] += len(plan.preempted)
                self.stats["num_session_evictions"] = self.session_manager.num_evictions
                failed += plan.failed
                for req in plan.failed:
                    self._finish(req, "error")
            if not plan.seqs:
                return failed
            if self.governor is not None:
                self.governor.update()
            try:
                with self._phase("prepare"):
                    batch = self.runner.build_step_batch(plan)
                launched, kind = self._launch(plan, batch), _step_kind(plan)
            except BaseException:
                self._spoil(plan)
                raise
        else:
            kind = "decode"  # a chained step, launched by the previous call
        try:
            return failed + self._apply(launched, kind, t0)
        except BaseException:
            self._spoil(launched.plan)
            raise

    def _apply(self, launched: LaunchedStep, kind: str, t0: float) -> list[Request]:
        """The step's second half: update, drafts, the prefix cache's commit, finishes."""
        plan = launched.plan
        chained = self._chain(launched)
        with self._phase("update"):
            emitted = launched.sampled.emitted()  # waits for the tokens to reach the host
            up = self.output_processor.update(plan, emitted, time.perf_counter())
            self.stats["num_prefill_tokens"] += up.num_prompt_tokens
            self.stats["num_decode_tokens"] += up.num_output_tokens
        t1 = self.step_costs.clock()
        self.step_costs.record(kind, t1 - t0)
        if self.proposer is not None and any(s.request.spec_k for s in plan.seqs):
            self.output_processor.apply_drafts(self.proposer.propose(
                plan, launched.batch.query_starts, launched.hidden, up.settled))
            self.step_costs.record("draft", self.step_costs.clock() - t1)
        self._commit(launched, up.settled)
        ahead = set() if chained is None else {id(s.request) for s in chained.plan.seqs}
        for req in up.finished:  # after the drafts: the MTP KV of their last positions is in
            self._finish(req, keep_state=id(req) not in ahead)
        self.stats["num_steps"] += 1
        if chained is not None and any(not s.request.is_finished for s in chained.plan.seqs):
            self._inflight = chained  # else every request of it finished: nothing to wait for
        return [s.request for s in plan.seqs if s.sample or s.num_drafts]

    def _spoil(self, plan: StepPlan) -> None:
        """A step failed midway: what it was writing is not kept by the prefix cache (its
        requests' states, the checkpoints it reserved)."""
        for s in plan.seqs:
            s.request.cache_dirty = True
            for ck in s.checkpoints:
                self.cache.drop_pending(ck)
            s.checkpoints = []

    def _commit(self, launched: LaunchedStep, settled: list[int]) -> None:
        """The prefix cache's part of the step's end: the GDN checkpoints this step wrote
        indexed (with the target's hidden state before them, the MTP layer's input there), each
        request's newly final full blocks indexed, the hidden state after its last computed
        token kept for its release; the MTP carry of a cache hit spent."""
        cache, plan = self.cache, launched.plan
        if not cache.prefix_caching:
            return
        starts, hidden = launched.batch.query_starts, launched.hidden
        rows, wants = [], []  # hidden rows to keep: (request, checkpoint or None)
        for b, s in enumerate(plan.seqs):
            req = s.request
            req.mtp_carry = None
            if req.block_hashes is None or req.cache_dirty or settled[b] == 0 and not (
                    s.checkpoints):
                continue
            mtp = req.block_hashes.lookahead > 0
            for ck in s.checkpoints:
                if mtp:
                    rows.append(starts[b] + ck.num_tokens - s.start - 1)
                    wants.append((req, ck))
                else:
                    cache.save_checkpoint(ck, req.request_id, None)
            if mtp and settled[b]:
                rows.append(starts[b] + settled[b] - 1)
                wants.append((req, None))
        if rows:
            kept = hidden.index_select(0, torch.tensor(rows, device=hidden.device))
            for (req, ck), h in zip(wants, kept):
                if ck is None:
                    req.last_hidden = h
                else:
                    cache.save_checkpoint(ck, req.request_id, h)
        for s in plan.seqs:
            req = s.request
            if req.block_hashes is not None and not req.cache_dirty:
                cache.commit_blocks(req.request_id, req.token_ids, req.block_hashes,
                                    req.num_computed_tokens)

    def _phase(self, name: str):
        """The observer's context for one phase of ``step`` (see the module docstring)."""
        return _NO_PHASE if self.observer is None else self.observer.phase(name)

    def _launch(self, plan: StepPlan, batch, rows: list | None = None) -> LaunchedStep:
        """Run the model on ``batch`` and sample, leaving the sampled tokens on the device."""
        if rows is None:  # the plain rows' (sampling, not verifying), as sample_step orders them
            rows = [s.request.sampling_row() for s in plan.seqs if s.sample and not s.num_drafts]
        # rows that only take the argmax need no fp32 copy of the logits: the argmax of the
        # head's own dtype is the same token (verification keeps fp32)
        fp32 = any(s.num_drafts for s in plan.seqs) or not plain_greedy(rows)
        with self._phase("forward"):
            hidden = self.runner.forward(batch)
        with self._phase("logits"):
            logits = self.runner.logits(hidden, batch, fp32)
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

    def _finish(self, req: Request, reason: str | None = None, keep_state: bool = True) -> None:
        self.scheduler.finish(req, reason, keep_state)
        self.stats["num_cached_tokens"] += req.metrics.num_cached_tokens
        if req.spec_stats is not None:
            self.spec_stats.merge(req.spec_stats)

    # Outputs -------------------------------------------------------------------------------
    make_output = staticmethod(OutputProcessor.make_output)


_NO_PHASE = contextlib.nullcontext()


def _message_start_ids(tokenizer: Any) -> list[int]:
    """The token a chat template starts each message with (ChatML's ``<|im_start|>``), if the
    tokenizer has it: prefix-cache checkpoints go before each."""
    if tokenizer is None:
        return []
    try:
        tid = tokenizer.convert_tokens_to_ids("<|im_start|>")
    except Exception:  # a tokenizer without that method or token: no message boundaries
        return []
    unk = getattr(tokenizer, "unk_token_id", None)
    return [tid] if isinstance(tid, int) and tid != unk else []


def _step_kind(plan: StepPlan) -> str:
    """prefill (any prompt token), verify (any drafts) or decode: see StepCosts."""
    if any(s.start < s.request.num_prompt_tokens for s in plan.seqs):
        return "prefill"
    return "verify" if any(s.num_drafts for s in plan.seqs) else "decode"

