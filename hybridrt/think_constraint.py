"""A constraint that starts after the think block: for a prompt that leaves ``<think>`` open
(Qwen3.5's template with thinking on), a json_schema, json_object, regex or choice constraint
applied from the first output token would force the answer into the reasoning (vLLM #44012,
#50948). ``after_think(so)`` is the same constraint behind a free think block: any text
without ``<think>`` or ``</think>``, then ``</think>`` and a blank line, as the template
writes it; forced tool calls do the same in their own grammar (hybridrt.tool_grammar). A
``grammar`` or ``structural_tag`` is the client's own and stays as it is (it may describe the
think block itself).

llguidance takes it as a Lark grammar (``%json`` with the schema's bounds and layout, as
hybridrt.grammar_engine compiles a plain one); xgrammar as a structural tag.
"""

from __future__ import annotations

import json

from hybridrt.grammar_engine import MAX_JSON_WHITESPACE, choice_grammar, strict_schema
from hybridrt.json_bounds import ANY_JSON_OBJECT, bound_numbers
from hybridrt.sampling_params import StructuredOutputsParams

THINK_LARK = 'THINK: (/(?s:.*)/ & ~/(?s:.*)<\\/?think>(?s:.*)/) "</think>\\n\\n"'
WRAPPED = ("json", "json_object", "regex", "choice")


def after_think(so: StructuredOutputsParams, engine: str | None = None
                ) -> StructuredOutputsParams:
    """``so`` behind a free think block (json, json_object, regex, choice; others as they
    are). ``engine``: the grammar engine it is for (None: ``HYBRIDRT_GRAMMAR_ENGINE``'s)."""
    if so.kind not in WRAPPED:
        return so
    from hybridrt.grammar_engine import engine_name

    engine = engine or engine_name()
    if engine == "llguidance":
        return StructuredOutputsParams(grammar=f"start: THINK body\n{THINK_LARK}\n"
                                               f"body: {_lark_body(so)}\n")
    return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {
        "type": "sequence", "elements": [
            {"type": "tag", "begin": "", "end": "</think>",
             "content": {"type": "any_text", "excludes": ["<think>", "</think>"]}},
            {"type": "const_string", "value": "\n\n"}, _xgrammar_body(so)]}})


def _schema(so: StructuredOutputsParams) -> dict:
    if so.kind == "json_object":
        return ANY_JSON_OBJECT
    schema = json.loads(so.json) if isinstance(so.json, str) else so.json
    return bound_numbers(schema)


def _lark_body(so: StructuredOutputsParams) -> str:
    if so.kind == "choice":
        return " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice)
    if so.kind == "regex":
        from llguidance import regex_to_lark

        return f"/{regex_to_lark(so.regex)}/"
    schema = strict_schema(_schema(so))
    if so.disable_any_whitespace:
        layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    else:
        layout = {"whitespace_flexible": True,
                  "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,%d}" % MAX_JSON_WHITESPACE}  # noqa: UP031
    return "%json " + json.dumps({**schema, "x-guidance": layout}, ensure_ascii=False)


def _xgrammar_body(so: StructuredOutputsParams) -> dict:
    if so.kind == "choice":
        return {"type": "grammar", "grammar": choice_grammar(so.choice)}
    if so.kind == "regex":
        return {"type": "regex", "pattern": so.regex}
    return {"type": "json_schema", "json_schema": _schema(so)}
