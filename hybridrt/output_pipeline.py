"""The front-end output pipeline: how the engine's requests become what a user gets, shared by
``LLM`` (generate, chat, stream) and the server's chat and completion routes.

- ``Shape``: how one request's outputs are shaped: does its prompt leave a think block open
  (hybridrt.reasoning), its tools (hybridrt.tool_calls; None: no parsing) and whether more
  than one call is kept.
- ``finish_message``: a finished output's text -> its reasoning, content and tool calls.
- ``holdback`` and ``ChoiceStream``: a streamed choice's new text, less what a stop string may
  still cut off; its reasoning pieces; its chat delta (tool calls piece by piece).
- ``FanIn``: the n choices of one request (the children of one
  ``parallel_sampling.ParentRequest``) as they progress, joined by index, with their ``Usage``.

Nothing here knows HTTP: the server wraps these in OpenAI's JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridrt.reasoning import ReasoningDelta, ReasoningSplitter, split_reasoning
from hybridrt.sampling_params import SamplingParams
from hybridrt.tool_calls import ToolCall, ToolCallParser, parse_tool_calls


@dataclass(frozen=True, slots=True)
class Shape:
    """How a request's outputs are shaped: ``thinks`` (its prompt leaves a <think> block
    open), ``tools`` (the calls in an answer are parsed out of it; None: not), ``parallel``
    (False: the first call only)."""

    thinks: bool = False
    tools: list[dict] | None = None
    parallel: bool = True


@dataclass(slots=True)
class Message:
    """A finished output, shaped: ``reasoning`` (None when it does not think), ``content``
    (the answer outside any tool call; None when the calls are all of it) and ``tool_calls``
    (None without tools)."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] | None = None


def finish_message(text: str, shape: Shape) -> Message:
    """A finished output's text -> its think block apart from the answer and, with tools, the
    answer's calls parsed out of it (a call begun inside the think block ends it)."""
    reasoning, answer = split_reasoning(text, shape.thinks, tool_calls=shape.tools is not None)
    if shape.tools is None:
        return Message(reasoning, answer)
    content, calls = parse_tool_calls(answer, shape.tools)
    return Message(reasoning, content, calls if shape.parallel else calls[:1])


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason of a chat choice: "tool_calls" when it stopped having called."""
    return "tool_calls" if called and reason == "stop" else reason


def holdback(params: SamplingParams) -> int:
    """Characters at the end of a running output that a stop string may still cut off."""
    return 0 if params.include_stop_str_in_output else max(0, params.max_stop_len - 1)


@dataclass(slots=True)
class ChoiceStream:
    """One streamed choice: ``feed`` its whole text so far -> the part newly safe to show;
    ``split`` that part into reasoning pieces (ReasoningDelta) and answer text; ``delta``: the
    same as a chat chunk's delta, its tool calls' pieces included."""

    shape: Shape
    holdback: int = 0
    sent: int = 0  # characters of the text shown so far
    called: bool = False  # a tool call was sent
    splitter: ReasoningSplitter = field(init=False)
    parser: ToolCallParser | None = field(init=False)

    def __post_init__(self):
        tools = self.shape.tools
        self.splitter = ReasoningSplitter(self.shape.thinks, tool_calls=tools is not None)
        self.parser = ToolCallParser(tools) if tools is not None else None

    def feed(self, text: str, done: bool) -> str:
        end = len(text) if done else len(text) - self.holdback
        if end <= self.sent:
            return ""
        new, self.sent = text[self.sent:end], end
        return new

    def split(self, new: str, done: bool) -> list[str]:
        pieces = self.splitter.feed(new) if new else []
        return pieces + self.splitter.flush() if done else pieces

    def delta(self, new: str, done: bool) -> dict:
        """A chat chunk's delta: reasoning, answer text and the calls' pieces (a call's name
        first, then its arguments fragment by fragment; the first call only unless
        parallel)."""
        pieces = self.split(new, done)
        reasoning = "".join(p for p in pieces if isinstance(p, ReasoningDelta))
        answer = "".join(p for p in pieces if not isinstance(p, ReasoningDelta))
        calls = []
        if self.parser is not None:
            answer, calls = self.parser.feed(answer)
            if done:
                rest, more = self.parser.flush()
                answer, calls = answer + rest, calls + more
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if answer:
            delta["content"] = answer
        parts = [c.as_openai() for c in calls]
        if not self.shape.parallel:
            parts = [p for p in parts if p["index"] == 0]
        if parts:
            delta["tool_calls"] = parts
            self.called = True
        return delta


@dataclass(slots=True)
class Usage:
    """Token counts of one request over its choices: the prompt's (once), the generated
    ones (all choices') and the prompt's tokens taken from the prefix cache."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def finished(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A choice finished with these counts (its siblings share the prompt)."""
        self.prompt_tokens = self.prompt_tokens or prompt_tokens
        self.cached_tokens = max(self.cached_tokens, cached_tokens)


class FanIn:
    """The n choices of one request as their progress comes (items with ``index``,
    ``new_token_ids``, ``new_logprobs``, ``finish_reason``, ``num_prompt_tokens`` and
    ``num_reused_tokens``, in any order of choices): each choice's tokens and logprobs so far,
    its last item once finished, and the request's usage."""

    def __init__(self, n: int):
        self.n = n
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[dict]] = [[] for _ in range(n)]
        self.final: dict = {}  # choice -> its finishing item
        self.usage = Usage()

    def add(self, item) -> None:
        self.token_ids[item.index] += item.new_token_ids
        self.logprobs[item.index] += item.new_logprobs or []
        self.usage.completion_tokens += len(item.new_token_ids)
        if item.finish_reason is not None:
            self.final[item.index] = item
            self.usage.finished(item.num_prompt_tokens, item.num_reused_tokens)

    @property
    def done(self) -> bool:
        return len(self.final) == self.n
