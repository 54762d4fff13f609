"""Bounded JSON numbers for every grammar that writes JSON (response_format / json_schema,
json_object, tool-call arguments): a weak model under an unbounded ``integer`` writes digit
after digit until max_tokens (llama.cpp bounds them to 16 digits for the same reason).

``bound_numbers(schema)``: every integer the schema allows without a bound of its own gets one
(``INT_LIMIT``: 19 digits, within int64), every number too, and a number without a
``multipleOf`` is held to ``NUMBER_STEP`` (9 decimals, no exponent), so its digits are bounded
as well. ``ANY_JSON_OBJECT``: json_object's schema with the same bounds on the values inside.
"""

from __future__ import annotations

from typing import Any

INT_LIMIT = 10 ** 18  # the largest magnitude of an unbounded integer or number: within int64
NUMBER_STEP = 1e-9  # an unbounded number's resolution: at most 9 decimals
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMAS = ("items", "additionalProperties", "contains", "if", "then", "else",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def bound_numbers(schema: Any) -> Any:
    """``schema`` with a bound on each of its unbounded integers and numbers, at any depth
    (the input is not changed)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: bound_numbers(v) for k, v in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = bound_numbers(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bound_numbers(v) for v in out[key]]
    types = out.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if ("integer" in types or "number" in types) and not {"enum", "const"} & out.keys():
        if not {"minimum", "exclusiveMinimum"} & out.keys():
            out["minimum"] = -INT_LIMIT
        if not {"maximum", "exclusiveMaximum"} & out.keys():
            out["maximum"] = INT_LIMIT
        if "number" in types and "multipleOf" not in out:
            out["multipleOf"] = NUMBER_STEP
    return out


_VALUE = {"$ref": "#/$defs/value"}
ANY_JSON_OBJECT = {
    "$defs": {"value": {"anyOf": [
        {"type": "string"}, {"type": "boolean"}, {"type": "null"},
        bound_numbers({"type": "integer"}), bound_numbers({"type": "number"}),
        {"type": "array", "items": _VALUE},
        {"type": "object", "additionalProperties": _VALUE}]}},
    "type": "object", "additionalProperties": _VALUE}
