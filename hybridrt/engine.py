"""The engine: ``step()`` = schedule -> prepare -> run -> sample -> update."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridrt.config import ModelConfig
from hybridrt.model import Qwen35ForCausalLM
from hybridrt.outputs import CompletionOutput, RequestOutput
from hybridrt.request import Request
from hybridrt.runner import ModelRunner
from hybridrt.sampler import Sampler, SamplingRow, find_stop, make_generator
from hybridrt.sampling_params import SamplingParams
from hybridrt.scheduler import Scheduler, StepPlan
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
                 device: torch.device | str = "cpu"):
        self.model = model
        self.config = config
        self.cache = cache
        self.engine_config = engine_config
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, cache, device)
        self.scheduler = Scheduler(cache, engine_config.max_num_seqs,
                                   engine_config.max_num_batched_tokens)
        self.sampler = Sampler(seed=seed)  # shared generator for requests without a seed
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.stats = {"num_steps": 0, "num_preemptions": 0, "num_prefill_tokens": 0,
                      "num_decode_tokens": 0}

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
                    prompt: str | None = None, request_id: str | None = None) -> str:
        """Validate and queue a request -> its id. Raises ValueError for bad input; nothing
        is queued then."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        ids = self.validate_prompt(prompt_token_ids)
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, prompt, ids, params, self._stop_ids(params))
        req.generator = make_generator(params)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        req.finish_reason = "abort"
        self._finish(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def pop_request(self, request_id: str) -> Request:
        return self.requests.pop(request_id)

    # Step ----------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One engine step -> the requests that made progress (new tokens or finished)."""
        plan = self.scheduler.schedule()
        self.stats["num_preemptions"] += len(plan.preempted)
        if not plan.seqs:
            return []
        now = time.perf_counter()
        for s in plan.seqs:
            if s.request.metrics.first_scheduled_time is None:
                s.request.metrics.first_scheduled_time = now
        batch = self.runner.prepare(plan)
        logits = self.runner.execute(batch)
        sampled = [s.request for s in plan.seqs if s.sample]
        tokens, logprobs = self._sample(logits, sampled)
        self._update(plan, tokens, logprobs)
        self.stats["num_steps"] += 1
        return [s.request for s in plan.seqs if s.sample]

    def _sample(self, logits: torch.Tensor, reqs: list[Request]):
        if not reqs:
            return [], None
        rows = [
            SamplingRow(
                params=r.params, prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                generator=r.generator,
                eos_token_ids=r.eos_token_ids,
            )
            for r in reqs
        ]
        out = self.sampler.sample(logits, rows)
        return out.token_ids.tolist(), out.logprobs

    def _update(self, plan: StepPlan, tokens: list[int], logprobs) -> None:
        now = time.perf_counter()
        k = 0
        for s in plan.seqs:
            req = s.request
            if req.num_computed_tokens < req.num_prompt_tokens:
                computed_prompt = min(s.num_new_tokens,
                                      req.num_prompt_tokens - req.num_computed_tokens)
                req.metrics.num_computed_prompt_tokens += computed_prompt
                self.stats["num_prefill_tokens"] += computed_prompt
            req.num_computed_tokens += s.num_new_tokens
            if not s.sample:
                continue
            tok = tokens[k]
            if logprobs is not None and req.logprobs is not None and logprobs[k] is not None:
                lp = logprobs[k]
                req.logprobs.append({**dict(lp.top), lp.token_id: lp.logprob})
            k += 1
            self._append_token(req, tok, now)

    def _append_token(self, req: Request, tok: int, now: float) -> None:
        req.token_ids.append(tok)
        self.stats["num_decode_tokens"] += 1
        m = req.metrics
        m.num_generated_tokens += 1
        if m.first_token_time is None:
            m.first_token_time = now
        p = req.params
        n_out = req.num_output_tokens
        reason: tuple[str, int | str | None] | None = None
        if n_out >= p.min_tokens and tok in req.eos_token_ids:
            reason = ("stop", tok)
        elif p.max_tokens is not None and n_out >= p.max_tokens:
            reason = ("length", None)
        elif len(req.token_ids) >= self.engine_config.max_model_len:
            reason = ("length", None)
        if self.tokenizer is not None:
            prev = len(req.text)
            text = self._detokenize(req, drop_last=reason is not None and reason[0] == "stop",
                                    final=reason is not None)
            if p.stop and n_out >= p.min_tokens:
                at = find_stop(text, p.stop, prev)
                if at is not None:
                    hit = next(s for s in p.stop if text.startswith(s, at))
                    text = text[:at + len(hit)] if p.include_stop_str_in_output else text[:at]
                    reason = ("stop", hit)
            req.text = text
        if reason is not None:
            req.finish_reason, req.stop_reason = reason
            self._finish(req)

    def _detokenize(self, req: Request, drop_last: bool, final: bool) -> str:
        ids = req.output_token_ids
        if drop_last and not req.params.include_stop_str_in_output:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)
        if not final:
            # Hold back an incomplete multi-byte character until its last byte arrives.
            text = text.rstrip("\ufffd")
        return text

    def _finish(self, req: Request) -> None:
        self.scheduler.finish(req)
        req.metrics.finished_time = time.perf_counter()

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        ids = [] if params.ignore_eos else list(self.config.eos_token_ids)
        for t in params.stop_token_ids or []:
            if t not in ids:
                ids.append(t)
        return ids

    # Outputs -------------------------------------------------------------------------------
    @staticmethod
    def make_output(req: Request) -> RequestOutput:
        text = req.text
        out = CompletionOutput(
            index=0, text=text, token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            logprobs=None if req.logprobs is None else list(req.logprobs),
        )
        metrics = req.metrics.as_dict()
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids), outputs=[out],
            finished=req.is_finished, metrics=metrics,
        )

