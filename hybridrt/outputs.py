"""What ``LLM.generate`` returns (the shapes vLLM users know)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None (running)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}
    # With thinking on: the think block without its tags (``text`` is then the answer after
    # it); None when the output does not think. See hybridrt.reasoning.
    reasoning_text: str | None = None
    # LLM.chat(tools=...): the calls parsed out of the answer (hybridrt.tool_calls.ToolCall);
    # ``text`` is then the answer without them. None without tools.
    tool_calls: list[Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, Any] = field(default_factory=dict)
    error: Exception | None = None  # set (a ValueError) when the request was rejected
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (vLLM's field)


def error_output(rid: str, prompt: Any, err: ValueError) -> RequestOutput:
    """The output of a request refused before it ran: finish reason "error", ``err`` kept."""
    text = prompt if isinstance(prompt, str) else None
    ids = list(prompt) if isinstance(prompt, Sequence) and not isinstance(prompt, str) else []
    return RequestOutput(
        request_id=rid, prompt=text, prompt_token_ids=ids,
        outputs=[CompletionOutput(0, "", [], "error", None, None)], finished=True, error=err,
    )
