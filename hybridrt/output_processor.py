"""The update step: a step's sampled tokens written into its requests, and what a request
returns.

``OutputProcessor.update`` is where a step's tokens land, called by the step's one applier
(``Scheduler.update``, nano-vllm's ``postprocess``): per scheduled sequence it advances
``num_computed_tokens`` (for a verify step: by the accepted drafts, choosing the state slot
verification settled on), drops the verified drafts and appends the emitted tokens;
``apply_drafts`` then hands the proposer's next drafts to their requests. ``append_token``
records one token, checks the stop conditions (stop tokens after ``min_tokens``,
``max_tokens``, the context length), grows the text by the token's piece
(``hybridrt.detokenizer``) and cuts it at a stop string (``request.find_stop``).
``make_output`` turns a request into its ``RequestOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridrt.detokenizer import IncrementalDetokenizer
from hybridrt.outputs import CompletionOutput, RequestOutput
from hybridrt.request import Request, find_stop

if TYPE_CHECKING:
    from hybridrt.sampled_tokens import Emitted
    from hybridrt.specdec.mtp import Drafts
    from hybridrt.step_plan import StepPlan


@dataclass(slots=True)
class StepUpdate:
    """What ``OutputProcessor.update`` did."""

    settled: list[int] = field(default_factory=list)  # per sequence: positions now computed
    finished: list[Request] = field(default_factory=list)  # hit a stop: for the scheduler
    num_prompt_tokens: int = 0  # prompt tokens computed
    num_output_tokens: int = 0  # tokens appended
    applied_at: float = 0.0  # when the tokens were in (Scheduler.update's clock)
    drafted_at: float | None = None  # when the next drafts were picked (None: no drafting)


class OutputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def update(self, plan: StepPlan, emitted: list[Emitted | None], now: float) -> StepUpdate:
        """Apply a step's results (``emitted[b]``: sequence b's tokens, None for a mid-prompt
        chunk) to its requests."""
        up = StepUpdate()
        for s, em in zip(plan.seqs, emitted):
            req = s.request
            if req.is_finished:  # a chained step's request that finished (or was aborted)
                up.settled.append(0)  # meanwhile: its last token is dropped
                continue
            if s.start < req.num_prompt_tokens:
                computed_prompt = min(s.num_new_tokens, req.num_prompt_tokens - s.start)
                req.metrics.num_computed_prompt_tokens += computed_prompt
                up.num_prompt_tokens += computed_prompt
            n = s.num_new_tokens
            if s.num_drafts:
                v = em.verified
                n = s.num_new_tokens - s.num_drafts + v.num_computed_drafts
                req.slot_cursor = v.slot_cursor
                req.spec_stats.record(v.num_drafts, v.num_accepted)
            req.num_computed_tokens += n
            up.settled.append(n)
            req.draft_token_ids, req.draft_probs = [], None
            if em is None:
                continue
            for i, tok in enumerate(em.token_ids):
                lp = em.logprobs[i] if em.logprobs is not None else None
                if lp is not None and req.logprobs is not None:
                    req.logprobs.append({**dict(lp.top), lp.token_id: lp.logprob})
                up.num_output_tokens += 1
                if self.append_token(req, tok, now):
                    up.finished.append(req)
                    break
        return up

    @staticmethod
    def apply_drafts(drafts: list[Drafts]) -> None:
        """Each request's next drafts, verified by its next step."""
        for d in drafts:
            d.request.draft_token_ids, d.request.draft_probs = d.token_ids, d.probs
            if d.request.spec_stats is not None:
                d.request.spec_stats.proposed(len(d.token_ids) if d.k is None else d.k,
                                              d.num_ngram)

    def append_token(self, req: Request, tok: int, now: float) -> bool:
        """Record ``tok`` as the request's next output token -> whether the request finished
        (``finish_reason`` / ``stop_reason`` are set then)."""
        req.token_ids.append(tok)
        m = req.metrics
        m.num_generated_tokens += 1
        if m.first_token_time is None:
            m.first_token_time = now
        p = req.params
        n_out = req.num_output_tokens
        reason: tuple[str, int | str | None] | None = None
        if req.grammar is not None:
            if not req.grammar.accept(tok):  # the mask allowed it: a bug, not bad input
                req.error = RuntimeError(f"structured outputs: token {tok} was sampled but "
                                         f"the request's grammar does not allow it")
                req.finish_reason = "error"
                return True
            if req.grammar.is_terminated:  # the grammar ended on a stop token
                reason = ("stop", tok)
        if reason is None and n_out >= p.min_tokens and tok in req.eos_token_ids:
            reason = ("stop", tok)
        elif (p.max_tokens is not None and n_out >= p.max_tokens) or (
            len(req.token_ids) >= self.max_model_len
        ):
            reason = ("length", None)
        if self.tokenizer is not None:
            prev = len(req.text)
            if req.detokenizer is None:
                req.detokenizer = IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens)
            if reason is not None and reason[0] == "stop" and not p.include_stop_str_in_output:
                text = req.text + req.detokenizer.flush()  # the stop token's text is left out
            else:
                text = req.text + req.detokenizer.add(tok, final=reason is not None)
            if p.stop and n_out >= p.min_tokens:
                at = find_stop(text, p.stop, prev)
                if at is not None:
                    hit = next(s for s in p.stop if text.startswith(s, at))
                    text = text[:at + len(hit)] if p.include_stop_str_in_output else text[:at]
                    reason = ("stop", hit)
            req.text = text
        if reason is None:
            return False
        req.finish_reason, req.stop_reason = reason
        return True

    @staticmethod
    def make_output(req: Request) -> RequestOutput:
        out = CompletionOutput(
            index=0, text=req.text, token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            logprobs=None if req.logprobs is None else list(req.logprobs),
        )
        metrics = req.metrics.as_dict()
        if req.spec_stats is not None:
            metrics["spec"] = req.spec_stats.as_dict()
        if req.vision is not None:
            metrics["vision"] = req.vision.metrics()
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids), outputs=[out],
            finished=req.is_finished, metrics=metrics, error=req.error,
            num_cached_tokens=req.metrics.num_cached_tokens,
        )
