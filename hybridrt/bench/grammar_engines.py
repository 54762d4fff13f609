"""``python -m hybridrt.bench.grammar_engines``: xgrammar against llguidance on the same
constraints and tokenizer.

For each constraint (``CASES``: JSON schemas, a regex, a choice, an EBNF grammar, a Qwen3.5 XML
tool call) and each engine: the compile time (the first compile of that constraint, tokenizer
already prepared), the time to make a request's matcher from the compiled constraint, and the
mask time per token: a fresh matcher walks a valid output token by token (then an eos token),
filling the next-token bitmask before each token (timed) and checking the token is allowed.
``rollback_ok``: the mask after a rollback of 3 tokens equals the mask before them (hybridrt's
``RequestGrammar.fill_mask`` rolls drafts back). The vocabulary is the demo model's tokenizer,
or that tokenizer widened to ``vocab`` ids with synthetic byte-level tokens (words, capitals,
CJK, code punctuation; unreachable by its merges, so the outputs tokenize as with the demo's,
while each mask covers the wider vocabulary). ``install_sizes`` adds up the files of each engine
and of the packages it brings that hybridrt itself does not need.

llguidance is imported lazily: without it the run covers xgrammar alone and says so.
docs/structured_outputs.md ("Choosing the grammar engine") has the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from hybridrt.grammar_engine import byte_chars

ENGINES = ("xgrammar", "llguidance")
QWEN35_VOCAB = 248_320  # Qwen3.5's embedding rows
DEMO_DIR = Path(__file__).resolve().parent.parent / "demo_model"
STOP_IDS = [0, 2]  # the demo model's eos ids

TYPICAL = {"type": "object", "properties": {  # hybridrt bench structured's schema
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {
        "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"]},
    "role": {"enum": ["admin", "user", "guest"]}, "score": {"type": "number"},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "email", "tags", "address", "role", "score", "active"]}
PERSON = {"type": "object", "properties": {  # tests/test_structured_outputs.py
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "role", "tags", "active"], "additionalProperties": False}
FLAT = {"type": "object", "properties": {  # tests/test_serve_agents.py's PERSON
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "role": {"type": "string", "enum": ["admin", "user"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {  # tests/test_serve_agents.py's get_weather
    "city": {"type": "string", "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": -99, "maximum": 99},
    "b": {"type": "integer", "minimum": -99, "maximum": 99}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
TOOL_TEXT = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n"
             "<tool_call>\n<function=add>\n<parameter=a>\n-12\n</parameter>\n"
             "<parameter=b>\n40\n</parameter>\n</function>\n</tool_call>")


@dataclass(frozen=True)
class Case:
    """One constraint: ``kind`` as in StructuredOutputsParams (or "tool": ``value`` the
    tools, called as ``tool_choice`` required), ``value`` its text or schema, ``text`` a valid
    output."""

    name: str
    kind: str
    value: Any
    text: str


def _dumps(obj: Any) -> str:
    return json.dumps(obj)  # hybridrt's default layout (disable_any_whitespace): ", " and ": "


CASES = [
    Case("json: flat, 3 properties", "json", FLAT,
         _dumps({"name": "Ada", "age": 36, "role": "admin"})),
    Case("json: tests' PERSON (array, enum)", "json", PERSON,
         _dumps({"name": "Ada Lovelace", "age": 36, "role": "guest",
                 "tags": ["math", "poet"], "active": True})),
    Case("json: nested, 8 properties", "json", TYPICAL,
         _dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.com",
                 "tags": ["math", "engines", "poetry"],
                 "address": {"city": "London", "zip": "01234"}, "role": "admin",
                 "score": 9.75, "active": True})),
    Case("json_object", "json_object", None,
         _dumps({"id": 7, "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-9", "qty": 1}],
                 "note": "leave at the door"})),
    Case("regex", "regex", r"(yes|no), [0-9]{1,3} (apples|pears)", "yes, 125 pears"),
    Case("choice", "choice", ["red", "green", "blue", "dark blue"], "dark blue"),
    Case("grammar (EBNF)", "grammar",
         'root ::= "[" item ("," item)? ("," item)? "]"\nitem ::= [0-9] [0-9]?', "[12,7,40]"),
    Case("tool call: Qwen3.5 XML, 2 tools", "tool", TOOLS, TOOL_TEXT),
]


# Tokenizers ----------------------------------------------------------------------------------
def _synthetic_tokens(count: int, seed: int = 0) -> list[str]:
    """``count`` byte-level token strings of a large BPE vocabulary's kinds: words (bare, with
    a leading space, capitalised), CJK runs, code and JSON punctuation, digits."""
    rng = random.Random(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [12, 9, 8, 8, 7, 7, 6, 6, 6, 4, 4, 3, 3, 2, 2, 2, 2, 2, 2, 1.5, 1, .8, .2, .2, .1,
               .1]
    punct = list('{}[]()<>:;,."\'`=+-*/\\|&^%$#@!?_~ \n\t')
    out = []
    for _ in range(count):
        r = rng.random()
        if r < 0.62:
            word = "".join(rng.choices(letters, weights, k=rng.randint(2, 10)))
            word = word.capitalize() if rng.random() < 0.25 else word
            s = (" " + word) if rng.random() < 0.55 else word
        elif r < 0.82:
            s = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 3)))
        elif r < 0.95:
            s = "".join(rng.choices(punct, k=rng.randint(2, 5)))
        else:
            s = "".join(rng.choices("0123456789", k=rng.randint(1, 3)))
        out.append(s)
    return out


def load_tokenizer(vocab: int | None = None):
    """The demo model's tokenizer (``vocab`` None) or the same widened to ``vocab`` ids ->
    (transformers' PreTrainedTokenizerFast, vocabulary size of the bitmask)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads((DEMO_DIR / "tokenizer.json").read_text())
    config = json.loads((DEMO_DIR / "config.json").read_text())
    size = config.get("text_config", config).get("vocab_size") or config["vocab_size"]
    if vocab is not None and vocab > size:
        table = byte_chars()
        words = spec["model"]["vocab"]
        taken = set(words) | {t["content"] for t in spec["added_tokens"]}
        next_id = max(max(words.values()), *(t["id"] for t in spec["added_tokens"])) + 1
        seed = 0
        while next_id < vocab:
            for s in _synthetic_tokens(vocab - next_id, seed):
                piece = "".join(table[b] for b in s.encode())
                if piece not in taken:
                    taken.add(piece)
                    words[piece] = next_id
                    next_id += 1
            seed += 1
        size = vocab
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    return tok, size


# Engines ---------------------------------------------------------------------------------------
def import_llguidance():
    """llguidance, or ImportError saying how to install it."""
    try:
        import llguidance
    except ImportError as e:
        raise ImportError(f"llguidance is not installed ({e}): pip install llguidance") from None
    return llguidance


class XGrammar:
    """xgrammar as hybridrt drives it (hybridrt/structured_outputs.py)."""

    name = "xgrammar"

    def __init__(self, tok, vocab_size: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.version = xgr.__version__ if hasattr(xgr, "__version__") else \
            metadata.version("xgrammar")
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size,
                                                  stop_token_ids=STOP_IDS)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, case: Case):
        from hybridrt.structured_outputs import choice_grammar

        c = self.compiler
        if case.kind in ("json", "json_object"):
            schema = '{"type": "object"}' if case.kind == "json_object" else _dumps(case.value)
            return c.compile_json_schema(schema, any_whitespace=False,
                                         strict_mode=case.kind == "json")
        if case.kind == "regex":
            return c.compile_regex(case.value)
        if case.kind == "choice":
            return c.compile_grammar(choice_grammar(case.value))
        if case.kind == "grammar":
            return c.compile_grammar(case.value)
        from hybridrt.tool_calls import tool_constraint

        tag = tool_constraint(case.value, "required", thinking=False,
                              engine="xgrammar").structural_tag
        return c.compile_structural_tag(tag)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled, override_stop_tokens=STOP_IDS)

    @staticmethod
    def fill(m, bitmask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(bitmask, 0)

    @staticmethod
    def accept(m, token: int) -> bool:
        return m.accept_token(token)

    @staticmethod
    def ended(m) -> bool:
        return m.is_terminated()


class LLGuidance:
    """llguidance's LLMatcher on the same tokenizer object (its ``hf.from_tokenizer``)."""

    name = "llguidance"

    def __init__(self, tok, vocab_size: int):
        llg = import_llguidance()
        from llguidance.hf import from_tokenizer

        self.llg = llg
        self.version = llg.__version__
        self.tokenizer = from_tokenizer(tok, n_vocab=vocab_size, eos_token=STOP_IDS)

    def grammar(self, case: Case) -> str:
        M = self.llg.LLMatcher
        if case.kind == "tool":  # hybridrt's Lark of the calls (hybridrt.tool_grammar)
            from hybridrt.tool_calls import tool_constraint

            return M.grammar_from_lark(tool_constraint(case.value, "required", thinking=False,
                                                       engine="llguidance").grammar)
        if case.kind in ("json", "json_object"):
            schema = {"type": "object"} if case.kind == "json_object" else case.value
            return M.grammar_from_json_schema(schema, defaults={
                "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        if case.kind == "regex":
            return M.grammar_from_regex(case.value)
        if case.kind == "choice":
            return self.llg.grammar_from("choice", json.dumps(case.value))
        return self.llg.grammar_from("gbnf", case.value)  # xgrammar's EBNF is GBNF-like

    def compile(self, case: Case):
        g = self.grammar(case)
        m = self.llg.LLMatcher(self.tokenizer, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return g

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tokenizer, compiled, log_level=0)

    @staticmethod
    def fill(m, bitmask: torch.Tensor) -> None:
        row = bitmask[0]
        m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    @staticmethod
    def accept(m, token: int) -> bool:
        return m.consume_token(token)

    @staticmethod
    def ended(m) -> bool:
        return m.is_stopped() and not m.is_error()


def make_engine(name: str, tok, vocab_size: int):
    return {"xgrammar": XGrammar, "llguidance": LLGuidance}[name](tok, vocab_size)


# Measuring -------------------------------------------------------------------------------------
def _allowed(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def measure_case(engine, case: Case, tokens: list[int], vocab_size: int, passes: int) -> dict:
    """Compile, matcher and per-token mask times of ``case``; ``valid``: every token of the
    valid output (then eos) allowed by its mask and the grammar ended after them."""
    t0 = time.perf_counter()
    compiled = engine.compile(case)
    compile_s = time.perf_counter() - t0
    bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    fills, matcher_s, valid = [], [], True
    seq = tokens + [STOP_IDS[0]]
    for _ in range(passes):
        t0 = time.perf_counter()
        m = engine.matcher(compiled)
        matcher_s.append(time.perf_counter() - t0)
        for t in seq:
            t0 = time.perf_counter()
            engine.fill(m, bitmask)
            fills.append(time.perf_counter() - t0)
            if not _allowed(bitmask, t) or not engine.accept(m, t):
                valid = False
                break
        valid = valid and engine.ended(m)
    return {"compile_ms": 1e3 * compile_s, "matcher_ms": 1e3 * statistics.median(matcher_s),
            "mask_us_mean": 1e6 * statistics.fmean(fills),
            "mask_us_median": 1e6 * statistics.median(fills), "mask_us_max": 1e6 * max(fills),
            "tokens": len(seq), "valid": valid,
            "rollback_ok": rollback_ok(engine, compiled, tokens, vocab_size)}


def rollback_ok(engine, compiled, tokens: list[int], vocab_size: int, back: int = 3) -> bool:
    """The mask after accepting ``back`` tokens and rolling them back equals the mask before."""
    if len(tokens) < back + 1:
        return True
    m = engine.matcher(compiled)
    half = len(tokens) // 2
    for t in tokens[:half]:
        engine.accept(m, t)
    words = (vocab_size + 31) // 32
    before, after = (torch.zeros((1, words), dtype=torch.int32) for _ in range(2))
    engine.fill(m, before)
    for t in tokens[half:half + back]:
        engine.accept(m, t)
    m.rollback(back)
    engine.fill(m, after)
    return bool(torch.equal(before, after))


def _dist_closure(name: str, seen: set[str] | None = None) -> set[str]:
    """``name`` and every installed distribution it requires (no extras), normalised names."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen = set() if seen is None else seen
    key = canonicalize_name(name)
    if key in seen:
        return seen
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return seen
    seen.add(key)
    for spec in dist.requires or []:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            _dist_closure(req.name, seen)
    return seen


def _dist_bytes(name: str) -> int:
    dist = metadata.distribution(name)
    total = 0
    for f in dist.files or []:
        p = Path(dist.locate_file(f))
        if p.is_file():
            total += p.stat().st_size
    return total


BASE = ("torch", "numpy", "transformers", "safetensors", "huggingface_hub", "tokenizers",
        "typer", "tqdm")  # pyproject.toml's dependencies


def install_sizes(engines=ENGINES) -> dict:
    """Per engine: MB of its own files and of the packages it brings beyond hybridrt's own
    dependencies ({name: MB}); None for an engine that is not installed."""
    base: set[str] = set()
    for name in BASE:
        _dist_closure(name, base)
    out = {}
    for engine in engines:
        closure = _dist_closure(engine)
        if not closure:
            out[engine] = None
            continue
        extra = sorted(closure - base)
        out[engine] = {d: _dist_bytes(d) / 2**20 for d in extra}
    return out


def run(engines=ENGINES, vocabs: tuple[int | None, ...] = (None, QWEN35_VOCAB), passes: int = 3,
        cases=CASES, json_path: str | None = None, verbose: bool = True) -> dict:
    """Measure ``cases`` on each installed engine of ``engines`` at each vocabulary (None: the
    demo's) -> {"vocabs": {label: {"prepare_s": {engine: s}, "cases": {case: {engine:
    result}}}}, "missing": {engine: why}, "install_mb": ...}."""
    missing, usable = {}, []
    for name in engines:
        try:
            import_llguidance() if name == "llguidance" else __import__(name)
            usable.append(name)
        except ImportError as e:
            missing[name] = str(e)
            if verbose:
                print(f"{name}: skipped: {e}")
    report: dict = {"engines": usable, "missing": missing, "passes": passes, "vocabs": {},
                    "install_mb": install_sizes(engines), "versions": {}}
    for vocab in vocabs:
        tok, size = load_tokenizer(vocab)
        label = f"{size:,} ({'demo' if vocab is None else 'demo widened'})"
        entry = {"size": size, "prepare_s": {}, "cases": {c.name: {} for c in cases}}
        for name in usable:
            t0 = time.perf_counter()
            engine = make_engine(name, tok, size)
            entry["prepare_s"][name] = time.perf_counter() - t0
            engine.compile(Case("warm-up", "regex", "a", "a"))  # one-time set-up, untimed
            report["versions"][name] = engine.version
            for case in cases:
                tokens = tok.encode(case.text, add_special_tokens=False)
                entry["cases"][case.name][name] = measure_case(engine, case, tokens, size,
                                                                passes)
        report["vocabs"][label] = entry
        if verbose:
            print(f"\nvocabulary {label}\n" + table(report, label))
    if verbose:
        print("\n" + size_table(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    return report


def table(report: dict, label: str) -> str:
    """The markdown table of one vocabulary: a row per constraint, per engine compile ms,
    matcher ms, mask us/token (mean / median); a mark where an output was refused."""
    engines = report["engines"]
    entry = report["vocabs"][label]
    head = "| constraint | tokens |" + "".join(
        f" {e} compile ms | {e} matcher ms | {e} mask us/token mean / median |" for e in engines)
    lines = [head, "| --- | ---: |" + " ---: | ---: | ---: |" * len(engines)]
    prep = " | ".join(f"{entry['prepare_s'][e] * 1e3:,.0f} | - | - " for e in engines)
    lines.append(f"| tokenizer preparation (once) | - | {prep}|")
    for case, per in entry["cases"].items():
        cells = []
        for e in engines:
            r = per[e]
            flag = "" if r["valid"] and r["rollback_ok"] else \
                (" (refused)" if not r["valid"] else " (rollback differs)")
            cells.append(f" {r['compile_ms']:.2f} | {r['matcher_ms']:.2f} | "
                         f"{r['mask_us_mean']:.0f} / {r['mask_us_median']:.0f}{flag} |")
        tokens = next(iter(per.values()))["tokens"] if per else 0
        lines.append(f"| {case} | {tokens} |" + "".join(cells))
    return "\n".join(lines)


def size_table(report: dict) -> str:
    """Install size of each engine with what it brings beyond hybridrt's dependencies."""
    lines = ["| engine | installed MB (with what it brings) | packages |", "| --- | ---: | --- |"]
    for engine, dists in report["install_mb"].items():
        if dists is None:
            lines.append(f"| {engine} | not installed | |")
            continue
        parts = ", ".join(f"{d} {mb:.1f}" for d, mb in sorted(dists.items(), key=lambda x: -x[1]))
        lines.append(f"| {engine} | {sum(dists.values()):.1f} | {parts} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m hybridrt.bench.grammar_engines",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--vocab", default=f"demo,{QWEN35_VOCAB}",
                   help="comma-separated: demo (the demo's tokenizer) or a size to widen it to")
    p.add_argument("--passes", type=int, default=3, help="walks of each valid output")
    p.add_argument("--json", default=None, help="write the report here")
    a = p.parse_args(argv)
    vocabs = tuple(None if v == "demo" else int(v) for v in a.vocab.split(","))
    return run(tuple(a.engines.split(",")), vocabs, a.passes, json_path=a.json)


if __name__ == "__main__":
    main()
