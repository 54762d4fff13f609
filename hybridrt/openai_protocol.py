"""The OpenAI HTTP API's shapes: request bodies -> prompts and SamplingParams, results ->
response bodies and stream chunks (``/v1/chat/completions``, ``/v1/completions``).

Request fields taken: model, messages / prompt, stream, stream_options.include_usage, n,
response_format (text, json_object, json_schema), structured_outputs (vLLM's: json, regex,
choice, grammar, json_object, structural_tag, disable_any_whitespace), tools, tool_choice,
parallel_tool_calls, temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty,
repetition_penalty, seed, stop, stop_token_ids, min_tokens, ignore_eos, skip_special_tokens,
include_stop_str_in_output, max_tokens / max_completion_tokens, logprobs / top_logprobs,
chat_template_kwargs (and enable_thinking as a shorthand for it), add_generation_prompt.
Fields left unset take the checkpoint's generation_config.json, as vLLM does. Other fields
are ignored, except the ones whose effect this server cannot give (tools, n > 1, echo, ...):
those are refused with a 400 naming the field. ``truncate_prompt_tokens`` (vLLM's) keeps the
last k prompt tokens (-1: as many as fit beside max_tokens).

Parsing is strict (``parse_body``): UTF-8 only, no NaN / Infinity, no lone surrogates, nesting
at most ``Limits.max_json_depth`` deep. ``Limits`` bounds what one request may cost before any
model work: see docs/server.md.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from hybridrt.sampling_params import MAX_N, SamplingParams, StructuredOutputsParams

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
                   "min_tokens", "ignore_eos", "skip_special_tokens",
                   "include_stop_str_in_output")
# fields with an effect this server does not give: refused rather than silently ignored
UNSUPPORTED = {"functions": "the legacy functions field (send tools)",
               "echo": "echo", "suffix": "suffix", "logit_bias": "logit_bias",
               "audio": "audio output"}
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_SEED = 2 ** 63 - 1


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; every field a ``hybridrt serve`` flag (docs/server.md).
    None: derived from the engine's max_model_len (``resolved``)."""

    max_body_bytes: int = 4 << 20  # --max-body-bytes: 413 beyond
    max_prompt_chars: int | None = None  # --max-prompt-chars; None: 32 x max_model_len
    max_prompt_tokens: int | None = None  # --max-prompt-tokens; None: max_model_len - 1
    max_messages: int = 512  # --max-messages
    max_stop: int = 16  # --max-stop: stop strings, and stop_token_ids
    max_stop_chars: int = 256  # --max-stop-chars: the longest stop string
    max_json_depth: int = 32  # --max-json-depth: nesting of the request body

    def resolved(self, max_model_len: int) -> Limits:
        from dataclasses import replace

        return replace(self, max_prompt_chars=32 * max_model_len if self.max_prompt_chars is None
                       else self.max_prompt_chars,
                       max_prompt_tokens=max_model_len - 1 if self.max_prompt_tokens is None
                       else min(self.max_prompt_tokens, max_model_len - 1))


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


def too_large(message: str, param: str | None = None) -> ApiError:
    return ApiError(413, message, param)


