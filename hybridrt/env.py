"""Every ``HYBRIDRT_*`` environment variable, declared once and read here only.

| variable | values | default | what it does |
| --- | --- | --- | --- |
| HYBRIDRT_NATIVE | 0/false/no/off, else on | on | off: no compiled CPU kernels (torch ops) |
| HYBRIDRT_CACHE | a directory | ~/.cache/hybridrt | where the compiled CPU kernels are built |
| HYBRIDRT_HALF_PATH | auto, fma, bf16dot | auto | the bf16 x bf16 GEMV/GEMM path |
| HYBRIDRT_FUSED_SIMD | avx512, avx2, 0 (off, none) | avx512 | the fused layers' vector loops |
| HYBRIDRT_INT8_ISA | vnni, avx2, ref | the best built | the int8 GEMV/GEMM path |
| HYBRIDRT_INT4_ISA | vnni, avxvnni, avx2, ref | as HYBRIDRT_INT8_ISA | the 4-bit GEMV/GEMM path |
| HYBRIDRT_INT4_PREFETCH | auto, nta, l2 | auto | the one-row 4-bit products' prefetch |
| HYBRIDRT_MARCH | a cc -march target | native | what the C kernels are compiled for |
| HYBRIDRT_HUGE_PAGES | 0/false/no/off, else on | on | off: weights stay in ordinary pages |
| HYBRIDRT_STEP_PROGRAM | 0/false/no/off, else on | on | off: decode layers called from Python |
| HYBRIDRT_ADAPTIVE_THREADS | 0/false/no/off, else on | on | off: all cores, no thread governor |
| HYBRIDRT_DEBUG | 1, else off | off | the CLI prints tracebacks of unexpected errors |
| HYBRIDRT_API_KEY | any string | none | ``hybridrt serve``'s API key (docs/server.md) |
| HYBRIDRT_GRAMMAR_ENGINE | auto, llguidance, xgrammar | auto | structured outputs' engine |
| HYBRIDRT_LLAMACPP_BENCH | a path | ../shared/tools/ | ``bench long``'s llama.cpp runner |

Values are matched case-insensitively, surrounding blanks ignored. ``kernel_options`` parses
the kernels' switches into the ``KernelOptions`` the backends get (the engine calls it once, at
start-up); an unknown value is a ``ValueError`` of one line naming the variable. This module
imports no torch (the CLI reads ``HYBRIDRT_DEBUG`` before the slow imports).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    choices: tuple[str, ...] | None  # None: any value (a flag: OFF or on; a path)
    help: str


HALF_PATHS = ("fma", "bf16dot")  # kernels/native.py's HALF_PATHS
INT8_ISAS = ("ref", "avx2", "vnni")  # kernels/quant.py's ISAS, best last
INT4_ISAS = ("ref", "avx2", "avxvnni", "vnni")  # kernels/int4.py's ISAS, best last
GRAMMAR_ENGINES = ("llguidance", "xgrammar")  # hybridrt/grammar_engine.py's EXTRAS
FUSED_SIMD_LEVELS = {"": 2, "avx512": 2, "avx2": 1, "0": 0, "off": 0, "none": 0}

VARIABLES = {v.name: v for v in (
    Variable("HYBRIDRT_NATIVE", "1", None, "0 keeps the torch ops (no compiled CPU kernels)"),
    Variable("HYBRIDRT_CACHE", "", None, "where the compiled CPU kernels are built"),
    Variable("HYBRIDRT_HALF_PATH", "auto", ("auto", *HALF_PATHS), "bf16 x bf16 product path"),
    Variable("HYBRIDRT_FUSED_SIMD", "", tuple(FUSED_SIMD_LEVELS), "fused layers' vector loops"),
    Variable("HYBRIDRT_INT8_ISA", "", ("", *INT8_ISAS), "int8 product path"),
    Variable("HYBRIDRT_INT4_ISA", "", ("", *INT4_ISAS), "4-bit product path"),
    Variable("HYBRIDRT_INT4_PREFETCH", "auto", ("auto", "nta", "l2"),
             "one-row 4-bit products' prefetch (kernels/int4_prefetch.py)"),
    Variable("HYBRIDRT_MARCH", "native", None, "the C kernels' compile target (-march)"),
    Variable("HYBRIDRT_HUGE_PAGES", "1", None, "0: weights in ordinary pages"),
    Variable("HYBRIDRT_STEP_PROGRAM", "1", None, "0: decode layers called one by one"),
    Variable("HYBRIDRT_ADAPTIVE_THREADS", "1", None, "0: all cores, no thread governor"),
    Variable("HYBRIDRT_DEBUG", "0", None, "1: the CLI shows tracebacks"),
    Variable("HYBRIDRT_API_KEY", "", None, "hybridrt serve's API key (kept out of ps)"),
    Variable("HYBRIDRT_GRAMMAR_ENGINE", "auto", ("auto", *GRAMMAR_ENGINES),
             "structured outputs' grammar engine"),
    Variable("HYBRIDRT_LLAMACPP_BENCH", "", None, "bench long's llamacpp-bench script"),
)}
# read as given: paths, a secret
RAW = ("HYBRIDRT_CACHE", "HYBRIDRT_API_KEY", "HYBRIDRT_LLAMACPP_BENCH")


def read(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The variable's value (its default when unset), stripped and lower-cased (a path as
    given); ValueError naming it for a value outside its choices."""
    var = VARIABLES[name]
    raw = (os.environ if environ is None else environ).get(name, var.default)
    if name in RAW:
        return raw
    value = raw.strip().lower()
    if var.choices is not None and value not in var.choices:
        raise ValueError(_choices_error(name, raw))
    return value


