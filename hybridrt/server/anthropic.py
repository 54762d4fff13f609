"""Anthropic's Messages API on the chat completions' path: ``POST /v1/messages`` (translated
by hybridrt.server.anthropic_request) answered as a ``message`` of content blocks (thinking,
text, tool_use; hybridrt.server.content_blocks), or streamed as the SDK's events
(``message_start``, ``ping``, ``content_block_start`` / ``_delta`` (text_delta,
thinking_delta, input_json_delta) / ``_stop``, ``message_delta``, ``message_stop``), with
``stop_reason`` end_turn / max_tokens / stop_sequence / tool_use and ``usage`` whose
``cache_read_input_tokens`` are the prompt's tokens taken from the prefix cache (its
``input_tokens`` the rest). A tool call the output ended inside is no tool_use block: the
answer stops with ``max_tokens``. Errors are Anthropic's ``{"type": "error", "error": ...}``.
"""

from __future__ import annotations

import json
import logging

from hybridrt import openai_protocol as api
from hybridrt.output_pipeline import FanIn, holdback
from hybridrt.server.anthropic_request import translate
from hybridrt.server.content_blocks import Block, ContentBlocks
from hybridrt.server.errors import as_api_error, internal_error
from hybridrt.server.job import Job

__all__ = ["translate", "count_request", "answer", "events", "error_body"]

log = logging.getLogger("hybridrt.server")
KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
         500: "api_error"}


def count_request(body) -> tuple[dict, dict]:
    """/v1/messages/count_tokens: a Messages body without max_tokens -> its chat body."""
    chat, echo = translate(body, need_max_tokens=False)
    chat["max_tokens"], chat["stream"] = 1, False
    return chat, echo


def error_body(e: api.ApiError) -> dict:
    """An ApiError as Anthropic's error body."""
    kind = KINDS.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def _block(b: Block) -> dict:
    if b.kind == "thinking":
        return {"type": "thinking", "thinking": b.text, "signature": ""}
    if b.kind == "text":
        return {"type": "text", "text": b.text}
    return {"type": "tool_use", "id": b.call.id, "name": b.call.name,
            "input": json.loads(b.text) if b.text else {}}


def _start(b: Block) -> dict:
    if b.kind == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if b.kind == "text":
        return {"type": "text", "text": ""}
    return {"type": "tool_use", "id": b.call.id, "name": b.call.name, "input": {}}


def _delta(b: Block, text: str) -> dict:
    if b.kind == "thinking":
        return {"type": "thinking_delta", "thinking": text}
    if b.kind == "text":
        return {"type": "text_delta", "text": text}
    return {"type": "input_json_delta", "partial_json": text}


def stop_reason(item, blocks: ContentBlocks) -> tuple[str, str | None]:
    """-> (stop_reason, stop_sequence) of a finished output."""
    if item.finish_reason == "length":
        return "max_tokens", None
    if blocks.called:
        return "tool_use", None
    if isinstance(item.stop_reason, str):
        return "stop_sequence", item.stop_reason
    return "end_turn", None


def _usage(fan_in: FanIn) -> dict:
    u = fan_in.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens,
            "output_tokens": u.completion_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached_tokens}


def _message(job: Job, model: str, content: list, usage: dict, reason=(None, None)) -> dict:
    return {"id": job.id.replace("chatcmpl-", "msg_"), "type": "message", "role": "assistant",
            "model": model, "content": content, "stop_reason": reason[0],
            "stop_sequence": reason[1], "usage": usage}


def answer(server, job: Job, fan_in: FanIn) -> dict:
    """A non-streaming Messages answer (one choice)."""
    item = fan_in.final[0]
    blocks = ContentBlocks(job.shape)
    blocks.feed(item.text, True)
    content = [_block(b) for b in blocks.blocks if b.complete]
    return _message(job, server.model_name, content, _usage(fan_in),
                    stop_reason(item, blocks))


def _sse(kind: str, obj: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **obj}, ensure_ascii=False)}\n\n"


async def events(server, handles: list, item, job: Job):
    """The server-sent events of a streaming Messages request, from its first progress
    ``item`` on. Closing it (a client that went away) aborts the request."""
    blocks = ContentBlocks(job.shape, holdback(job.params))
    fan_in = FanIn(1)
    finished = False
    cut: set[int] = set()  # blocks of calls the output ended inside: no more of them is sent
    try:
        yield _sse("message_start", {"message": _message(job, server.model_name, [], {
            "input_tokens": len(job.ids), "output_tokens": 0, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0})})
        yield _sse("ping", {})
        while True:
            if item.error is not None:
                yield _sse("error", error_body(as_api_error(item.error)))
                break
            done = item.finish_reason is not None
            fan_in.add(item)
            for ev in blocks.feed(item.text, done):
                i = ev.block.index
                if ev.type == "start":
                    yield _sse("content_block_start", {"index": i,
                                                       "content_block": _start(ev.block)})
                elif ev.type == "delta" and not ev.cut and i not in cut:
                    yield _sse("content_block_delta", {"index": i,
                                                       "delta": _delta(ev.block, ev.delta)})
                elif ev.type == "stop" or ev.cut:
                    if ev.cut:
                        cut.add(i)
                    if ev.type == "stop":
                        yield _sse("content_block_stop", {"index": i})
            if done:
                reason, seq = stop_reason(item, blocks)
                yield _sse("message_delta", {"delta": {"stop_reason": reason,
                                                       "stop_sequence": seq},
                                             "usage": _usage(fan_in)})
                yield _sse("message_stop", {})
                break
            item = await handles[0].queue.get()
        finished = True
    except Exception:  # a bug: end the stream with an error event, not a reset connection
        log.exception("unexpected error in a stream")
        yield _sse("error", error_body(internal_error()))
    finally:
        if not finished:
            server.abort(handles)