def parse_body(raw: bytes, max_depth: int) -> Any:
    """A request body -> its JSON value; 400 for anything but strict UTF-8 JSON nested at
    most ``max_depth`` deep, with no NaN / Infinity and no lone surrogates in any string."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise bad(f"the request body is nested more than {max_depth} deep") from None
    except (json.JSONDecodeError, ValueError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    _check_tree(body, max_depth)
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_tree(body: Any, max_depth: int) -> None:
    """Depth and strings of a parsed body, walked without recursion; the error's param is
    the top-level field the bad value is under."""
    stack = [(body, 1, None)]
    while stack:
        value, depth, top = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > max_depth:
                raise bad(f"the request body is nested more than {max_depth} deep", top)
            if isinstance(value, dict):
                for k, v in value.items():
                    _check_string(k, top or k)
                    stack.append((v, depth + 1, top or k))
            else:
                stack.extend((v, depth + 1, top) for v in value)
        elif isinstance(value, str):
            _check_string(value, top)


def _check_string(s: str, param: str | None) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad(f"{param or 'the body'}: a string holds a lone surrogate "
                      f"({s[e.start]!r}), not valid Unicode", param) from None


def check_limits(body: dict, limits: Limits) -> None:
    """The request's sizes against ``limits`` (resolved), before any tokenizing."""
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise bad(f"messages has {len(messages)} entries, over this server's limit of "
                  f"{limits.max_messages} (--max-messages)", "messages")
    for name in ("stop", "stop_token_ids"):
        value = body.get(name)
        if isinstance(value, list) and len(value) > limits.max_stop:
            raise bad(f"{name} has {len(value)} entries, over this server's limit of "
                      f"{limits.max_stop} (--max-stop)", name)
    stop = body.get("stop")
    for s in [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []:
        if isinstance(s, str) and len(s) > limits.max_stop_chars:
            raise bad(f"a stop string has {len(s)} characters, over this server's limit of "
                      f"{limits.max_stop_chars} (--max-stop-chars)", "stop")
    chars, param = _prompt_chars(body)
    if chars > limits.max_prompt_chars:
        raise bad(f"the prompt has {chars} characters, over this server's limit of "
                  f"{limits.max_prompt_chars} (--max-prompt-chars)", param)


def _prompt_chars(body: dict) -> tuple[int, str]:
    if "messages" in body:
        n = 0
        for m in body["messages"] if isinstance(body["messages"], list) else []:
            if not isinstance(m, dict):
                continue
            for key in ("content", "reasoning_content"):
                c = m.get(key)
                if isinstance(c, str):
                    n += len(c)
                elif isinstance(c, list):
                    n += sum(len(p["text"]) for p in c
                             if isinstance(p, dict) and isinstance(p.get("text"), str))
        return n, "messages"
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    return (len(p) if isinstance(p, str) else 0), "prompt"


# Requests ------------------------------------------------------------------------------------
def check_common(body: Any, served_model: str) -> None:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"model must be a string, got {type(model).__name__}", "model")
    if model is not None and model != served_model:
        raise ApiError(404, f"model {model!r} does not exist: this server serves "
                            f"{served_model!r}", "model", "not_found_error")
    for name, what in UNSUPPORTED.items():
        if body.get(name) not in (None, False, [], {}):
            raise bad(f"{name}: {what} is not supported by this server", name)
    n = body.get("n")
    if n is not None and not (_is_int(n) and 1 <= n <= MAX_N):
        raise bad(f"n must be an integer in [1, {MAX_N}], got {_short(n)}", "n")
    if body.get("best_of") not in (None, 1):
        raise bad(f"best_of must be 1, got {body['best_of']!r}", "best_of")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options")
    for name in ("stream", "add_generation_prompt", "enable_thinking"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad(f"{name} must be a boolean, got {_short(body[name])}", name)
    if opts is not None and opts.get("include_usage") is not None and \
            not isinstance(opts["include_usage"], bool):
        raise bad("stream_options.include_usage must be a boolean", "stream_options")
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed <= MAX_SEED):
        raise bad(f"seed must be an integer in [0, 2**63 - 1], got {_short(seed)}", "seed")
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and not (_is_int(truncate) and (truncate >= 1 or truncate == -1)):
        raise bad(f"truncate_prompt_tokens must be an integer >= 1 or -1, got "
                  f"{_short(truncate)}", "truncate_prompt_tokens")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    """A value for an error message, cut to 40 characters (it may be megabytes)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
        if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
            raise bad(f"logprobs must be a boolean, got {_short(body['logprobs'])}", "logprobs")
        if top is not None and not _is_int(top):
            raise bad(f"top_logprobs must be an integer, got {_short(top)}", "top_logprobs")
        if body.get("logprobs"):
            fields["logprobs"] = 0 if top is None else top
        elif top:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    elif body.get("logprobs") is not None:
        fields["logprobs"] = body["logprobs"]
    if body.get("n") is not None:
        fields["n"] = body["n"]
    so = structured_outputs(body)
    if so is not None:
        fields["structured_outputs"] = so
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as e:
        msg = str(e)
        if len(msg) > 300:  # it may quote a megabyte of the value
            msg = msg[:297] + "..."
        param = next((n for n in (*SAMPLING_FIELDS, "max_tokens", "logprobs")
                      if msg.startswith(n)), None)
        raise bad(msg, param) from None


def structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """``response_format`` (json_object; json_schema with its ``schema``, ``strict`` taken:
    the output always matches the schema) or vLLM's ``structured_outputs`` object -> the
    constraint; None for neither (or response_format text). Both at once: 400."""
    fmt, extra = body.get("response_format"), body.get("structured_outputs")
    so = None
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                                "json_schema"):
            raise bad("response_format must be {'type': 'text' | 'json_object' | "
                      "'json_schema', ...}", "response_format")
        if fmt["type"] == "json_object":
            so = StructuredOutputsParams(json_object=True)
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise bad("response_format.json_schema must be {'name': ..., 'schema': {...}, "
                          "'strict': ...}", "response_format")
            if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
                raise bad("response_format.json_schema.strict must be a boolean",
                          "response_format")
            schema = spec.get("schema")
            so = StructuredOutputsParams(json=schema if schema else {"type": "object"})
    if extra is not None:
        if so is not None:
            raise bad("send either response_format or structured_outputs, not both",
                      "structured_outputs")
        if not isinstance(extra, dict):
            raise bad("structured_outputs must be an object", "structured_outputs")
        known = set(StructuredOutputsParams.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise bad(f"structured_outputs: unknown fields {unknown}", "structured_outputs")
        try:
            so = StructuredOutputsParams(**{k: v for k, v in extra.items() if v is not None})
        except ValueError as e:
            raise bad(str(e), "structured_outputs") from None
    return so


def chat_tools(body: dict) -> tuple[list[dict] | None, str | dict, bool]:
    """``tools``, ``tool_choice``, ``parallel_tool_calls`` -> (tools or None, the choice,
    whether several calls may be made); 400 naming the field."""
    from hybridrt.tool_calls import check_tool_choice, check_tools

    tools = body.get("tools")
    try:
        tools = check_tools(tools) if tools else None
    except ValueError as e:
        raise bad(str(e), "tools") from None
    try:
        choice = check_tool_choice(body.get("tool_choice"), tools)
    except ValueError as e:
        raise bad(str(e), "tool_choice") from None
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    return tools, choice, parallel


def chat_messages(body: dict, images: bool = False) -> list[dict]:
    """``messages`` -> the list the chat template takes (text content parts joined; with
    ``images``, a content holding ``{"type": "image"}`` or ``{"type": "video"}`` parts stays a
    list of text and media parts, as hybridrt.vision.inputs.chat_media leaves it)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {'role', 'content'} objects",
                  "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        if m["role"] not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                      f"{_short(m['role'])}", "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if images and p in ({"type": "image"}, {"type": "video"}):
                    parts.append(p)
                    continue
                if not isinstance(p, dict) or p.get("type") != "text" or \
                        not isinstance(p.get("text"), str):
                    raise bad(f"messages[{i}].content: only text parts are supported",
                              "messages")
                parts.append(p["text"])
            if any(isinstance(p, dict) for p in parts):
                content = [p if isinstance(p, dict) else {"type": "text", "text": p}
                           for p in parts]
            else:
                content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts",
                      "messages")
        msg = {"role": m["role"], "content": content}
        if isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        calls = m.get("tool_calls")
        if calls is not None and m["role"] == "assistant":
            if not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) for c in calls):
                raise bad(f"messages[{i}].tool_calls must be a list of {{'id', 'type', "
                          f"'function': {{'name', 'arguments'}}}}", "messages")
            msg["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    try:
        from hybridrt.tool_calls import template_messages

        return template_messages(out)
    except ValueError as e:
        raise bad(f"messages: {e}", "messages") from None


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
               logprobs: dict | None = None, index: int = 0) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish}]}


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None = None,
                     logprobs: dict | None = None, index: int = 0) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": use}


def now() -> int:
    return int(time.time())
