"""The two grammar engines behind ``StructuredOutputs``: llguidance (the default) and xgrammar.

``engine_name()`` picks one by ``HYBRIDRT_GRAMMAR_ENGINE`` (auto: llguidance when installed,
else xgrammar; docs/structured_outputs.md says why). ``make_engine(name, ...)`` prepares it for
a tokenizer (the whole vocabulary is read once); an engine then compiles a
``StructuredOutputsParams`` (``compile``: ValueError with its reason) and makes a request's
matcher from what it compiled (``matcher``). A matcher has xgrammar's ``GrammarMatcher``
methods, which ``RequestGrammar`` calls: ``accept_token``, ``is_terminated``,
``fill_next_token_bitmask(bitmask, row)``, ``rollback(n)``; a token it refuses leaves it as it
was.

| engine | extra | constraints |
| --- | --- | --- |
| llguidance | structured | json, json_object, regex, choice, grammar (GBNF or Lark) |
| xgrammar | xgrammar | the same (grammar: EBNF / GBNF), and structural_tag |
"""

from __future__ import annotations

import functools
import importlib
import json
import re
from collections.abc import Sequence
from typing import Any

from hybridrt import env

EXTRAS = {"llguidance": "structured", "xgrammar": "xgrammar"}  # engine -> its extra, auto order
# the longest run of whitespace between JSON tokens (llama.cpp's JSON grammars allow about as
# much): pretty-printing stays possible, and a model cannot loop on whitespace for ever
MAX_JSON_WHITESPACE = 20
NO_ENGINE = ("structured outputs (response_format, structured_outputs, tool_choice required or "
             "a named function) need a grammar engine, which the serve extra leaves out: "
             "pip install 'hybridrt[structured]'")


def engine_name(environ=None) -> str:
    """The grammar engine to use: HYBRIDRT_GRAMMAR_ENGINE's, or (auto) the first installed of
    llguidance, xgrammar; ValueError of one line naming the extra to install."""
    choice = env.read("HYBRIDRT_GRAMMAR_ENGINE", environ)
    for name in EXTRAS if choice == "auto" else (choice,):
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        return name
    if choice == "auto":
        raise ValueError(NO_ENGINE)
    raise ValueError(f"HYBRIDRT_GRAMMAR_ENGINE={choice}: {choice} is not installed: "
                     f"pip install 'hybridrt[{EXTRAS[choice]}]'")


def make_engine(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
    """The engine ``name`` prepared for ``tokenizer`` (hybridrt's Tokenizer or transformers')."""
    return {"llguidance": LLGuidance, "xgrammar": XGrammar}[name](tokenizer, vocab_size,
                                                                  stop_token_ids)


def choice_grammar(choices: Sequence[str]) -> str:
    """The EBNF grammar whose sentences are exactly ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _schema(so) -> Any:
    if so.kind == "json_object":
        return {"type": "object"}
    value = so.json
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            raise ValueError(f"the schema is not JSON: {e}") from None
    return value


# xgrammar --------------------------------------------------------------------------------------
class XGrammar:
    """xgrammar: a ``GrammarCompiler`` on transformers' tokenizer object; compiled grammars
    are precomputed masks, a matcher per request is cheap."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        import xgrammar as xgr

        self.xgr = xgr
        # hybridrt.tokenizer.Tokenizer hands over transformers' object of its files
        tok = tokenizer.hf() if hasattr(tokenizer, "hf") else tokenizer
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, so) -> Any:
        c, kind = self.compiler, so.kind
        try:
            if kind in ("json", "json_object"):
                flexible = not so.disable_any_whitespace
                return c.compile_json_schema(
                    json.dumps(_schema(so)), any_whitespace=flexible, strict_mode=kind == "json",
                    max_whitespace_cnt=MAX_JSON_WHITESPACE if flexible else None)
            if kind == "regex":
                return c.compile_regex(so.regex)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(so.choice))
            if kind == "grammar":
                return c.compile_grammar(so.grammar)
            return c.compile_structural_tag(so.structural_tag)
        except (RuntimeError, ValueError) as e:
            raise ValueError(_xgrammar_reason(str(e))) from None

    def matcher(self, compiled: Any, stop_token_ids: Sequence[int]) -> Any:
        return self.xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))


