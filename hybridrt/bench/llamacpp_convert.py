"""``hybridrt bench llamacpp-convert``: a Qwen3.5 checkpoint -> a GGUF for llama.cpp, through
llama.cpp's own ``convert_hf_to_gguf.py`` (in the source ``hybridrt bench llamacpp-build``
unpacked) and, for the types that converter does not write, its ``llama-quantize``.

The converter names a tokenizer's pre-tokenizer (how text is split before BPE) by hashing the
ids it gives a fixed text, so a checkpoint with Qwen3.5's pre-tokenizer and another vocabulary
(the demo model's, or one copied beside random weights) has a hash it does not know, and it stops
at "BPE pre-tokenizer was not recognized". Here such a hash is mapped to llama.cpp's ``qwen35``
only when the checkpoint's ``tokenizer.json`` splits as Qwen3.5's does (the same regex, then
byte-level BPE), so that llama.cpp splits text as the checkpoint's tokenizer does; any other
unknown pre-tokenizer is still refused by the converter. The multi-token-prediction layers are
left out (the converter's ``--no-mtp``): the benchmarks compare decoding without speculation.

The converter runs in a child process (``python -m hybridrt.bench.llamacpp_convert``, ``main``)
with llama.cpp's ``gguf-py`` first on its path, so that it never meets the installed ``gguf``.
``plan`` builds every path and command without running anything."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from hybridrt.bench.llamacpp_build import plan as build_plan

CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")  # written by the converter itself
INTERMEDIATE = "bf16"  # what llama-quantize starts from for every other type
QWEN35_PRE = "qwen35"  # llama.cpp's name of Qwen3.5's pre-tokenizer (src/llama-vocab.cpp)
# Qwen3.5's split regex, as its tokenizer.json holds it (and llama-vocab.cpp quotes it)
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


class LlamaCppConvertError(RuntimeError):
    """Bad input, a missing tool or a failed step; the message is one line saying what."""


def splits_as_qwen35(tokenizer: dict) -> bool:
    """Whether a ``tokenizer.json`` (parsed) pre-tokenizes as Qwen3.5's: its split regex
    (isolated, not inverted), then byte-level without a regex or a prefix space."""
    pre = tokenizer.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return False
    split, byte_level = steps
    return (split.get("type") == "Split"
            and split.get("pattern") == {"Regex": QWEN35_SPLIT}
            and split.get("behavior") == "Isolated" and not split.get("invert")
            and byte_level.get("type") == "ByteLevel"
            and not byte_level.get("use_regex", True)
            and not byte_level.get("add_prefix_space", False))


def unknown_pre_name(ckpt: str | Path) -> str | None:
    """The name an unknown pre-tokenizer hash of ``ckpt`` is mapped to: ``qwen35`` when its
    tokenizer.json splits as Qwen3.5's, else None (the converter's refusal stands)."""
    try:
        tokenizer = json.loads((Path(ckpt) / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    return QWEN35_PRE if splits_as_qwen35(tokenizer) else None


def map_unknown_pre(text_model: type, name: str) -> None:
    """Make ``text_model.get_vocab_base_pre`` (llama.cpp's ``conversion.base.TextModel``) answer
    ``name`` where it would raise NotImplementedError for an unknown hash; its warning box is
    replaced by one line."""
    original = text_model.get_vocab_base_pre
    log = logging.getLogger("hf-to-gguf")

    def get_vocab_base_pre(self, tokenizer) -> str:
        level = log.level
        log.setLevel(logging.ERROR)  # the box it logs before raising
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            log.setLevel(level)
            log.warning("hybridrt: pre-tokenizer hash unknown to llama.cpp; tokenizer.json "
                        "splits as Qwen3.5's -> %r", name)
            return name
        finally:
            log.setLevel(level)

    text_model.get_vocab_base_pre = get_vocab_base_pre


def quantize_types(quantize: str | Path) -> list[str]:
    """The types a ``llama-quantize`` binary lists under "allowed quantization types"."""
    text = subprocess.run([str(quantize), "--help"], capture_output=True, text=True).stdout
    return re.findall(r"^\s*\d+\s+or\s+(\S+)\s+:", text, re.M)


@dataclass(frozen=True)
class Plan:
    """Every path and command of a conversion (``plan``)."""

    ckpt: Path
    out: Path
    outtype: str  # as llama-quantize spells it, or one of CONVERTER_TYPES
    source: Path  # llama.cpp's unpacked source
    quantize_bin: Path
    converted: Path  # what the converter writes: ``out``, or the bf16 file llama-quantize reads
    convert: list[str]
    quantize: list[str] | None


def plan(ckpt: str | Path, out: str | Path, outtype: str = INTERMEDIATE,
         home: str | Path | None = None, python: str = sys.executable,
         threads: int | None = None) -> Plan:
    """The commands that turn ``ckpt`` into ``out`` of ``outtype``, after checking what can be
    checked before they run (``LlamaCppConvertError`` with one line otherwise)."""
    ckpt, out = Path(ckpt), Path(out)
    built = build_plan(home)
    config = _read_config(ckpt)
    model_type = config.get("model_type")
    if model_type not in QWEN35_MODEL_TYPES:
        raise LlamaCppConvertError(f"{ckpt} is a {model_type!r} checkpoint, not Qwen3.5's "
                                   f"({', '.join(QWEN35_MODEL_TYPES)})")
    if not (ckpt / "tokenizer.json").is_file():
        raise LlamaCppConvertError(
            f"no tokenizer.json in {ckpt}: llama.cpp's converter needs the tokenizer (random "
            f"weights: copy the demo model's, cp hybridrt/demo_model/tokenizer*.json {ckpt}/)")
    script = built.source / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise LlamaCppConvertError(f"no llama.cpp converter at {script}: run hybridrt bench "
                                   f"llamacpp-build first")
    if not out.parent.is_dir():
        raise LlamaCppConvertError(f"no folder {out.parent} for {out}")
    quantize_bin = built.bin / "llama-quantize"
    quantize = None
    converted = out
    if outtype.lower() in CONVERTER_TYPES:
        outtype = outtype.lower()
    else:
        if not os.access(quantize_bin, os.X_OK):
            raise LlamaCppConvertError(f"{outtype} needs llama-quantize, not in {built.bin}: "
                                       f"run hybridrt bench llamacpp-build first")
        known = quantize_types(quantize_bin)
        match = [t for t in known if t.lower() == outtype.lower()]
        if not match:
            raise LlamaCppConvertError(f"unknown GGUF type {outtype!r}; choose from "
                                       f"{', '.join(CONVERTER_TYPES + tuple(known))}")
        outtype = match[0]
        converted = out.with_name(out.name + f".{INTERMEDIATE}.tmp")
        quantize = [str(quantize_bin), str(converted), str(out), outtype,
                    str(threads or os.cpu_count() or 1)]
    mapped = unknown_pre_name(ckpt)
    convert = [python, "-m", __name__, str(built.source), mapped or "-", str(script), str(ckpt),
               "--outtype", INTERMEDIATE if quantize else outtype, "--outfile", str(converted),
               "--no-mtp"]
    return Plan(ckpt=ckpt, out=out, outtype=outtype, source=built.source,
                quantize_bin=quantize_bin, converted=converted, convert=convert,
                quantize=quantize)


def _read_config(ckpt: Path) -> dict:
    if not ckpt.is_dir():
        raise LlamaCppConvertError(f"no checkpoint folder at {ckpt}")
    try:
        return json.loads((ckpt / "config.json").read_text())
    except OSError:
        raise LlamaCppConvertError(f"no config.json in {ckpt}") from None
    except ValueError as e:
        raise LlamaCppConvertError(f"{ckpt / 'config.json'} is not JSON: {e}") from None


def _run(step: str, cmd: list[str]) -> None:
    print(f"{step}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    # its own per-tensor lines are the progress; stdout kept for the result
    if subprocess.run(cmd, stdout=sys.stderr.fileno()).returncode != 0:
        raise LlamaCppConvertError(f"{step} failed (its last lines above): {' '.join(cmd)}")


def convert(p: Plan) -> Path:
    """Run the plan -> ``p.out``; the intermediate bf16 file is removed whatever happens."""
    steps = 2 if p.quantize else 1
    try:
        _run(f"[1/{steps}] converting {p.ckpt} to "
             f"{INTERMEDIATE if p.quantize else p.outtype}", p.convert)
        if p.quantize:
            _run(f"[2/2] quantizing to {p.outtype}", p.quantize)
    finally:
        if p.quantize:
            p.converted.unlink(missing_ok=True)
    if not p.out.is_file():
        raise LlamaCppConvertError(f"the conversion left no {p.out}")
    return p.out


def main(argv: list[str]) -> None:
    """The child: ``SOURCE NAME|- SCRIPT ARGS...``: llama.cpp's converter ``SCRIPT`` run with
    ``ARGS``, its unknown pre-tokenizer hash mapped to ``NAME`` (``-``: not mapped)."""
    import runpy

    source, name, script, *args = argv
    sys.path[:0] = [source, str(Path(source) / "gguf-py")]
    if name != "-":
        from conversion import base  # llama.cpp's, from ``source``

        map_unknown_pre(base.TextModel, name)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
