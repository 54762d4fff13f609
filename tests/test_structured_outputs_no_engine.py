"""Without the grammar engine (the ``serve`` extra leaves xgrammar out): a constrained request,
and a forced tool call, are refused with the extra that installs it; free requests run; the
extras say so (``serve`` a web stack only, ``structured`` and ``test`` with xgrammar)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hybridrt.llm import LLM
from hybridrt.sampling_params import SamplingParams, StructuredOutputsParams
from hybridrt.structured_outputs import _import_xgrammar
from hybridrt.tool_calls import tool_constraint

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tests/conftest.py

INSTALL = "pip install 'hybridrt[structured]'"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]


@pytest.fixture
def no_xgrammar(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import raises ImportError


def test_the_error_names_the_extra(no_xgrammar):
    with pytest.raises(ValueError, match="serve extra leaves out") as e:
        _import_xgrammar()
    assert INSTALL in str(e.value)
    with pytest.raises(ValueError, match=r"pip install 'hybridrt\[structured\]'"):
        tool_constraint(TOOLS, "required", thinking=False)
    assert tool_constraint(TOOLS, "auto", thinking=False) is None  # free: no engine needed


def test_a_constrained_request_fails_alone(no_xgrammar):
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
    assert not any(d.startswith("xgrammar") for d in extras["serve"])
    for name in ("structured", "test"):
        assert any(d.startswith("xgrammar") for d in extras[name])