def _xgrammar_reason(message: str) -> str:
    """xgrammar's C++ error without its '[time] file.cc:line: ' prefix and check text."""
    text = message.strip().splitlines()[0] if message.strip() else message
    text = re.sub(r"^\[[\d:]+\] [^ ]+:\d+: ", "", text)
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", text)


# llguidance ------------------------------------------------------------------------------------
class LLGuidance:
    """llguidance: an ``LLTokenizer`` on the ``tokenizer.json`` text (transformers is not
    imported), a grammar's text checked by building one ``LLMatcher`` at compile (its errors
    are read there), a deep copy of it per request. Grammars are evaluated lazily, so compiles
    take milliseconds and the work moves into the masks (docs/structured_outputs.md)."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        import llguidance

        self.llg = llguidance
        self.eos = list(stop_token_ids) or [0]
        try:
            source = _text_added_tokens(tokenizer)
            self.tokenizer = llguidance.LLTokenizer(source, n_vocab=vocab_size,
                                                    eos_token=self.eos)
        except ValueError:  # a decoder llguidance does not know: each token's decoded text
            source = llguidance.TokenizerWrapper(_DecodedTokens(tokenizer, self.eos[0]))
            self.tokenizer = llguidance.LLTokenizer(source, n_vocab=vocab_size,
                                                    eos_token=self.eos)

    def grammar(self, so) -> str:
        """The constraint as llguidance's grammar text."""
        M, kind = self.llg.LLMatcher, so.kind
        if kind in ("json", "json_object"):
            schema = _schema(so)
            if kind == "json":
                schema = strict_schema(schema)
            if so.disable_any_whitespace:  # json.dumps's layout
                options = {"whitespace_flexible": False, "item_separator": ", ",
                           "key_separator": ": "}
            else:
                space = r"[\x20\x0A\x0D\x09]{0,%d}" % MAX_JSON_WHITESPACE  # noqa: UP031
                options = {"whitespace_flexible": True, "whitespace_pattern": space}
            return M.grammar_from_json_schema(schema, overrides=options)
        if kind == "regex":
            return M.grammar_from_regex(so.regex)
        if kind == "choice":
            return M.grammar_from_lark("start: " + " | ".join(
                json.dumps(c, ensure_ascii=False) for c in so.choice))
        if kind == "grammar":  # GBNF (xgrammar's EBNF, rule root) or Lark (rule start)
            return self.llg.grammar_from("grammar", so.grammar)
        raise ValueError("structural_tag is xgrammar's format, which llguidance (the grammar "
                         "engine in use) does not read: pip install 'hybridrt[xgrammar]' and "
                         "set HYBRIDRT_GRAMMAR_ENGINE=xgrammar")

    def compile(self, so) -> Any:
        m = self.llg.LLMatcher(self.tokenizer, self.grammar(so), log_level=0)
        if m.is_error():
            raise ValueError(_llguidance_reason(m.get_error()))
        return m

    def matcher(self, compiled: Any, stop_token_ids: Sequence[int]) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy(), stop_token_ids, self.eos)


def _llguidance_reason(message: str) -> str:
    """The first line of llguidance's error, with the regex parser's own reason when it gives
    one, without the position prefix."""
    lines = message.strip().splitlines() or [message]
    text = re.sub(r"^at \d+\(\d+\): ", "", lines[0])
    why = next((ln.strip() for ln in lines[1:] if ln.strip().startswith("error:")), None)
    return f"{text} ({why[len('error:'):].strip()})" if why else text


