"""An Anthropic Messages request (``POST /v1/messages``) -> the chat completion body it asks
for, so that it runs on the chat completions' path (hybridrt.server.prepare: the same
template, limits, prefix cache, constraints) and nothing of its own.

Taken: model, max_tokens (required), system (a string or text blocks), messages (text,
thinking, tool_use and tool_result blocks), tools (``input_schema``), tool_choice (auto, any,
tool, none; ``disable_parallel_tool_use``), thinking (enabled, adaptive / disabled: the
template's enable_thinking), output_config.format (json_schema: the chat's response_format),
stop_sequences, temperature, top_p, top_k, stream, metadata (its user_id has no effect on
generation), and ``seed`` (hybridrt's, as in chat completions). ``thinking.budget_tokens`` is
checked but not enforced apart: the think block counts within max_tokens.
Image blocks of a user turn (``source`` base64 or url) become the chat's ``image_url`` parts,
so a model with a vision tower reads them and one without refuses them (hybridrt.vision).
Refused with a 400 naming the field: a missing max_tokens, document blocks, unknown block
types, a tool_result for an id no earlier tool_use gave, server tools, a final assistant
message (prefill), and fields whose effect this server cannot give (mcp_servers, container,
context_management).
"""

from __future__ import annotations

import json
from typing import Any

from hybridrt import openai_protocol as api

UNSUPPORTED = {"mcp_servers": "MCP servers", "container": "code-execution containers",
               "context_management": "context management"}
ROLES = ("user", "assistant")


def translate(body: Any, need_max_tokens: bool = True) -> tuple[dict, dict]:
    """The Messages body -> (the chat completion body, what the answer echoes)."""
    if not isinstance(body, dict):
        raise api.bad("the request body must be a JSON object")
    for name, what in UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}):
            raise api.bad(f"{name}: {what} are not supported by this server", name)
    chat: dict[str, Any] = {"model": body.get("model")}
    if "max_tokens" not in body:
        if need_max_tokens:
            raise api.bad("max_tokens: field required", "max_tokens")
    else:
        mt = body["max_tokens"]
        if not (isinstance(mt, int) and not isinstance(mt, bool) and mt >= 1):
            raise api.bad(f"max_tokens must be an integer >= 1, got {api._short(mt)}",
                          "max_tokens")
        chat["max_tokens"] = mt
    for name in ("temperature", "top_p", "top_k", "stream", "seed"):
        if body.get(name) is not None:
            chat[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise api.bad("stop_sequences must be a list of non-empty strings",
                          "stop_sequences")
        chat["stop"] = stops
    meta = body.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise api.bad("metadata must be an object", "metadata")
    thinking = _thinking(body.get("thinking"), chat.get("max_tokens"))
    if thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking}
    fmt = _output_format(body.get("output_config"))
    if fmt is not None:
        chat["response_format"] = fmt
    chat["messages"] = _system(body.get("system")) + _messages(body.get("messages"))
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    _tool_choice(body.get("tool_choice"), chat)
    return chat, {"model": chat["model"]}


def _thinking(value: Any, max_tokens: int | None) -> bool | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "disabled":
        return False
    if kind == "adaptive":  # the model decides how much to think: Qwen3.5 thinks
        return True
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if not (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1):
            raise api.bad("thinking.budget_tokens must be an integer >= 1", "thinking")
        if max_tokens is not None and budget >= max_tokens:
            raise api.bad(f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                          f"({max_tokens})", "thinking")
        return True
    raise api.bad("thinking must be {'type': 'enabled', 'budget_tokens': N}, "
                  "{'type': 'adaptive'} or {'type': 'disabled'}", "thinking")


