"""The OpenAI HTTP API's shapes: request bodies -> prompts and SamplingParams, results ->
response bodies and stream chunks (``/v1/chat/completions``, ``/v1/completions``).

Request fields taken: model, messages / prompt, stream, stream_options.include_usage, n (1),
temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty, repetition_penalty,
seed, stop, stop_token_ids, min_tokens, ignore_eos, skip_special_tokens,
include_stop_str_in_output, max_tokens / max_completion_tokens, logprobs / top_logprobs,
chat_template_kwargs (and enable_thinking as a shorthand for it), add_generation_prompt.
Fields left unset take the checkpoint's generation_config.json, as vLLM does. Other fields
are ignored, except the ones whose effect this server cannot give (tools, n > 1, echo, ...):
those are refused with a 400 naming the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from hybridrt.sampling_params import SamplingParams

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
                   "min_tokens", "ignore_eos", "skip_special_tokens",
                   "include_stop_str_in_output")
# fields with an effect this server does not give: refused rather than silently ignored
UNSUPPORTED = {"tools": "tools / function calling", "functions": "function calling",
               "echo": "echo", "suffix": "suffix", "logit_bias": "logit_bias",
               "audio": "audio output"}


class ApiError(Exception):
    """A request the server answers with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


# Requests ------------------------------------------------------------------------------------
def check_common(body: Any, served_model: str) -> None:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(404, f"model {model!r} does not exist: this server serves "
                            f"{served_model!r}", "model", "not_found_error")
    for name, what in UNSUPPORTED.items():
        if body.get(name) not in (None, False, [], {}):
            raise bad(f"{name}: {what} is not supported by this server", name)
    n = body.get("n", 1)
    if n not in (None, 1):
        raise bad(f"n must be 1 (one choice per request), got {n!r}", "n")
    if body.get("best_of") not in (None, 1):
        raise bad(f"best_of must be 1, got {body['best_of']!r}", "best_of")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("response_format: only {'type': 'text'} is supported", "response_format")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options")
    if not isinstance(body.get("stream", False), bool):
        raise bad(f"stream must be a boolean, got {body['stream']!r}", "stream")


def sampling_params(body: dict, defaults: dict, chat: bool) -> SamplingParams:
    """The request's sampling fields over the checkpoint's defaults -> SamplingParams;
    a bad value -> 400 with SamplingParams' message."""
    fields = dict(defaults)
    for name in SAMPLING_FIELDS:
        if body.get(name) is not None:
            fields[name] = body[name]
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        if body.get(name) is not None:
            fields["max_tokens"] = body[name]
            break
    if chat:
        top = body.get("top_logprobs")
        if body.get("logprobs"):
            fields["logprobs"] = 0 if top is None else top
        elif top:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    elif body.get("logprobs") is not None:
        fields["logprobs"] = body["logprobs"]
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as e:
        msg = str(e)
        param = next((n for n in (*SAMPLING_FIELDS, "max_tokens", "logprobs")
                      if msg.startswith(n)), None)
        raise bad(msg, param) from None


def chat_messages(body: dict) -> list[dict]:
    """``messages`` -> the list the chat template takes (text content parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {'role', 'content'} objects",
                  "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or \
                        not isinstance(p.get("text"), str):
                    raise bad(f"messages[{i}].content: only text parts are supported",
                              "messages")
                parts.append(p["text"])
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts",
                      "messages")
        msg = {"role": m["role"], "content": content}
        if isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        out.append(msg)
    return out


def template_kwargs(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs must be an object", "chat_template_kwargs")
    kwargs = dict(kwargs)
    if body.get("enable_thinking") is not None:
        kwargs["enable_thinking"] = body["enable_thinking"]
    return kwargs


def completion_prompt(body: dict) -> str | list[int]:
    """``prompt``: a string or token ids (or a list holding one of them)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str) and p:
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in p):
        return p
    raise bad("prompt must be a non-empty string or a non-empty list of token ids (one "
              "prompt per request)", "prompt")


# Responses -----------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(num_prompt: int, num_generated: int, num_reused: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_generated,
            "total_tokens": num_prompt + num_generated,
            "prompt_tokens_details": {"cached_tokens": num_reused}}


def _ranked(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n]


def chat_logprobs(token_ids: list[int], entries: list[dict], n: int, piece) -> dict:
    """The chat ``logprobs`` object of some output tokens; ``piece(id)`` -> its text."""
    def one(t: int, lp: float) -> dict:
        s = piece(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**one(t, e[t]), "top_logprobs": [one(u, lp) for u, lp in
                                                          _ranked(e, n)]}
                        for t, e in zip(token_ids, entries)]}


def completion_logprobs(token_ids: list[int], entries: list[dict], n: int, piece,
                        offset: int) -> dict:
    """The completions ``logprobs`` object; ``offset``: text length before these tokens."""
    tokens = [piece(t) for t in token_ids]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [e[t] for t, e in zip(token_ids, entries)],
            "top_logprobs": [{piece(u): lp for u, lp in _ranked(e, n)} for e in entries],
            "text_offset": offsets}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None = None,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish}]}


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None = None,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                         "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": use}


def now() -> int:
    return int(time.time())
