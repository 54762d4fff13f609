"""An output as content blocks, the unit the Anthropic Messages and OpenAI Responses APIs
answer in: its think block, its text and its tool calls, each a ``Block`` opened, grown by
deltas and closed in the order the output wrote them. Built on the chat completions'
pipeline (hybridrt.output_pipeline.ChoiceStream: stop-string hold-back, the think block apart,
tool calls parsed), so the three APIs read an output alike; fed at once it gives a
non-streaming answer, fed piece by piece the events of a stream that joins to the same blocks.

An output that thinks starts with a thinking block (empty when its think block is). Text
blocks drop the whitespace at their ends (as a chat message's content is stripped); a
tool call's block grows by its arguments' JSON fragments; a call the output ended inside is
``complete`` False (hybridrt.tool_calls), its last fragment marked ``cut``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridrt.output_pipeline import ChoiceStream, Shape
from hybridrt.reasoning import ReasoningDelta
from hybridrt.tool_calls import ToolCall, ToolDelta


@dataclass(slots=True)
class Block:
    """One content block: ``kind`` "thinking", "text" or "tool_use"; ``index``: its place
    among the output's blocks; ``text``: its text so far (a call's arguments); ``call``: a
    tool_use block's call (hybridrt.tool_calls.ToolCall)."""

    kind: str
    index: int
    text: str = ""
    call: ToolCall | None = None

    @property
    def complete(self) -> bool:
        """A tool call closed by the output (other blocks always are)."""
        return self.call is None or self.call.complete


@dataclass(slots=True)
class Event:
    """``type`` "start", "delta" (``delta``: the new text; ``cut``: the raw end of a call
    the output ended inside) or "stop" of ``block``."""

    type: str
    block: Block
    delta: str = ""
    cut: bool = False


class ContentBlocks:
    """One output's blocks: ``feed(text so far, done)`` -> the events its new text makes;
    ``blocks``: all blocks so far. ``shape``: the request's (thinking, tools, parallel);
    ``holdback``: characters a stop string may still cut off."""

    def __init__(self, shape: Shape, holdback: int = 0):
        self.stream = ChoiceStream(shape, holdback)
        self.parallel = shape.parallel
        self.blocks: list[Block] = []
        self.open: Block | None = None
        self._space = ""  # whitespace at the end of the open text block, shown if text follows
        self._calls: dict[int, Block] = {}
        self._thought = False  # the think block has its block (an empty one too)

    @property
    def called(self) -> bool:
        """The output made at least one complete call."""
        return any(b.complete for b in self._calls.values())

    def feed(self, text: str, done: bool) -> list[Event]:
        events: list[Event] = []
        new = self.stream.feed(text, done)
        parser = self.stream.parser
        for piece in self.stream.split(new, done):
            if isinstance(piece, ReasoningDelta):
                self._grow(events, "thinking", piece)
                continue
            self._think_block(events)
            if parser is None:
                self._text(events, piece)
            else:
                content, deltas = parser.feed(piece)
                self._text(events, content)
                self._calls_of(events, deltas)
        if done:
            self._think_block(events)
            if parser is not None:
                rest, deltas = parser.flush()
                self._text(events, rest)
                self._calls_of(events, deltas)
            self._close(events)
        return events

    def _think_block(self, events: list[Event]) -> None:
        """An output that thinks has a thinking block first, empty when its think block
        is."""
        if self.stream.splitter.thinks and not self._thought:
            self._thought = True
            self._start(events, "thinking")

    def _close(self, events: list[Event]) -> None:
        if self.open is not None:
            events.append(Event("stop", self.open))
            self.open, self._space = None, ""

    def _start(self, events: list[Event], kind: str, call: ToolCall | None = None) -> Block:
        self._close(events)
        block = Block(kind, len(self.blocks), call=call)
        self.blocks.append(block)
        self.open = block
        events.append(Event("start", block))
        return block

    def _grow(self, events: list[Event], kind: str, text: str) -> None:
        if self.open is None or self.open.kind != kind:
            self._start(events, kind)
            self._thought = self._thought or kind == "thinking"
        self.open.text += text
        events.append(Event("delta", self.open, text))

    def _text(self, events: list[Event], text: str) -> None:
        """Answer text: a block opened by its first non-space character, its trailing
        whitespace held until more text follows."""
        if not text:
            return
        if self.open is None or self.open.kind != "text":
            text = text.lstrip()
            if not text:
                return
            self._start(events, "text")
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if body:
            self.open.text += body
            events.append(Event("delta", self.open, body))

    def _calls_of(self, events: list[Event], deltas: list[ToolDelta]) -> None:
        parser = self.stream.parser
        for d in deltas:
            if d.index > 0 and not self.parallel:
                continue  # the first call only
            if d.name is not None:
                block = self._start(events, "tool_use", parser.calls[d.index])
                self._calls[d.index] = block
            block = self._calls[d.index]
            if d.arguments:
                block.text += d.arguments
                events.append(Event("delta", block, d.arguments, d.cut))
