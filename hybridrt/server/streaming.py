"""A streaming request's server-sent events: its n choices' progress, shaped by
hybridrt.output_pipeline (text held back from a stop string, reasoning apart, tool calls
piece by piece), as OpenAI's chunks; then a usage chunk when asked, then ``[DONE]``."""

from __future__ import annotations

import json
import logging

from hybridrt import openai_protocol as api
from hybridrt.output_pipeline import ChoiceStream, FanIn, finish_reason, holdback
from hybridrt.server.errors import as_api_error, internal_error
from hybridrt.server.job import Job

log = logging.getLogger("hybridrt.server")


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def events(server, handles: list, item, job: Job, chat: bool):
    """Server-sent events of one streaming request (its n choices interleaved, each chunk
    naming its choice), from its first progress ``item`` on; ``server``: the one it runs on
    (its model name, logprobs and aborts). Closing it (a client that went away) aborts the
    request."""
    rid, created, model = job.id, job.created, server.model_name
    n = len(handles)
    streams = [ChoiceStream(job.shape, holdback(job.params)) for _ in range(n)]
    fan_in = FanIn(n)
    finished = False
    try:
        if chat:
            for i in range(n):
                yield sse(api.chat_chunk(rid, model, created, {"role": "assistant",
                                                               "content": ""}, index=i))
        while True:
            i, stream = item.index, streams[item.index]
            done = item.finish_reason is not None
            if item.error is not None:
                yield sse(as_api_error(item.error).body())
                break
            text = stream.feed(item.text, done)
            lps = server.logprobs(chat, item.new_token_ids, item.new_logprobs, job.top,
                                  stream.sent - len(text))
            fan_in.add(item)
            if chat:
                delta = stream.delta(text, done)
                if delta or lps:
                    yield sse(api.chat_chunk(rid, model, created, delta or {"content": ""},
                                             logprobs=lps, index=i))
                if done:
                    reason = finish_reason(item.finish_reason, stream.called)
                    yield sse(api.chat_chunk(rid, model, created, {}, reason, index=i))
            elif text or lps or done:
                yield sse(api.completion_chunk(rid, model, created, text,
                                               item.finish_reason if done else None, lps,
                                               index=i))
            if fan_in.done:
                if job.usage:
                    obj = "chat.completion.chunk" if chat else "text_completion"
                    u = fan_in.usage
                    yield sse(api.usage_chunk(rid, model, created, obj, api.usage(
                        u.prompt_tokens, u.completion_tokens, u.cached_tokens)))
                break
            item = await handles[0].queue.get()
        finished = True
        yield "data: [DONE]\n\n"
    except Exception:  # a bug: end the stream with an error event, not a reset connection
        log.exception("unexpected error in a stream")
        yield sse(internal_error().body())
    finally:
        if not finished:
            server.abort(handles)
