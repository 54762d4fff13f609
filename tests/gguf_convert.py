"""GGUF files for the tests, made by llama.cpp's own converter (convert_hf_to_gguf.py of the
vendored source that ``hybridrt bench llamacpp-build`` unpacks) and ``llama-quantize``, never by
hybridrt: ``convert(ckpt, out, outtype, mtp)``. As ../shared/tools/llamacpp-bench does, a
tokenizer whose pre-tokenizer hash the converter does not know is given "qwen35".
``available()`` says why not, when the converter or llama-quantize is missing;
``check_float_weights`` compares a loaded model's weights with the original's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from hybridrt.bench.llamacpp_build import plan
from hybridrt.gguf import names

_SCRIPT = r"""
import runpy, sys
from pathlib import Path
src, ckpt, out, outtype, mtp = sys.argv[1:6]
extra = sys.argv[6:]
sys.path.insert(0, src); sys.path.insert(1, str(Path(src) / "gguf-py"))
from conversion import base
orig = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return orig(self, tokenizer)
    except NotImplementedError:
        return "qwen35"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [str(Path(src) / "convert_hf_to_gguf.py"), ckpt, "--outtype", outtype, "--outfile",
            out] + ([] if mtp == "1" else ["--no-mtp"]) + extra
runpy.run_path(sys.argv[0], run_name="__main__")
"""
DIRECT = ("f32", "f16", "bf16", "q8_0")  # the converter writes these itself


def source() -> Path:
    return plan().source


def available(outtype: str = "f32") -> str | None:
    """None when ``convert`` can make ``outtype``, else why not."""
    if not (source() / "convert_hf_to_gguf.py").is_file():
        return f"llama.cpp's converter is not at {source()} (hybridrt bench llamacpp-build)"
    if outtype not in DIRECT and not os.access(plan().bin / "llama-quantize", os.X_OK):
        return f"llama-quantize is not built in {plan().bin} (hybridrt bench llamacpp-build)"
    return None


def convert(ckpt: str | Path, out: str | Path, outtype: str = "f32", mtp: bool = False,
            args: tuple[str, ...] = ()) -> Path:
    """``ckpt`` (a checkpoint directory) -> GGUF file ``out`` of type ``outtype`` (f32, f16,
    bf16, q8_0 by the converter; others by llama-quantize from its bf16 file; ``mtp``: keep
    the MTP layers as nextn blocks; ``args``: more converter options)."""
    out = Path(out)
    direct = outtype if outtype in DIRECT else "bf16"
    target = out if outtype in DIRECT else out.with_suffix(".bf16.tmp.gguf")
    subprocess.run([sys.executable, "-c", _SCRIPT, str(source()), str(ckpt), str(target), direct,
                    "1" if mtp else "0", *args], check=True, capture_output=True)
    if target != out:
        quantize(target, out, outtype)
        target.unlink()
    return out


def with_tokenizer(ckpt: Path) -> Path:
    """The demo model's tokenizer files copied into ``ckpt`` (the converter reads them)."""
    from hybridrt.model_path import DEMO_MODEL_DIR

    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL_DIR / f, ckpt / f)
    return ckpt


def convert_all(ckpt: Path, out: Path, files: dict[str, tuple]) -> dict[str, Path]:
    """``files`` {name: ``convert``'s (outtype, mtp[, args])} converted two at a time into
    ``out`` -> {name: its GGUF file}."""
    with ThreadPoolExecutor(2) as pool:
        jobs = {k: pool.submit(convert, ckpt, out / f"{k}.gguf", *spec)
                for k, spec in files.items()}
        return {k: j.result() for k, j in jobs.items()}


def quantize(src: str | Path, out: str | Path, outtype: str) -> Path:
    """llama-quantize: GGUF file ``src`` (bf16) -> ``out`` of type ``outtype`` (q4_0, q4_K_M,
    q6_K, iq4_xs ...; llama.cpp keeps some tensors in other types, as it chooses)."""
    subprocess.run([str(plan().bin / "llama-quantize"), str(src), str(out), outtype,
                    str(os.cpu_count() or 1)], check=True, capture_output=True)
    return Path(out)


def check_float_weights(got: dict, want: dict, config, dtype: torch.dtype) -> None:
    """Each tensor equals the original rounded to ``dtype`` as the converter rounds it: the
    norms the converter stores as 1 + w (in F32, as every 1-D tensor) and we read back as that
    minus 1, A_log through -exp and log (within an ulp or two)."""
    assert set(got) == set(want)
    srcs = names.sources(config, True)
    for name, w in want.items():
        g = got[name].float()
        if srcs[name].value == "a_log":
            ok = torch.allclose(g, w.to(dtype).float(), rtol=4e-7 if dtype == torch.float32
                                else 1e-2, atol=0)
        elif srcs[name].value == "norm":
            ok = torch.equal(g, ((w + 1) - 1).to(dtype).float())
        else:
            ok = torch.equal(g, w.to(dtype).float())
        assert ok, f"{name}: max |diff| {(g - w.to(dtype).float()).abs().max().item():.3g}"
