"""``hybridrt bench llamacpp-convert``: which tokenizers are mapped to llama.cpp's ``qwen35``
pre-tokenizer and which are not, the mapping of the converter's unknown hash, the plan's checks
and steps (with stand-in converter and llama-quantize), and, where llama.cpp is built at
~/.cache/hybridrt-llamacpp, the real conversion of the demo model (skipped otherwise)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridrt.bench import llamacpp_convert as conv
from hybridrt.bench.fixtures import write_char_tokenizer
from hybridrt.bench.llamacpp_build import plan as build_plan
from hybridrt.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "hybridrt" / "demo_model"
BUILT = build_plan(Path.home() / ".cache" / "hybridrt-llamacpp")
HAVE_LLAMACPP = ((BUILT.source / "convert_hf_to_gguf.py").is_file()
                 and os.access(BUILT.bin / "llama-quantize", os.X_OK))
needs_llamacpp = pytest.mark.skipif(
    not HAVE_LLAMACPP, reason=f"llama.cpp not built at {BUILT.home} (hybridrt bench "
                              f"llamacpp-build builds it)")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # no \p{M}


def invoke(*args):
    return CliRunner().invoke(app, ["bench", *map(str, args)])


def demo_tokenizer() -> dict:
    return json.loads((DEMO / "tokenizer.json").read_text())


def test_the_demo_tokenizer_splits_as_qwen35_and_others_do_not(tmp_path):
    tok = demo_tokenizer()
    assert conv.splits_as_qwen35(tok)
    assert conv.unknown_pre_name(DEMO) == "qwen35"
    other = json.loads(json.dumps(tok))
    other["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = QWEN2_SPLIT
    assert not conv.splits_as_qwen35(other)
    prefixed = json.loads(json.dumps(tok))
    prefixed["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = True
    assert not conv.splits_as_qwen35(prefixed)
    assert not conv.splits_as_qwen35({"pre_tokenizer": None})
    write_char_tokenizer(tmp_path)
    assert conv.unknown_pre_name(tmp_path) is None
    assert conv.unknown_pre_name(tmp_path / "missing") is None


@pytest.mark.skipif(not (BUILT.source / "src" / "llama-vocab.cpp").is_file(),
                    reason=f"no llama.cpp source at {BUILT.source}")
def test_the_regex_is_the_one_llamacpp_quotes_for_qwen35():
    text = (BUILT.source / "src" / "llama-vocab.cpp").read_text()
    case = text[text.index("case LLAMA_VOCAB_PRE_TYPE_QWEN35:"):]
    quoted = case.split("// original regex from tokenizer.json")[1].splitlines()[1].strip()
    assert json.loads(quoted.removeprefix("// ")) == conv.QWEN35_SPLIT


def test_an_unknown_hash_is_mapped_and_a_known_one_kept(caplog):
    class TextModel:
        def get_vocab_base_pre(self, tokenizer):
            if tokenizer == "known":
                return "qwen2"
            logging.getLogger("hf-to-gguf").warning("** WARNING: the box")
            raise NotImplementedError("BPE pre-tokenizer was not recognized")

    conv.map_unknown_pre(TextModel, "qwen35")
    with caplog.at_level(logging.INFO):
        assert TextModel().get_vocab_base_pre("known") == "qwen2"
        assert TextModel().get_vocab_base_pre("unknown") == "qwen35"
    assert [r.getMessage() for r in caplog.records] == [
        "hybridrt: pre-tokenizer hash unknown to llama.cpp; tokenizer.json splits as "
        "Qwen3.5's -> 'qwen35'"]  # one line, not the converter's box
    assert logging.getLogger("hf-to-gguf").level == logging.NOTSET


def fake_home(tmp_path: Path) -> Path:
    """A llama.cpp folder whose converter asks conversion.base for the pre-tokenizer (which
    knows none) and writes it and its arguments to its --outfile, and whose llama-quantize
    lists two types and writes what it was asked."""
    home = tmp_path / "home"
    p = build_plan(home)
    p.bin.mkdir(parents=True)
    (p.source / "conversion").mkdir()
    (p.source / "conversion" / "__init__.py").write_text("")
    (p.source / "conversion" / "base.py").write_text(
        "class TextModel:\n"
        "    def get_vocab_base_pre(self, tokenizer):\n"
        "        raise NotImplementedError('BPE pre-tokenizer was not recognized')\n")
    (p.source / "convert_hf_to_gguf.py").write_text(
        "import sys, pathlib\n"
        "from conversion import base\n"
        "a = sys.argv\n"
        "pre = base.TextModel().get_vocab_base_pre(None)\n"
        "pathlib.Path(a[a.index('--outfile') + 1]).write_text(pre + ' ' + ' '.join(a[1:]))\n")
    q = p.bin / "llama-quantize"
    q.write_text("#!/bin/sh\n"
                 "if [ \"$1\" = --help ]; then printf '  2  or  Q4_0    :  x\\n"
                 "  15  or  Q4_K_M  :  y\\n'; exit 0; fi\n"
                 "test -f \"$1\" || exit 3\n"
                 "echo \"quantized $3 $4\" > \"$2\"\n")
    q.chmod(0o755)
    return home


def ckpt_with_tokenizer(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(DEMO / "config.json", ckpt)
    shutil.copy(DEMO / "tokenizer.json", ckpt)
    return ckpt


def test_plan_refuses_what_it_cannot_convert_in_one_line(tmp_path):
    home = fake_home(tmp_path)
    ckpt = ckpt_with_tokenizer(tmp_path)
    out = tmp_path / "m.gguf"
    cases = [
        (tmp_path / "none", out, "bf16", home, "no checkpoint folder"),
        (ckpt, tmp_path / "no" / "m.gguf", "bf16", home, "no folder"),
        (ckpt, out, "q9_z", home, "unknown GGUF type 'q9_z'; choose from f32, f16, bf16, q8_0, "
                                   "Q4_0, Q4_K_M"),
        (ckpt, out, "bf16", tmp_path / "empty", "run hybridrt bench llamacpp-build first"),
    ]
    for c, o, t, h, msg in cases:
        with pytest.raises(conv.LlamaCppConvertError, match=msg.replace("(", r"\(")):
            conv.plan(c, o, t, home=h)
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(conv.LlamaCppConvertError, match="no tokenizer.json in .*cp hybridrt/"):
        conv.plan(ckpt, out, home=home)
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(conv.LlamaCppConvertError, match="a 'llama' checkpoint, not Qwen3.5's"):
        conv.plan(ckpt, out, home=home)
    (tmp_path / "empty").mkdir()
    res = invoke("llamacpp-convert", ckpt, out, "--home", home)
    assert res.exit_code == 2 and res.output.startswith("error: ") and "'llama'" in res.output


@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "qwen3_5_moe_text"])
def test_plan_takes_the_moe_checkpoints(tmp_path, model_type):
    """The MoE family converts to llama.cpp's ``qwen35moe`` (docs/gguf.md): planned like the
    dense one, MTP left out."""
    home = fake_home(tmp_path)
    ckpt = ckpt_with_tokenizer(tmp_path)
    (ckpt / "config.json").write_text(json.dumps({"model_type": model_type}))
    p = conv.plan(ckpt, tmp_path / "m.gguf", "Q4_K_M", home=home)
    assert p.quantize is not None and p.convert[-1] == "--no-mtp"


def test_converter_types_convert_once_and_others_quantize_from_bf16(tmp_path):
    home = fake_home(tmp_path)
    ckpt = ckpt_with_tokenizer(tmp_path)
    direct = conv.plan(ckpt, tmp_path / "a.gguf", "Q8_0", home=home)
    assert direct.quantize is None and direct.outtype == "q8_0"
    assert direct.convert[-5:] == ["--outtype", "q8_0", "--outfile", str(tmp_path / "a.gguf"),
                                   "--no-mtp"]
    assert direct.convert[3:5] == [str(build_plan(home).source), "qwen35"]
    assert conv.convert(direct).read_text() == (f"qwen35 {ckpt} --outtype q8_0 --outfile "
                                                f"{tmp_path / 'a.gguf'} --no-mtp")
    quant = conv.plan(ckpt, tmp_path / "b.gguf", "q4_k_m", home=home, threads=3)
    assert quant.outtype == "Q4_K_M" and quant.quantize[-2:] == ["Q4_K_M", "3"]
    assert "--outtype bf16" in " ".join(quant.convert)
    assert conv.convert(quant).read_text() == "quantized Q4_K_M 3\n"
    assert not quant.converted.exists()  # the bf16 intermediate is gone
    (ckpt / "tokenizer.json").write_text(json.dumps({"pre_tokenizer": None}))
    unmapped = conv.plan(ckpt, tmp_path / "c.gguf", home=home)
    assert unmapped.convert[4] == "-"
    with pytest.raises(conv.LlamaCppConvertError, match="converting .* failed"):
        conv.convert(unmapped)  # the converter's own refusal stands


@needs_llamacpp
@pytest.mark.parametrize("outtype", ["q8_0", "Q4_0"])
def test_the_demo_model_converts_with_llamacpp(tmp_path, outtype):
    """The real converter and llama-quantize: the GGUF is qwen35 with the qwen35
    pre-tokenizer, and without the MTP layers."""
    gguf = pytest.importorskip("gguf")
    out = tmp_path / f"demo-{outtype}.gguf"
    res = subprocess.run([sys.executable, "-m", "hybridrt", "bench",
                          "llamacpp-convert", str(DEMO), str(out), outtype],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == str(out)
    assert "splits as Qwen3.5's -> 'qwen35'" in res.stderr
    reader = gguf.GGUFReader(out)

    def text(key):
        f = reader.fields[key]
        return bytes(f.parts[f.data[0]]).decode()

    assert text("general.architecture") == "qwen35" and text("tokenizer.ggml.pre") == "qwen35"
    assert not [t.name for t in reader.tensors if "nextn" in t.name]
    assert outtype.upper() in {t.tensor_type.name for t in reader.tensors}
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


@needs_llamacpp
def test_without_the_mapping_llamacpp_refuses_the_demo_tokenizer(tmp_path):
    p = conv.plan(DEMO, tmp_path / "x.gguf", "q8_0")
    cmd = list(p.convert)
    cmd[4] = "-"
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode != 0 and "BPE pre-tokenizer was not recognized" in res.stderr
