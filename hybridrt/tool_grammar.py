"""Qwen3.5's tool calls as a Lark grammar (llguidance's ``tool_choice`` required / named).

The calls are written as the chat template writes them and ``tool_calls.ToolCallParser`` reads
them::

    <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>

calls joined by one newline, parameters in the order of the schema's properties (required ones
always, optional ones where the model writes them). A value is constrained by its parameter's
schema as ``typed_value`` reads it: a string parameter is text up to the first
``</parameter>`` (its enum / const as literals, its pattern as a regex, min/maxLength as a
length); any other is JSON under the schema, laid out as ``json.dumps`` does, its integers and
numbers without bounds bounded (hybridrt.json_bounds: 19 digits, within int64; 9 decimals) and
an array without maxItems held to ``MAX_ARRAY_ITEMS``, so a weak model cannot write digits or
items for ever. With thinking on, the reasoning comes first: any text without ``<think>`` or
``</think>``, then ``</think>`` and a blank line.
"""

from __future__ import annotations

import json
from typing import Any

from hybridrt.json_bounds import bound_numbers
from hybridrt.tool_calls import (
    CALL_CLOSE,
    CALL_OPEN,
    FUNC_CLOSE,
    FUNC_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
    _types,
)

MAX_ARRAY_ITEMS = 16  # items of an array parameter whose schema sets no maxItems
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# text up to and with the first "\n</parameter>\n": no "</parameter>" before the last one
_VALUE_END = "\\n<\\/parameter>\\n"
_NO_EARLIER_CLOSE = "~/(?s:.*)<\\/parameter>(?s:.{2,})/"


def tool_lark(tools: list[dict], named: bool, thinking: bool, parallel: bool) -> str:
    """The Lark grammar of ``tools``' calls: one call of the only tool when ``named``, else
    one or more (one when not ``parallel``), after the think block when ``thinking``."""
    rules, funcs = [], []
    for i, t in enumerate(tools):
        f = t["function"]
        params = f.get("parameters") or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        parts = []
        for j, (name, schema) in enumerate(props.items()):
            rule = f"p{i}_{j}"
            rules += _param_rules(rule, name, schema)
            parts.append(rule if name in required else rule + "?")
        head = _lit(f"{CALL_OPEN}\n{FUNC_OPEN}{f['name']}>\n")
        tail = _lit(f"{FUNC_CLOSE}\n{CALL_CLOSE}")
        rules.append(f"f{i}: {' '.join([head, *parts, tail])}")
        funcs.append(f"f{i}")
    calls = 'call ("\\n" call)*' if parallel and not named else "call"
    lines = [f"start: {'THINK ' if thinking else ''}{calls}", f"call: {' | '.join(funcs)}"]
    if thinking:
        lines.append('THINK: (/(?s:.*)/ & ~/(?s:.*)<\\/?think>(?s:.*)/) "</think>\\n\\n"')
    return "\n".join(lines + rules) + "\n"


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _param_rules(rule: str, name: str, schema: Any) -> list[str]:
    """The rules of one parameter: its tag, its value, its closing tag."""
    head = _lit(f"{PARAM_OPEN}{name}>\n")
    types = _types(schema)
    schema = schema if isinstance(schema, dict) else {}
    if not types or ("string" in types and not {"object", "array"} & set(types)):
        return [f"{rule}: {head} {rule.upper()}", f"{rule.upper()}: {_text(schema)}"]
    schema = bound_numbers(schema)
    if types == ["array"] and "maxItems" not in schema:
        schema = {**schema, "maxItems": max(MAX_ARRAY_ITEMS, schema.get("minItems", 0))}
    value = json.dumps({**schema, "x-guidance": JSON_LAYOUT}, ensure_ascii=False)
    close = _lit(f"\n{PARAM_CLOSE}\n")
    return [f"{rule}: {head} {rule}_v {close}",
            f"{rule}_v: %json {value}"]


def _text(schema: dict) -> str:
    """A string parameter's value and closing tag, as one terminal (a value ends at the first
    closing tag, which a greedy lexer can only see inside one terminal)."""
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        words = [v for v in values if isinstance(v, str)]
        if words:
            return "(" + " | ".join(_lit(w) for w in words) + ') "\\n</parameter>\\n"'
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    length = f"(?s:.{{{int(lo)},{'' if hi is None else int(hi)}}})"
    body = f"/{length}{_VALUE_END}/ & {_NO_EARLIER_CLOSE}"
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        from llguidance import regex_to_lark

        core = pattern.removeprefix("^").removesuffix("$")
        body += f" & /(?:{regex_to_lark(core, 'dw')}){_VALUE_END}/"
    return body
