"""Thinking models: the think block of an output apart from its answer.

An output thinks when its prompt leaves a ``<think>`` block open (Qwen3.5's template with
thinking on) or when it starts with ``<think>`` itself (the demo model's). Its reasoning is the
text up to the first ``</think>``, its answer the rest; both without the tags and without the
whitespace around the tags. An output that does not think has no reasoning (None) and its
text unchanged. The same splitter serves finished outputs and streams, so the streamed pieces
join to exactly the final ``reasoning_text`` and ``text``.
"""

from __future__ import annotations

OPEN_THINK, CLOSE_THINK = "<think>", "</think>"
TOOL_CALL = "<tool_call>"  # with tools, a call begun in the think block ends it (vLLM #39056)


class ReasoningDelta(str):
    """A streamed piece of the think block (``LLM.stream`` yields plain ``str`` for the
    answer)."""

    __slots__ = ()


def opens_thinking(prompt_text: str) -> bool:
    """Whether the prompt leaves a <think> block open (the model continues inside it)."""
    return prompt_text.rfind(OPEN_THINK) > prompt_text.rfind(CLOSE_THINK)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1)
                 if tag.startswith(text[-n:])), 0)


class ReasoningSplitter:
    """Feed an output's text delta by delta -> pieces: ReasoningDelta for the think block,
    str for the answer. Text that may be the start of a tag, and whitespace that may precede
    ``</think>``, is held back until the next delta tells."""

    def __init__(self, prompt_opens_thinking: bool = False, tool_calls: bool = False):
        self.state = "think" if prompt_opens_thinking else "start"
        self.tool_calls = tool_calls  # "<tool_call>" ends the think block too, and stays
        self.thinks = prompt_opens_thinking  # did this output think (then reasoning is a str)
        self._buf = ""
        self._lead = True  # at the start of a section: its leading whitespace is dropped

    def feed(self, text: str) -> list[str]:
        self._buf += text
        out: list[str] = []
        while self._buf:
            if self.state == "start":
                head = self._buf.lstrip()
                if head.startswith(OPEN_THINK):
                    self._buf = head[len(OPEN_THINK):]
                    self.state, self.thinks, self._lead = "think", True, True
                    continue
                if not head or OPEN_THINK.startswith(head):
                    break  # maybe the start of <think>: wait for more
                self.state = "plain"
                continue
            if self.state == "think":
                if self._lead:
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        break
                    self._lead = False
                at = self._buf.find(CLOSE_THINK)
                call = self._buf.find(TOOL_CALL) if self.tool_calls else -1
                if call >= 0 and (at < 0 or call < at):  # the model calls a tool mid-thought
                    piece = self._buf[:call].rstrip()
                    if piece:
                        out.append(ReasoningDelta(piece))
                    self._buf = self._buf[call:]
                    self.state, self._lead = "answer", False
                    continue
                if at >= 0:
                    piece = self._buf[:at].rstrip()
                    if piece:
                        out.append(ReasoningDelta(piece))
                    self._buf = self._buf[at + len(CLOSE_THINK):]
                    self.state, self._lead = "answer", True
                    continue
                keep = _partial_tag(self._buf, CLOSE_THINK)
                if self.tool_calls:
                    keep = max(keep, _partial_tag(self._buf, TOOL_CALL))
                body = self._buf[:len(self._buf) - keep]
                ready = body.rstrip()  # trailing whitespace may come right before </think>
                if ready:
                    out.append(ReasoningDelta(ready))
                self._buf = self._buf[len(ready):]
                break
            if self.state == "answer" and self._lead:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._lead = False
            out.append(self._buf)  # the answer, or an output that does not think
            self._buf = ""
        return out

    def flush(self) -> list[str]:
        """The end of the output: what was held back, as it is."""
        rest, self._buf = self._buf, ""
        if self.state == "think":
            rest = rest.strip() if self._lead else rest.rstrip()
            return [ReasoningDelta(rest)] if rest else []
        if self.state == "answer" and self._lead:
            rest = rest.lstrip()
        return [rest] if rest else []


def split_reasoning(text: str, prompt_opens_thinking: bool = False,
                    tool_calls: bool = False) -> tuple[str | None, str]:
    """A finished output's text -> (reasoning or None when it does not think, answer);
    ``tool_calls``: a ``<tool_call>`` inside the think block ends it (ReasoningSplitter)."""
    s = ReasoningSplitter(prompt_opens_thinking, tool_calls)
    pieces = s.feed(text) + s.flush()
    reasoning = "".join(p for p in pieces if isinstance(p, ReasoningDelta))
    answer = "".join(p for p in pieces if not isinstance(p, ReasoningDelta))
    return (reasoning if s.thinks else None), answer
