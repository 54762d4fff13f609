"""Tool calling in Qwen3.5's format: the calls parsed out of an answer, and the grammar that
makes a model call a tool.

Qwen3.5's chat template (the checkpoint's ``chat_template``) asks for calls as XML, the format
vLLM's ``qwen3_coder`` parser reads::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's text, stripped of the whitespace around it, becomes a typed JSON value by the
tool's JSON schema (``typed_value``): strings stay as they are, integers, numbers, booleans,
null, objects and arrays are parsed.

``ToolCallParser`` reads an answer delta by delta: text outside calls passes through (held
back while it may be the start of ``<tool_call>``), a call yields its name as soon as
``<function=NAME>`` is complete, then its arguments as JSON fragments, one per complete
parameter, closed by ``}`` at ``</function>``. The fragments of a call join to
``json.dumps`` of its arguments, so a stream reassembles to the non-streaming answer
(``parse_tool_calls`` is the same parser fed at once). A call the output ends inside (cut by
``max_tokens``) is left incomplete (``ToolCall.complete`` False): its arguments are the raw
text so far, never closed by ``}`` nor re-typed, so no client takes it for a valid call.

``tool_choice`` (``tool_constraint``): ``"none"`` and ``"auto"`` leave generation free;
``"required"`` and a named function constrain it, so that the output is one or more
well-formed calls whose arguments match the tool's schema (for ``"required"`` nothing but
calls; for a named one exactly that call; integers and numbers bounded, hybridrt.json_bounds):
with llguidance by a Lark grammar of the calls
(``hybridrt.tool_grammar``), with xgrammar by its Qwen3.5 structural tag.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from hybridrt.sampling_params import StructuredOutputsParams

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
# whitespace xgrammar's call tag allows around tags and values (the template's calls have one
# newline there, the Lark of llguidance exactly that): a weak model otherwise fills each gap
# with as much as it may
MAX_XML_WHITESPACE = 2


@dataclass(slots=True)
class ToolCall:
    """One call, OpenAI's shape: ``arguments`` is a JSON object's text once ``complete``
    (closed by ``</function>``); an incomplete call's is the raw text the output ended in."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: str = "function"
    complete: bool = False

    def as_openai(self) -> dict:
        return {"id": self.id, "type": self.type,
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ToolDelta:
    """A streamed piece of call ``index``: its name (the first delta of a call, with its id)
    or a fragment of its arguments; ``cut``: the raw end of a call the output ended inside."""

    index: int
    name: str | None = None
    id: str | None = None
    arguments: str = ""
    cut: bool = False

    def as_openai(self) -> dict:
        d: dict[str, Any] = {"index": self.index}
        if self.name is not None:
            d.update(id=self.id, type="function",
                     function={"name": self.name, "arguments": self.arguments})
        else:
            d["function"] = {"arguments": self.arguments}
        return d


# Tools and tool_choice -----------------------------------------------------------------------
def check_tools(tools: Any) -> list[dict]:
    """``tools`` (OpenAI's list of {"type": "function", "function": {...}}) -> the list;
    ValueError naming what is wrong."""
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {...}}")
    names = set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or \
                not isinstance(t.get("function"), dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        f = t["function"]
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        if f["name"] in names:
            raise ValueError(f"tools[{i}]: the function name {f['name']!r} is given twice")
        names.add(f["name"])
    return tools


def check_tool_choice(tool_choice: Any, tools: list[dict] | None) -> str | dict:
    """-> "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
    (None: "auto" with tools, "none" without); ValueError for anything else."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not tools:
            raise ValueError("tool_choice 'required' needs tools")
        return tool_choice
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and \
            isinstance(tool_choice.get("function"), dict) and \
            isinstance(tool_choice["function"].get("name"), str):
        name = tool_choice["function"]["name"]
        if name not in {t["function"]["name"] for t in tools or []}:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
        return {"type": "function", "function": {"name": name}}
    raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                     "'function': {'name': ...}}")


def tool_constraint(tools: list[dict], tool_choice: str | dict, thinking: bool,
                    parallel: bool = True, engine: str | None = None
                    ) -> StructuredOutputsParams | None:
    """The constraint that makes the output a call (``required``: one or more calls and
    nothing else; named: exactly that call), after the think block when the prompt opens
    one; None for "none" and "auto". ``engine``: the grammar engine it is for (None:
    ``HYBRIDRT_GRAMMAR_ENGINE``'s; ValueError naming the extra when none is installed)."""
    if tool_choice in ("none", "auto"):
        return None
    from hybridrt.grammar_engine import engine_name

    engine = engine or engine_name()
    forced = tools if tool_choice == "required" else [
        t for t in tools if t["function"]["name"] == tool_choice["function"]["name"]]
    from hybridrt.json_bounds import bound_numbers

    normalized = [{"type": "function", "function": {
        "name": t["function"]["name"],
        "parameters": bound_numbers(t["function"].get("parameters") or
                                    {"type": "object", "properties": {}}),
    }} for t in forced]
    if engine == "llguidance":
        from hybridrt.tool_grammar import tool_lark

        return StructuredOutputsParams(grammar=tool_lark(
            normalized, named=tool_choice != "required", thinking=thinking, parallel=parallel))
    import xgrammar as xgr

    tag = xgr.get_model_structural_tag(
        "qwen_3_5", tools=normalized, tool_choice=tool_choice,
        reasoning="enabled" if thinking else "disabled", max_whitespace_cnt=MAX_XML_WHITESPACE,
        parallel_tool_calls=parallel).model_dump(mode="json")
    if tool_choice == "required":  # only calls: no free text before or between them
        tag["format"] = _only_calls(tag["format"], parallel)
    return StructuredOutputsParams(structural_tag=tag)


def _only_calls(fmt: dict, parallel: bool) -> dict:
    """xgrammar's "required" allows free text before a call, which a weak model may never
    leave: the calls' ``triggered_tags`` replaced by the same tags, newline-separated."""
    if fmt.get("type") == "triggered_tags":
        return {"type": "tags_with_separator", "tags": fmt["tags"], "separator": "\n",
                "at_least_one": True, "stop_after_first": not parallel}
    if fmt.get("type") == "sequence":
        return {**fmt, "elements": [_only_calls(e, parallel) for e in fmt["elements"]]}
    return fmt


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages for the chat template: an assistant's ``tool_calls`` arguments as a dict
    (OpenAI clients send its JSON text; the template iterates over its items)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            fixed = []
            for c in calls:
                c = dict(c)
                f = dict(c.get("function") or {})
                args = f.get("arguments")
                if isinstance(args, str):
                    try:
                        f["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise ValueError(f"a tool call's arguments are not JSON: "
                                         f"{args[:40]!r}") from None
                if not isinstance(f.get("arguments", {}), dict):
                    raise ValueError("a tool call's arguments must be a JSON object")
                c["function"] = f
                fixed.append(c)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


# Typed arguments -----------------------------------------------------------------------------
def _types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    out = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            out += _types(sub)
    if "enum" in schema and not out:
        out = ["enum"]
    if "properties" in schema and not out:
        out = ["object"]
    return out


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema says (vLLM's qwen3_coder rules): a
    string stays text; integer, number, boolean, null, object, array are parsed (text that
    does not parse stays a string); without a type, JSON if it parses, else the text."""
    types = _types(schema)
    if "string" in types and not any(t in types for t in ("object", "array")):
        if text == "null" and "null" in types:
            return None
        return text
    s = text.strip()
    for t in types or ["any"]:
        if t == "integer":
            try:
                return int(s)
            except ValueError:
                continue
        if t == "number":
            try:
                v = float(s)
            except ValueError:
                continue
            return int(v) if v.is_integer() and "." not in s and "e" not in s.lower() else v
        if t == "boolean" and s.lower() in ("true", "false"):
            return s.lower() == "true"
        if t == "null" and s.lower() in ("null", "none"):
            return None
        if t in ("object", "array", "enum", "any"):
            try:
                return json.loads(s)
            except ValueError:
                continue
    return text


def _param_schemas(tools: list[dict] | None) -> dict[str, dict]:
    out = {}
    for t in tools or []:
        f = t.get("function") or {}
        props = (f.get("parameters") or {}).get("properties") or {}
        out[f.get("name")] = props if isinstance(props, dict) else {}
    return out


# Parsing -------------------------------------------------------------------------------------
def _partial(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1)
                 if tag.startswith(text[-n:])), 0)


class ToolCallParser:
    """Feed an answer's text delta by delta -> (content text, [ToolDelta]). ``tools``: the
    request's tools (the parameter types come from their schemas)."""

    def __init__(self, tools: list[dict] | None):
        self.schemas = _param_schemas(tools)
        self.calls: list[ToolCall] = []  # every call begun, its arguments so far
        self._args: list[dict] = []
        self._buf = ""
        self._state = "text"  # text | call (inside <tool_call>) | func | param
        self._param: str | None = None
        self._content: list[str] = []

    @property
    def content(self) -> str:
        """The text outside calls so far."""
        return "".join(self._content)

    def feed(self, text: str) -> tuple[str, list[ToolDelta]]:
        self._buf += text
        out_text, deltas = [], []
        while True:
            if self._state == "text":
                at = self._buf.find(CALL_OPEN)
                if at < 0:
                    keep = _partial(self._buf, CALL_OPEN)
                    out_text.append(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                out_text.append(self._buf[:at])
                self._buf = self._buf[at + len(CALL_OPEN):]
                self._state = "call"
            elif self._state == "call":  # after <tool_call>: wait for <function=NAME>
                at = self._buf.find(FUNC_OPEN)
                end = self._buf.find(">", at + len(FUNC_OPEN)) if at >= 0 else -1
                closed = self._buf.find(CALL_CLOSE)
                if closed >= 0 and (at < 0 or closed < at):  # a call without a function
                    self._buf, self._state = self._buf[closed + len(CALL_CLOSE):], "text"
                    continue
                if end < 0:
                    break
                name = self._buf[at + len(FUNC_OPEN):end].strip()
                self._buf = self._buf[end + 1:]
                call = ToolCall(name, "")
                self.calls.append(call)
                self._args.append({})
                deltas.append(ToolDelta(len(self.calls) - 1, name, call.id))
                self._state = "func"
            elif self._state == "func":  # inside <function=...>: parameters or its end
                p = self._buf.find(PARAM_OPEN)
                f = self._buf.find(FUNC_CLOSE)
                if f >= 0 and (p < 0 or f < p):
                    self._buf = self._buf[f + len(FUNC_CLOSE):]
                    deltas.append(self._close_call())
                    self._state = "after"
                    continue
                end = self._buf.find(">", p + len(PARAM_OPEN)) if p >= 0 else -1
                if end < 0:
                    break
                self._param = self._buf[p + len(PARAM_OPEN):end].strip()
                self._buf = self._buf[end + 1:]
                self._state = "param"
            elif self._state == "param":
                at = self._buf.find(PARAM_CLOSE)
                if at < 0:
                    break
                deltas.append(self._add_param(self._buf[:at]))
                self._buf = self._buf[at + len(PARAM_CLOSE):]
                self._state = "func"
            else:  # "after": </function> seen, </tool_call> expected
                at = self._buf.find(CALL_CLOSE)
                if at < 0:
                    if self._buf.strip() and not CALL_CLOSE.startswith(self._buf.strip()):
                        self._state = "text"  # not the closing tag: plain text again
                        continue
                    break
                self._buf = self._buf[at + len(CALL_CLOSE):]
                self._state = "text"
        content = "".join(out_text)
        self._content.append(content)
        return content, [d for d in deltas if d is not None]

    def flush(self) -> tuple[str, list[ToolDelta]]:
        """The end of the answer: text held back; a call left open stays incomplete (a
        parameter cut off by max_tokens is added as its raw text, and nothing closes it)."""
        text, deltas = "", []
        if self._state == "text":
            text, self._buf = self._buf, ""
        elif self._state == "param":
            deltas.append(self._cut_param(self._buf))
        self._state, self._buf = "text", ""
        self._content.append(text)
        return text, [d for d in deltas if d is not None]

    def _add_param(self, raw: str) -> ToolDelta:
        # the template writes one newline around a value, and the call grammar allows a
        # little whitespace there: a value is the text between, stripped
        value = raw.strip()
        idx = len(self.calls) - 1
        schema = self.schemas.get(self.calls[idx].name, {}).get(self._param)
        args = self._args[idx]
        sep = "{" if not args else ", "
        args[self._param] = typed_value(value, schema)
        piece = sep + json.dumps(self._param, ensure_ascii=False) + ": " + \
            json.dumps(args[self._param], ensure_ascii=False)
        self.calls[idx].arguments += piece
        return ToolDelta(idx, arguments=piece)

    def _cut_param(self, raw: str) -> ToolDelta:
        """A parameter the output ended inside: its name and raw text (less a partial closing
        tag), a string's without its closing quote: the arguments stay unparseable."""
        raw = raw[:len(raw) - _partial(raw, PARAM_CLOSE)].strip()
        idx = len(self.calls) - 1
        schema = self.schemas.get(self.calls[idx].name, {}).get(self._param)
        value = json.dumps(raw, ensure_ascii=False)[:-1] if "string" in _types(schema) else raw
        piece = ("{" if not self._args[idx] else ", ") + \
            json.dumps(self._param, ensure_ascii=False) + ": " + value
        self.calls[idx].arguments += piece
        return ToolDelta(idx, arguments=piece, cut=True)

    def _close_call(self) -> ToolDelta:
        idx = len(self.calls) - 1
        piece = "}" if self._args[idx] else "{}"
        self.calls[idx].arguments += piece
        self.calls[idx].complete = True
        return ToolDelta(idx, arguments=piece)


def parse_tool_calls(text: str, tools: list[dict] | None) -> tuple[str | None, list[ToolCall]]:
    """A whole answer -> (its text outside calls, stripped, or None when empty; the calls)."""
    p = ToolCallParser(tools)
    p.feed(text)
    p.flush()
    content = p.content.strip()
    return (content or None), p.calls