def _output_format(config: Any) -> dict | None:
    """``output_config.format`` (json_schema) -> the chat's response_format; its ``effort``
    is a hint with no effect here."""
    if config is None:
        return None
    fmt = config.get("format") if isinstance(config, dict) else None
    if fmt is None and isinstance(config, dict):
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or \
            not isinstance(fmt.get("schema"), dict):
        raise api.bad("output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                      "output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _text_of(blocks: Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise api.bad(f"{where} must be a string or a list of text blocks", where)
    parts = []
    for b in blocks:
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append(b["text"])
        else:
            raise api.bad(f"{where}: {_refusal(kind)}", where)
    return "".join(parts)


def _refusal(kind: Any) -> str:
    if kind == "image":
        return "image blocks are taken in user turns only"
    if kind == "document":
        return "document blocks are not supported: the model reads text and images"
    return f"unsupported block type {api._short(kind)} here"


def _system(system: Any) -> list[dict]:
    if system is None:
        return []
    text = _text_of(system, "system")
    return [{"role": "system", "content": text}] if text else []


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise api.bad("messages must be a non-empty list of {'role', 'content'} objects",
                      "messages")
    out: list[dict] = []
    known: set[str] = set()  # the ids of the tool_use blocks so far
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise api.bad(f"{where} must be an object with role 'user' or 'assistant'",
                          "messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise api.bad(f"{where}.content must be a string or a list of blocks", "messages")
        if m["role"] == "user":
            out += _user(content, where, known)
        else:
            out.append(_assistant(content, where, known))
    if out[-1]["role"] == "assistant":
        raise api.bad("the last message is the assistant's: continuing it (prefill) is not "
                      "supported by this server", "messages")
    return out


def _user(blocks: list, where: str, known: set[str]) -> list[dict]:
    """A user turn: its tool results (tool messages), then its text (with its images: OpenAI
    content parts, in their order)."""
    tools, text, parts = [], [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {
                "url": _image_url(b.get("source"), f"{where}.content[{j}]")}})
        elif kind == "tool_result":
            tid = b.get("tool_use_id")
            if not isinstance(tid, str) or tid not in known:
                raise api.bad(f"{where}.content[{j}]: tool_result for the unknown tool_use_id "
                              f"{api._short(tid)} (no earlier tool_use block has it)",
                              "messages")
            result = _text_of(b.get("content", ""), f"{where}.content[{j}].content")
            if b.get("is_error"):
                result = f"Error: {result}"
            tools.append({"role": "tool", "tool_call_id": tid, "content": result})
        else:
            raise api.bad(f"{where}.content[{j}]: {_refusal(kind)}", "messages")
    if len(parts) > len(text):  # images: the parts, as a chat completion sends them
        return tools + [{"role": "user", "content": parts}]
    return tools + ([{"role": "user", "content": "".join(text)}] if text or not tools else [])


def _image_url(source: Any, where: str) -> str:
    """An image block's source -> the URL of an OpenAI ``image_url`` part (a data URL for
    base64; a url source as it is, which the chat path allows or refuses)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and \
            isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise api.bad(f"{where}.source must be {{'type': 'base64', 'media_type': ..., 'data': ...}} "
                  f"or {{'type': 'url', 'url': ...}}", "messages")


def _assistant(blocks: list, where: str, known: set[str]) -> dict:
    text, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            reasoning.append(b["thinking"])
        elif kind == "tool_use" and isinstance(b.get("id"), str) and \
                isinstance(b.get("name"), str) and isinstance(b.get("input", {}), dict):
            known.add(b["id"])
            calls.append({"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
        else:
            raise api.bad(f"{where}.content[{j}]: {_refusal(kind)} (or a field missing)",
                          "messages")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise api.bad("tools must be a list of {'name', 'description', 'input_schema'}",
                      "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            kind = t.get("type") if isinstance(t, dict) else None
            raise api.bad(f"tools[{i}]: server tools ({api._short(kind)}) are not supported "
                          f"by this server: give custom tools with an input_schema", "tools")
        if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
            raise api.bad(f"tools[{i}] must have a string name and an input_schema object",
                          "tools")
        f = {"name": t["name"]}  # in OpenAI's order: the template renders the tools as JSON
        if isinstance(t.get("description"), str):
            f["description"] = t["description"]
        f["parameters"] = t["input_schema"]
        out.append({"type": "function", "function": f})
    return out


def _tool_choice(choice: Any, chat: dict) -> None:
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise api.bad("tool_choice must be {'type': 'auto' | 'any' | 'tool' | 'none'}",
                      "tool_choice")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise api.bad("tool_choice {'type': 'tool'} needs the tool's name", "tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        chat["tool_choice"] = {"any": "required"}.get(kind, kind)
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise api.bad("tool_choice.disable_parallel_tool_use must be a boolean",
                          "tool_choice")
        chat["parallel_tool_calls"] = not parallel
