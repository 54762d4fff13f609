"""hybridrt/env.py: every HYBRIDRT_* variable declared once, read there only, parsed into the
options the backends get; and no library code writes the environment for good."""

import ast
import os
from pathlib import Path

import pytest
import torch

from hybridrt import env
from hybridrt.kernels import int4, native, quant
from hybridrt.kernels.cuda.precision import KEY, fp32_products
from hybridrt.kernels.options import KernelOptions

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("hybridrt", "kernels", "cli", "statecache", "specdec")


def test_an_unset_environment_gives_the_default_options():
    assert env.kernel_options({}) == KernelOptions()
    assert env.adaptive_threads({}) and not env.debug({})


def test_each_variable_parses():
    opts = env.kernel_options({
        "HYBRIDRT_NATIVE": "off", "HYBRIDRT_CACHE": "/tmp/k", "HYBRIDRT_HALF_PATH": " FMA",
        "HYBRIDRT_FUSED_SIMD": "avx2", "HYBRIDRT_INT8_ISA": "ref", "HYBRIDRT_HUGE_PAGES": "0",
        "HYBRIDRT_STEP_PROGRAM": "Off"})
    assert opts == KernelOptions(native=False, cache_dir="/tmp/k", half_path="fma",
                                 fused_simd=1, int8_isa="ref", int4_isa="ref", huge_pages=False,
                                 step_program=False)
    # the 4-bit path follows HYBRIDRT_INT8_ISA unless set itself; the build target
    opts = env.kernel_options({"HYBRIDRT_INT8_ISA": "avx2", "HYBRIDRT_INT4_ISA": " AVXVNNI",
                               "HYBRIDRT_MARCH": "skylake-avx512"})
    assert (opts.int8_isa, opts.int4_isa, opts.march) == ("avx2", "avxvnni", "skylake-avx512")
    with pytest.raises(ValueError, match="^HYBRIDRT_MARCH='-o /tmp/x': a cc -march target"):
        env.kernel_options({"HYBRIDRT_MARCH": "-o /tmp/x"})
    assert not env.adaptive_threads({"HYBRIDRT_ADAPTIVE_THREADS": "no"})
    assert env.debug({"HYBRIDRT_DEBUG": "1"})


@pytest.mark.parametrize("name", ["HYBRIDRT_HALF_PATH", "HYBRIDRT_FUSED_SIMD",
                                  "HYBRIDRT_INT8_ISA", "HYBRIDRT_INT4_ISA"])
def test_an_unknown_value_is_one_line_naming_the_variable(name):
    with pytest.raises(ValueError, match=f"^{name}='sse9': ") as e:
        env.kernel_options({name: "sse9"})
    assert "\n" not in str(e.value)


def test_the_choices_are_the_kernels():
    assert env.HALF_PATHS == native.HALF_PATHS
    assert tuple(quant.ISAS) == env.INT8_ISAS
    assert tuple(int4.ISAS) == env.INT4_ISAS


def _environment_reads(path: Path) -> list[str]:
    """The HYBRIDRT_* names ``path`` reads from os.environ / os.getenv."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            reads = (f.attr == "getenv" or f.attr in ("get", "pop", "setdefault")
                     and isinstance(f.value, ast.Attribute) and f.value.attr == "environ")
            if reads and node.args and isinstance(node.args[0], ast.Constant):
                out.append(node.args[0].value)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and (
                node.value.attr == "environ" and isinstance(node.slice, ast.Constant)):
            out.append(node.slice.value)
    return [n for n in out if str(n).startswith("HYBRIDRT_")]


def test_only_env_reads_hybridrt_variables():
    reads = {str(p.relative_to(ROOT)): _environment_reads(p) for d in LIBRARY
             for p in (ROOT / d).rglob("*.py")}
    assert reads.pop("hybridrt/env.py") == []  # it reads through the table, by name
    assert {p: r for p, r in reads.items() if r} == {}
    declared = set(env.VARIABLES)
    assert {"HYBRIDRT_NATIVE", "HYBRIDRT_CACHE", "HYBRIDRT_HALF_PATH", "HYBRIDRT_FUSED_SIMD",
            "HYBRIDRT_INT8_ISA", "HYBRIDRT_INT4_ISA", "HYBRIDRT_INT4_PREFETCH", "HYBRIDRT_MARCH",
            "HYBRIDRT_HUGE_PAGES",
            "HYBRIDRT_STEP_PROGRAM", "HYBRIDRT_ADAPTIVE_THREADS", "HYBRIDRT_DEBUG",
            "HYBRIDRT_API_KEY", "HYBRIDRT_GRAMMAR_ENGINE", "HYBRIDRT_LLAMACPP_BENCH"} == declared


def test_fp32_products_leave_an_unset_variable_unset(monkeypatch):
    monkeypatch.delenv(KEY, raising=False)
    with fp32_products(torch.float32):
        assert os.environ[KEY] == "ieee"
    assert KEY not in os.environ
    with pytest.raises(RuntimeError), fp32_products(torch.float32):
        raise RuntimeError("a failing call")
    assert KEY not in os.environ
    with fp32_products(torch.bfloat16):  # bf16: nothing set
        assert KEY not in os.environ
    assert KEY not in os.environ


def test_fp32_products_keep_the_users_value(monkeypatch):
    monkeypatch.setenv(KEY, "tf32")
    with fp32_products(torch.float32):
        assert os.environ[KEY] == "tf32"
    assert os.environ[KEY] == "tf32"
