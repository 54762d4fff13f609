"""An OpenAI Responses request (``POST /v1/responses``) -> the chat completion body it asks
for, so that it runs on the chat completions' path (hybridrt.server.prepare). Stateless, as
ollama's and llama.cpp's: each request carries its whole conversation.

Taken: model, input (a string, or items: messages with text parts, ``function_call``,
``function_call_output``, ``reasoning``; a user message's ``input_image`` parts with an
``image_url`` become the chat's image parts, hybridrt.vision), instructions (a system message
first), tools
(``function``), tool_choice, parallel_tool_calls, text.format (text, json_schema,
json_object), reasoning.effort (``none``: thinking off; another effort: on; absent: the
template's default), max_output_tokens, temperature, top_p, stream, truncation (``auto``:
the oldest tokens are cut to fit), ``seed`` (hybridrt's, as in chat completions), and store,
metadata, user, include (no effect: nothing is stored).
Refused with a 400 naming the field: previous_response_id and conversation (nothing is
stored), background, tools other than functions, input files, a
function_call_output for an unknown call_id, and unknown item types.
"""

from __future__ import annotations

import json
from typing import Any

from hybridrt import openai_protocol as api

UNSUPPORTED = {"previous_response_id": "this server is stateless: send the whole conversation "
                                       "in input",
               "conversation": "this server is stateless: send the whole conversation in "
                               "input",
               "background": "background responses are not supported",
               "prompt": "stored prompts are not supported"}
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def translate(body: Any) -> tuple[dict, dict]:
    """The Responses body -> (the chat completion body, what the answer echoes)."""
    if not isinstance(body, dict):
        raise api.bad("the request body must be a JSON object")
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, False, ""):
            raise api.bad(f"{name}: {why}", name)
    chat: dict[str, Any] = {"model": body.get("model")}
    for name in ("temperature", "top_p", "stream", "parallel_tool_calls", "seed"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise api.bad("truncation must be 'auto' or 'disabled'", "truncation")
    if truncation == "auto":
        chat["truncate_prompt_tokens"] = -1
    effort = _effort(body.get("reasoning"))
    if effort is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise api.bad("instructions must be a string", "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat["messages"] = system + _input(body.get("input"))
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise api.bad("tool_choice must be 'none', 'auto', 'required' or {'type': "
                          "'function', 'name': ...}", "tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "tool_choice": choice if choice is not None else "auto",
            "tools": body.get("tools") or [], "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "metadata": body.get("metadata") or {},
            "text": body.get("text") or {"format": {"type": "text"}},
            "reasoning": {"effort": effort, "summary": None},
            "truncation": truncation or "disabled", "model": chat["model"]}
    return chat, echo


def _effort(reasoning: Any) -> str | None:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise api.bad("reasoning must be an object {'effort': ...}", "reasoning")
    effort = reasoning.get("effort")
    if effort is not None and effort not in ("none", "minimal", "low", "medium", "high",
                                              "xhigh"):
        raise api.bad(f"reasoning.effort must be none, minimal, low, medium, high or xhigh, "
                      f"got {api._short(effort)}", "reasoning")
    return effort


def _format(text: Any) -> dict | None:
    if not isinstance(text, dict) and text is not None:
        raise api.bad("text must be an object {'format': ...}", "text")
    fmt = (text or {}).get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "output"), "schema": fmt["schema"],
            "strict": fmt.get("strict")}}
    raise api.bad("text.format must be {'type': 'text' | 'json_object'} or {'type': "
                  "'json_schema', 'name': ..., 'schema': {...}}", "text")


