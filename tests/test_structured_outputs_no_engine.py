"""Without a grammar engine (the ``serve`` extra leaves both out): a constrained request, and a
forced tool call, are refused with the extra that installs one; free requests run; the extras
say so (``serve`` a web stack only, ``structured`` llguidance, ``xgrammar`` its own, ``test``
both). The engine choice (HYBRIDRT_GRAMMAR_ENGINE) and llguidance's refusal of xgrammar's
structural tag."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hybridrt.grammar_engine import engine_name
from hybridrt.llm import LLM
from hybridrt.sampling_params import SamplingParams, StructuredOutputsParams
from hybridrt.tool_calls import tool_constraint

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tests/conftest.py

INSTALL = "pip install 'hybridrt[structured]'"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]


@pytest.fixture
def no_engine(monkeypatch):
    for name in ("xgrammar", "llguidance"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError


def test_the_error_names_the_extra(no_engine):
    with pytest.raises(ValueError, match="serve extra leaves out") as e:
        engine_name({})
    assert INSTALL in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"pip install 'hybridrt\[structured\]'"):
        tool_constraint(TOOLS, "required", thinking=False)
    assert tool_constraint(TOOLS, "auto", thinking=False) is None  # free: no engine needed
    with pytest.raises(ValueError, match=r"^HYBRIDRT_GRAMMAR_ENGINE=xgrammar: xgrammar is not "
                                         r"installed: pip install 'hybridrt\[xgrammar\]'$"):
        engine_name({"HYBRIDRT_GRAMMAR_ENGINE": "xgrammar"})


def test_auto_prefers_llguidance_and_the_variable_chooses(monkeypatch):
    pytest.importorskip("llguidance")
    assert engine_name({}) == "llguidance"
    monkeypatch.setitem(sys.modules, "llguidance", None)
    pytest.importorskip("xgrammar")
    assert engine_name({"HYBRIDRT_GRAMMAR_ENGINE": "auto"}) == "xgrammar"
    with pytest.raises(ValueError, match="^HYBRIDRT_GRAMMAR_ENGINE='grammarly': use auto, "
                                         "llguidance or xgrammar$"):
        engine_name({"HYBRIDRT_GRAMMAR_ENGINE": "grammarly"})


def test_a_constrained_request_fails_alone(no_engine):
    llm = LLM(max_model_len=128, max_num_seqs=2, cache_memory=16 << 20)
    so = StructuredOutputsParams(json={"type": "object"})
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=4, structured_outputs=so),
                                     SamplingParams(max_tokens=4, ignore_eos=True)],
                        use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and INSTALL in str(outs[0].error)
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4


def test_serve_extra_is_a_web_stack_only():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    assert not any(d.startswith(("xgrammar", "llguidance")) for d in extras["serve"])
    assert extras["structured"] == ["llguidance>=1.0"]
    assert extras["xgrammar"] == ["xgrammar>=0.2.9"]
    for engine in ("xgrammar", "llguidance"):
        assert any(d.startswith(engine) for d in extras["test"])