def _choices_error(name: str, raw: str) -> str:
    if name == "HYBRIDRT_FUSED_SIMD":
        return (f"{name}={raw.strip().lower()!r}: choose avx512 (the default: the widest this "
                f"CPU has), avx2 or 0")
    if name == "HYBRIDRT_HALF_PATH":
        return f"{name}={raw.strip().lower()!r}: use auto, {' or '.join(HALF_PATHS)}"
    if name == "HYBRIDRT_GRAMMAR_ENGINE":
        return f"{name}={raw.strip().lower()!r}: use auto, {' or '.join(GRAMMAR_ENGINES)}"
    if name == "HYBRIDRT_INT4_ISA":
        return f"{name}={raw.strip().lower()!r}: choose one of {', '.join(INT4_ISAS)}"
    return f"{name}={raw.strip().lower()!r}: choose one of {', '.join(INT8_ISAS)}"


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """An on/off variable: off for 0, false, no, off; on for anything else."""
    return read(name, environ) not in OFF


def kernel_options(environ: Mapping[str, str] | None = None):
    """The kernels' switches -> ``hybridrt.kernels.options.KernelOptions``."""
    from hybridrt.kernels.options import KernelOptions

    return KernelOptions(
        native=flag("HYBRIDRT_NATIVE", environ),
        cache_dir=read("HYBRIDRT_CACHE", environ) or None,
        half_path=read("HYBRIDRT_HALF_PATH", environ),
        fused_simd=FUSED_SIMD_LEVELS[read("HYBRIDRT_FUSED_SIMD", environ)],
        int8_isa=read("HYBRIDRT_INT8_ISA", environ) or None,
        int4_isa=read("HYBRIDRT_INT4_ISA", environ) or read("HYBRIDRT_INT8_ISA", environ) or None,
        int4_prefetch=read("HYBRIDRT_INT4_PREFETCH", environ),
        march=march(environ),
        huge_pages=flag("HYBRIDRT_HUGE_PAGES", environ),
        step_program=flag("HYBRIDRT_STEP_PROGRAM", environ),
    )


def march(environ: Mapping[str, str] | None = None) -> str:
    """HYBRIDRT_MARCH: a compiler target name (letters, digits, ``-``, ``_``, ``.``)."""
    value = read("HYBRIDRT_MARCH", environ) or "native"
    if not re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", value):
        raise ValueError(f"HYBRIDRT_MARCH={value!r}: a cc -march target such as native, haswell "
                         f"or skylake-avx512")
    return value


def adaptive_threads(environ: Mapping[str, str] | None = None) -> bool:
    return flag("HYBRIDRT_ADAPTIVE_THREADS", environ)


def debug(environ: Mapping[str, str] | None = None) -> bool:
    return read("HYBRIDRT_DEBUG", environ) == "1"