def _text(content: Any, where: str, images: bool = False) -> str | list[dict]:
    """A message's content -> its text; with ``images`` (a user message), input_image parts
    make it a list of OpenAI content parts (``image_url``), as a chat completion sends them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise api.bad(f"{where}.content must be a string or a list of text parts", "input")
    parts, texts = [], []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if images and kind == "input_image":
            url = p.get("image_url")
            if not isinstance(url, str):
                raise api.bad(f"{where}.content[{j}]: an input_image needs an image_url (a "
                              f"data URL; file_id is not supported)", "input")
            parts.append({"type": "image_url", "image_url": {"url": url}})
            continue
        value = p.get("refusal" if kind == "refusal" else "text") if kind else None
        if kind not in TEXT_PARTS or not isinstance(value, str):
            what = "files are" if kind == "input_file" else \
                "images are (in user messages only)" if kind == "input_image" else \
                f"the part type {api._short(kind)} is"
            raise api.bad(f"{where}.content[{j}]: {what} not supported", "input")
        texts.append(value)
        parts.append({"type": "text", "text": value})
    return parts if len(parts) > len(texts) else "".join(texts)


def _input(items: Any) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise api.bad("input must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    known: set[str] = set()
    reasoning: list[str] = []  # reasoning items, for the next assistant message
    for i, it in enumerate(items):
        where = f"input[{i}]"
        kind = it.get("type", "message") if isinstance(it, dict) else None
        if kind == "message":
            if it.get("role") not in ROLES:
                raise api.bad(f"{where}.role must be one of {', '.join(ROLES)}", "input")
            msg = {"role": it["role"], "content": _text(it.get("content"), where,
                                                        images=it["role"] == "user")}
            if it["role"] == "assistant":
                _assistant(out, reasoning)["content"] += msg["content"]
            else:
                out.append(msg)
        elif kind == "function_call":
            if not isinstance(it.get("call_id"), str) or not isinstance(it.get("name"), str) \
                    or not isinstance(it.get("arguments"), str):
                raise api.bad(f"{where}: a function_call needs call_id, name and arguments "
                              f"(strings)", "input")
            known.add(it["call_id"])
            _assistant(out, reasoning).setdefault("tool_calls", []).append({
                "id": it["call_id"], "type": "function",
                "function": {"name": it["name"], "arguments": it["arguments"]}})
        elif kind == "function_call_output":
            cid = it.get("call_id")
            if cid not in known:
                raise api.bad(f"{where}: function_call_output for the unknown call_id "
                              f"{api._short(cid)} (no earlier function_call has it)", "input")
            output = it.get("output")
            out.append({"role": "tool", "tool_call_id": cid,
                        "content": output if isinstance(output, str) else
                        _text(output, where) if isinstance(output, list) else
                        json.dumps(output)})
        elif kind == "reasoning":
            parts = it.get("content") or it.get("summary") or []
            if not isinstance(parts, list):
                raise api.bad(f"{where}: a reasoning item's content must be a list", "input")
            reasoning.append("".join(p["text"] for p in parts if isinstance(p, dict)
                                     and isinstance(p.get("text"), str)))
        else:
            raise api.bad(f"{where}: the item type {api._short(kind)} is not supported",
                          "input")
    return out


def _assistant(out: list[dict], reasoning: list[str]) -> dict:
    """The assistant message a function_call or output text belongs to (the last one, or a
    new one after anything else), with the reasoning items before it."""
    if out and out[-1]["role"] == "assistant" and not reasoning:
        return out[-1]
    msg = {"role": "assistant", "content": ""}
    if reasoning:
        msg["reasoning_content"] = "\n".join(reasoning)
        reasoning.clear()
    out.append(msg)
    return msg


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise api.bad("tools must be a list of {'type': 'function', 'name', 'parameters'}",
                      "tools")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise api.bad(f"tools[{i}]: {api._short(kind)} tools are not supported by this "
                          f"server (function tools only)", "tools")
        if not isinstance(t.get("name"), str):
            raise api.bad(f"tools[{i}].name must be a string", "tools")
        f = {"name": t["name"]}  # in OpenAI's order: the template renders the tools as JSON
        if isinstance(t.get("description"), str):
            f["description"] = t["description"]
        f["parameters"] = t.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": f})
    return out
