"""``python -m hybridrt.bench.grammar_engines``: every constraint's valid output walked under
each installed engine's masks (each token allowed, the grammar ended after it), the mask equal
after a rollback, the tables, and a clear word when llguidance is missing."""

from __future__ import annotations

import json
import sys

import pytest

from hybridrt.bench import grammar_engines as ge

pytest.importorskip("xgrammar")


def test_every_case_valid_under_xgrammar(tmp_path):
    rep = ge.run(("xgrammar",), vocabs=(None,), passes=1, json_path=tmp_path / "r.json",
                 verbose=False)
    (label, entry), = rep["vocabs"].items()
    assert entry["size"] == 6208 and set(entry["cases"]) == {c.name for c in ge.CASES}
    for case, per in entry["cases"].items():
        r = per["xgrammar"]
        assert r["valid"] and r["rollback_ok"], case
        assert r["compile_ms"] > 0 and r["mask_us_mean"] > 0 and r["tokens"] > 1
    assert json.loads((tmp_path / "r.json").read_text())["engines"] == ["xgrammar"]
    text = ge.table(rep, label)
    assert "| tool call: Qwen3.5 XML, 2 tools |" in text and "(refused)" not in text
    sizes = rep["install_mb"]["xgrammar"]
    assert "xgrammar" in sizes and "torch" not in sizes  # hybridrt's own dependencies apart
    assert "| xgrammar |" in ge.size_table(rep)


def test_a_wrong_output_is_refused():
    tok, size = ge.load_tokenizer()
    case = ge.Case("regex", "regex", r"(yes|no), [0-9]{1,3} (apples|pears)", "yes, 12 plums")
    r = ge.measure_case(ge.make_engine("xgrammar", tok, size), case,
                        tok.encode(case.text, add_special_tokens=False), size, passes=1)
    assert not r["valid"]


def test_widened_vocabulary_keeps_the_demo_tokens():
    demo, n = ge.load_tokenizer()
    wide, size = ge.load_tokenizer(n + 5000)
    assert size == n + 5000 and len(wide) >= size
    text = ge.CASES[2].text
    assert wide.encode(text, add_special_tokens=False) == demo.encode(text,
                                                                     add_special_tokens=False)


def test_missing_llguidance_is_said_and_skipped(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import raises ImportError
    with pytest.raises(ImportError, match="pip install llguidance"):
        ge.import_llguidance()
    rep = ge.run(("xgrammar", "llguidance"), vocabs=(None,), passes=1,
                 cases=ge.CASES[:1], verbose=True)
    assert rep["engines"] == ["xgrammar"] and "llguidance" in rep["missing"]
    assert "llguidance: skipped: llguidance is not installed" in capsys.readouterr().out


def test_llguidance_accepts_every_case():
    pytest.importorskip("llguidance")
    rep = ge.run(("llguidance",), vocabs=(None,), passes=1, verbose=False)
    for case, per in next(iter(rep["vocabs"].values()))["cases"].items():
        assert per["llguidance"]["valid"] and per["llguidance"]["rollback_ok"], case
