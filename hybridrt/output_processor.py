"""From sampled tokens to what a request returns: stop conditions, text, outputs.

The engine hands each new token of a request to ``OutputProcessor.append``, which records it,
checks the stop conditions (stop tokens after ``min_tokens``, ``max_tokens``, the context
length), grows the text by the token's piece (``hybridrt.detokenizer``) and cuts it at a stop
string; it says whether the request is done. ``make_output`` turns a request into its
``RequestOutput``.
"""

from __future__ import annotations

from typing import Any

from hybridrt.detokenizer import IncrementalDetokenizer
from hybridrt.outputs import CompletionOutput, RequestOutput
from hybridrt.request import Request
from hybridrt.sampler import find_stop


class OutputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def append(self, req: Request, tok: int, now: float) -> bool:
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
        if n_out >= p.min_tokens and tok in req.eos_token_ids:
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
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids), outputs=[out],
            finished=req.is_finished, metrics=metrics, error=req.error,
        )
