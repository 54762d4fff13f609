"""Quantized GGUF files made by llama.cpp's ``llama-quantize`` (from a bf16 file its converter
wrote, MTP blocks kept) on a shape whose rows the K-quants take (multiples of 256): every
weight in hybridrt's format for its type, within that mapping's error of ``gguf``'s own
numpy dequantization; mixed files keep each tensor's precision; other types are refused."""


import gguf_convert
import pytest
import torch

from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.gguf import names, repack, tensors
from hybridrt.gguf.reader import GGUFError, GGUFFile
from hybridrt.kernels import native, quant
from hybridrt.loader import load_model

pytestmark = pytest.mark.skipif(gguf_convert.available("q4_0") is not None,
                                reason=gguf_convert.available("q4_0") or "")

CONFIG = tiny_text_config(
    vocab_size=6208, hidden_size=256, intermediate_size=512, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64, eos_token_id=2)
# llama-quantize's type -> the largest relative RMS error (|ours - gguf| / |gguf|) each GGUF
# type may reach in hybridrt's format (docs/gguf.md): the 4-bit values kept with their
# scales rounded to 8-bit codes; IQ4_XS's group scales rounded to fp16; the 5/6-bit types
# quantized again in 6 bits
BOUNDS = {"Q4_0": 6.5e-3, "Q4_1": 6.5e-3, "Q4_K": 6.5e-3, "IQ4_XS": 3e-4, "IQ4_NL": 0.0,
          "Q5_K": 1e-2, "Q6_K": 2e-2}
TYPES = ["q4_0", "q4_1", "q4_K_M", "q5_K_M", "q6_K", "iq4_xs", "iq4_nl"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = gguf_convert.with_tokenizer(
        write_random_checkpoint(tmp_path_factory.mktemp("gguf-q-src"), CONFIG, seed=3))
    out = tmp_path_factory.mktemp("gguf-q")
    bf16 = gguf_convert.convert(d, out / "bf16.gguf", "bf16", mtp=True)
    return {t: gguf_convert.quantize(bf16, out / f"{t}.gguf", t) for t in [*TYPES, "q2_K"]}


@pytest.mark.parametrize("outtype", TYPES)
def test_each_weight_within_its_types_error(files, outtype):
    net, config, _ = load_model(files[outtype], "auto", with_mtp=True)
    f = GGUFFile(files[outtype])
    srcs = names.sources(config, True)
    from gguf.quants import dequantize

    seen = set()
    for name, m in net.named_modules():
        qw = getattr(m, "qweight", None)
        if not isinstance(qw, quant.PackedWeight):
            continue
        src = srcs[f"{name}.weight"]
        t = f.tensors[src.name]
        kind = tensors.type_name(t)
        assert qw.kind == tensors.QUANT_FORMATS[kind], (name, kind)  # each tensor its own
        ref = names.restore(torch.from_numpy(dequantize(t.data, t.tensor_type)).view(qw.shape),
                            src)
        err = ((qw.dequantize() - ref).norm() / ref.norm()).item()
        assert err <= BOUNDS[kind], f"{src.name} ({kind} as {qw.kind}): error {err:.3g}"
        seen.add(kind)
    assert outtype.upper().split("_M")[0] in seen
    assert not any(isinstance(p, torch.Tensor) and p.dim() == 2 and p.dtype == torch.float32
                   and n.endswith("proj.weight") for n, p in net.named_parameters())


def packed_weights(net) -> dict:
    return {n: m.qweight for n, m in net.named_modules()
            if isinstance(getattr(m, "qweight", None), quant.PackedWeight)}


@pytest.mark.parametrize("outtype", TYPES)
def test_compiled_repacking_gives_the_torch_paths_bytes(files, outtype, monkeypatch):
    """csrc/gguf_repack.c (Q4_0, Q4_1, Q4_K, Q6_K here, value heads put back in order
    included) writes the bytes blocks.py and tensors.py's torch ops write."""
    if native.load() is None:
        pytest.skip("no compiled kernels")
    fast = packed_weights(load_model(files[outtype], "auto", with_mtp=True)[0])
    calls = []
    real = repack.packed
    monkeypatch.setattr(repack, "packed", lambda *a: calls.append(real(*a)))
    slow = packed_weights(load_model(files[outtype], "auto", with_mtp=True)[0])
    if outtype in ("q4_0", "q4_1", "q4_K_M", "q6_K"):
        assert any(c is not None for c in calls)
    assert fast.keys() == slow.keys()
    for name, qw in fast.items():
        assert type(qw) is type(slow[name]), name
        for x, y, part in zip(qw.tensors(), slow[name].tensors(), qw.names):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (outtype, name, part)


def test_q4_k_m_keeps_each_tensors_precision(files):
    net, _, _ = load_model(files["q4_K_M"], "auto", with_mtp=False)
    kinds = {m.qweight.kind for m in net.modules()
             if isinstance(getattr(m, "qweight", None), quant.PackedWeight)}
    assert kinds == {"int4", "int6"}  # Q4_K and Q6_K
    assert quant.quantization_of(net) == "int4"


def test_an_unsupported_type_is_one_line_naming_tensor_and_type(files):
    with pytest.raises(GGUFError) as e:
        load_model(files["q2_K"], "auto")
    msg = str(e.value)
    assert "\n" not in msg and "has type Q" in msg and "tensor blk." in msg
    assert "Q2_K" in msg or "Q3_K" in msg


def test_hybridrt_quantize_reads_gguf(files, tmp_path):
    """``hybridrt quantize x.gguf OUT`` (``save_quantized``) from a mixed GGUF: each weight
    stored in the format it loaded in (no requantization at the next start-up), with a config,
    tokenizer and chat template written from the metadata."""
    from typer.testing import CliRunner

    from hybridrt.cli.main import app
    from hybridrt.tokenizer import load_tokenizer

    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", str(files["q4_K_M"]), str(out)])
    assert res.exit_code == 0, res.output
    a, ca, _ = load_model(files["q4_K_M"], "auto", with_mtp=True)
    b, cb, _ = load_model(out, "auto", with_mtp=True)
    assert ca.num_hidden_layers == cb.num_hidden_layers and cb.mtp_num_hidden_layers == 1
    packed = [(n, m.qweight) for n, m in a.named_modules()
              if isinstance(getattr(m, "qweight", None), quant.PackedWeight)]
    assert packed
    for name, qw in packed:
        other = b.get_submodule(name).qweight
        assert type(other) is type(qw), name
        assert all(torch.equal(x, y) for x, y in zip(qw.tensors(), other.tensors())), name
    ta, tb = load_tokenizer(files["q4_K_M"]), load_tokenizer(out)
    text = "Hello <think> wörld </think><|im_end|>\n"
    assert ta.encode(text) == tb.encode(text)
    chat = [{"role": "user", "content": text}]
    assert ta.apply_chat_template(chat, tokenize=False) == tb.apply_chat_template(
        chat, tokenize=False)
