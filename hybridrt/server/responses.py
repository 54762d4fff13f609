"""OpenAI's Responses API on the chat completions' path: ``POST /v1/responses`` (translated by
hybridrt.server.responses_request) answered as a ``response`` whose output items are the
output's content blocks (hybridrt.server.content_blocks): ``reasoning`` (the think block),
``message`` (output_text) and ``function_call``; or streamed as the documented events
(``response.created``, ``response.in_progress``, ``response.output_item.added`` / ``.done``,
``response.content_part.added`` / ``.done``, ``response.output_text.delta`` / ``.done``,
``response.reasoning_text.delta`` / ``.done``, ``response.function_call_arguments.delta`` /
``.done``, then ``response.completed`` or ``response.incomplete``), each with its
``sequence_number``. An output cut by max_output_tokens is ``status: "incomplete"`` with
``incomplete_details.reason`` "max_output_tokens", and a call it ended inside is a
function_call of status "incomplete" whose arguments are the raw text so far.
"""

from __future__ import annotations

import json
import logging

from hybridrt import openai_protocol as api
from hybridrt.output_pipeline import FanIn, holdback
from hybridrt.server.content_blocks import Block, ContentBlocks
from hybridrt.server.errors import as_api_error, internal_error
from hybridrt.server.job import Job
from hybridrt.server.responses_request import translate

__all__ = ["translate", "answer", "events", "error_body"]

log = logging.getLogger("hybridrt.server")


def error_body(e: api.ApiError) -> dict:
    """An ApiError as OpenAI's error body."""
    return e.body()


def _item_id(job: Job, b: Block) -> str:
    prefix = {"thinking": "rs", "text": "msg", "tool_use": "fc"}[b.kind]
    return f"{prefix}_{job.id.removeprefix('chatcmpl-')}_{b.index}"


def _item(job: Job, b: Block, done: bool) -> dict:
    """A block as an output item (``done``: as finished, else as just added)."""
    iid = _item_id(job, b)
    if b.kind == "thinking":
        return {"type": "reasoning", "id": iid, "summary": [],
                "content": [{"type": "reasoning_text", "text": b.text}] if done else []}
    if b.kind == "text":
        return {"type": "message", "id": iid, "role": "assistant",
                "status": "completed" if done else "in_progress",
                "content": [_part(b.text)] if done else []}
    status = "in_progress" if not done else "completed" if b.complete else "incomplete"
    return {"type": "function_call", "id": iid, "call_id": b.call.id, "name": b.call.name,
            "arguments": b.text if done else "", "status": status}


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(server, fan_in: FanIn, blocks: ContentBlocks) -> dict:
    u = fan_in.usage
    thought = "".join(b.text for b in blocks.blocks if b.kind == "thinking")
    reasoning = len(server.tokenizer.encode(thought, add_special_tokens=False)) \
        if thought and server.tokenizer is not None else 0
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning,
                                                              u.completion_tokens)},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _response(server, job: Job, status: str, output: list, usage: dict | None,
              incomplete: bool = False) -> dict:
    e = job.api
    return {"id": job.id.replace("chatcmpl-", "resp_"), "object": "response",
            "created_at": job.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": e["instructions"], "max_output_tokens": e["max_output_tokens"],
            "model": server.model_name, "output": output,
            "parallel_tool_calls": e["parallel_tool_calls"], "previous_response_id": None,
            "reasoning": e["reasoning"], "store": False, "temperature": e["temperature"],
            "text": e["text"], "tool_choice": e["tool_choice"], "tools": e["tools"],
            "top_p": e["top_p"], "truncation": e["truncation"], "metadata": e["metadata"],
            "usage": usage}


def answer(server, job: Job, fan_in: FanIn) -> dict:
    """A non-streaming Responses answer."""
    item = fan_in.final[0]
    blocks = ContentBlocks(job.shape)
    blocks.feed(item.text, True)
    cut = item.finish_reason == "length"
    return _response(server, job, "incomplete" if cut else "completed",
                     [_item(job, b, True) for b in blocks.blocks],
                     _usage(server, fan_in, blocks), cut)


class _Events:
    """A stream's events, numbered."""

    def __init__(self):
        self.n = 0

    def __call__(self, kind: str, **fields) -> str:
        obj = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return f"event: {kind}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _block_events(emit: _Events, job: Job, ev) -> list[str]:
    b, i = ev.block, ev.block.index
    iid = _item_id(job, b)
    if ev.type == "start":
        out = [emit("response.output_item.added", output_index=i, item=_item(job, b, False))]
        if b.kind == "text":
            out.append(emit("response.content_part.added", item_id=iid, output_index=i,
                            content_index=0, part=_part("")))
        return out
    if ev.type == "delta":
        if b.kind == "thinking":
            return [emit("response.reasoning_text.delta", item_id=iid, output_index=i,
                         content_index=0, delta=ev.delta)]
        if b.kind == "text":
            return [emit("response.output_text.delta", item_id=iid, output_index=i,
                         content_index=0, delta=ev.delta, logprobs=[])]
        return [emit("response.function_call_arguments.delta", item_id=iid, output_index=i,
                     delta=ev.delta)]
    if b.kind == "thinking":
        out = [emit("response.reasoning_text.done", item_id=iid, output_index=i,
                    content_index=0, text=b.text)]
    elif b.kind == "text":
        out = [emit("response.output_text.done", item_id=iid, output_index=i, content_index=0,
                    text=b.text, logprobs=[]),
               emit("response.content_part.done", item_id=iid, output_index=i,
                    content_index=0, part=_part(b.text))]
    else:
        out = [emit("response.function_call_arguments.done", item_id=iid, output_index=i,
                    name=b.call.name, arguments=b.text)]
    return out + [emit("response.output_item.done", output_index=i, item=_item(job, b, True))]


async def events(server, handles: list, item, job: Job):
    """The server-sent events of a streaming Responses request, from its first progress
    ``item`` on. Closing it (a client that went away) aborts the request."""
    blocks = ContentBlocks(job.shape, holdback(job.params))
    fan_in = FanIn(1)
    emit = _Events()
    finished = False
    try:
        for kind in ("response.created", "response.in_progress"):
            yield emit(kind, response=_response(server, job, "in_progress", [], None))
        while True:
            if item.error is not None:
                e = as_api_error(item.error)
                yield emit("error", code=e.kind, message=e.message, param=e.param)
                break
            done = item.finish_reason is not None
            fan_in.add(item)
            for ev in blocks.feed(item.text, done):
                for text in _block_events(emit, job, ev):
                    yield text
            if done:
                cut = item.finish_reason == "length"
                output = [_item(job, b, True) for b in blocks.blocks]
                yield emit("response.incomplete" if cut else "response.completed",
                           response=_response(server, job, "incomplete" if cut else
                                              "completed", output,
                                              _usage(server, fan_in, blocks), cut))
                break
            item = await handles[0].queue.get()
        finished = True
    except Exception:  # a bug: end the stream with an error event, not a reset connection
        log.exception("unexpected error in a stream")
        e = internal_error()
        yield emit("error", code=e.kind, message=e.message, param=None)
    finally:
        if not finished:
            server.abort(handles)