def _text_added_tokens(tokenizer: Any) -> str:
    """The tokenizer's ``tokenizer.json`` for llguidance, whose LLTokenizer takes every added
    token for a special one: added tokens not marked special (Qwen's ``<think>``,
    ``<tool_call>``) become vocabulary entries, so they match their text as transformers
    decodes them (and as xgrammar matches them)."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec["padding"] = spec["truncation"] = None
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
        for tok in spec.get("added_tokens") or []:
            if not tok.get("special"):
                key = _byte_level(tok["content"]) if byte_level else tok["content"]
                vocab.setdefault(key, tok["id"])
        spec["added_tokens"] = [t for t in spec.get("added_tokens") or [] if t.get("special")]
    return json.dumps(spec)


class _DecodedTokens:
    """A tokenizer as llguidance's ``TokenizerWrapper`` reads one: each id's decoded text as
    its bytes (right for tokenizers whose tokens are whole characters, where llguidance cannot
    read the ``tokenizer.json`` decoder)."""

    def __init__(self, tokenizer: Any, eos: int):
        n = len(tokenizer)
        self.tokens = [tokenizer.decode([i]).encode() for i in range(n)]
        self.eos_token_id, self.bos_token_id = eos, None
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=False)


@functools.cache
def byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies), built once."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


def _byte_level(text: str) -> str:
    """``text`` in a byte-level BPE vocabulary's alphabet."""
    table = byte_chars()
    return "".join(table[b] for b in text.encode())


def strict_schema(schema: Any, close: bool = True) -> Any:
    """xgrammar's strict mode for llguidance: an object schema that does not say otherwise
    allows no properties beyond its own (``additionalProperties: false``), at every depth;
    allOf's members themselves stay open (they are merged), their children are strict."""
    if isinstance(schema, list):
        return [strict_schema(s, close) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("properties", "$defs", "definitions", "patternProperties") and \
                isinstance(v, dict):
            out[k] = {n: strict_schema(s) for n, s in v.items()}
        elif k in ("items", "additionalProperties", "not", "contains", "prefixItems", "anyOf",
                   "oneOf", "if", "then", "else"):
            out[k] = strict_schema(v)
        elif k == "allOf":
            out[k] = strict_schema(v, close=False)
        else:
            out[k] = v
    objectish = out.get("type") == "object" or "properties" in out
    if close and objectish and "allOf" not in out and not (
            {"additionalProperties", "unevaluatedProperties"} & out.keys()):
        out["additionalProperties"] = False
    return out


class LLGuidanceMatcher:
    """An ``LLMatcher`` with xgrammar's matcher methods, and the request's own stop tokens:
    the tokenizer's eos ids are the model's, so a request's stops are applied here (allowed
    where the grammar may end, ending it; the model's other eos ids refused)."""

    __slots__ = ("m", "stops", "eos", "same", "ended")

    def __init__(self, m: Any, stop_token_ids: Sequence[int], eos: Sequence[int]):
        self.m = m
        self.stops = frozenset(stop_token_ids) or frozenset(eos)
        self.eos = frozenset(eos)
        self.same = self.stops == self.eos
        self.ended = False

    def accept_token(self, token: int) -> bool:
        if self.ended:
            return False
        if token in self.stops:
            if not self.m.is_accepting():
                return False
            self.ended = True
            return True
        if token in self.eos:
            return False
        # try_consume_tokens leaves a refused token out; consume_token would end in an error
        return self.m.try_consume_tokens([token]) == 1

    def is_terminated(self) -> bool:
        return self.ended

    def fill_next_token_bitmask(self, bitmask: Any, row: int) -> None:
        r = bitmask[row]
        self.m.unsafe_compute_mask_ptr(r.data_ptr(), r.numel() * r.element_size())
        if self.same:
            return
        accepting = self.m.is_accepting()
        for t in self.eos - self.stops:
            _set_bit(r, t, False)
        for t in self.stops:
            if t < 32 * r.numel():
                _set_bit(r, t, accepting)

    def rollback(self, n: int) -> None:
        if self.ended:  # the stop was the last token accepted, and llguidance never saw it
            self.ended, n = False, n - 1
        if n:
            self.m.rollback(n)


def _set_bit(row: Any, token: int, on: bool) -> None:
    word, bit = divmod(token, 32)
    v = int(row[word]) & 0xFFFFFFFF
    v = v | (1 << bit) if on else v & ~(1 << bit)
    row[word] = v - (1 << 32) if v >= 1 << 31 else v
