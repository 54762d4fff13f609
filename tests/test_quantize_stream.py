"""``hybridrt quantize`` shard by shard (hybridrt/quantize_stream.py): the same quantized
checkpoint as quantizing the loaded model (``save_quantized``), for a sharded MoE checkpoint
whose per-expert gate and up halves lie in different shards, and for a dense one."""

from __future__ import annotations

import json

import pytest
import torch

from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.bench.moe_fixtures import tiny_moe_config, write_moe_checkpoint
from hybridrt.loader import CheckpointError, load_model, save_quantized
from hybridrt.quantize_stream import quantize_streaming


def _same_model(a, b) -> None:
    qa = {n: m.qweight for n, m in a.named_modules() if getattr(m, "qweight", None)}
    qb = {n: m.qweight for n, m in b.named_modules() if getattr(m, "qweight", None)}
    assert qa.keys() == qb.keys() and qa
    for n in qa:
        assert type(qa[n]) is type(qb[n]), n
        assert all(torch.equal(x, y) for x, y in zip(qa[n].tensors(), qb[n].tensors())), n
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_sharded_moe_checkpoint_streams_to_what_save_quantized_writes(tmp_path, quantization):
    src = write_moe_checkpoint(tmp_path / "src", tiny_moe_config(), seed=3,
                               dtype=torch.bfloat16, num_shards=7)
    where = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(where[n] != where[n.replace("gate_proj", "up_proj")]
               for n in where if n.endswith("gate_proj.weight"))  # a pair across shards
    info = quantize_streaming(src, tmp_path / "stream", quantization)
    assert info["shards"] == 7
    save_quantized(src, tmp_path / "whole", quantization)
    a, _, _ = load_model(info["path"], torch.bfloat16)
    b, _, _ = load_model(tmp_path / "whole", torch.bfloat16)
    assert a.mtp is not None
    _same_model(a, b)


def test_dense_checkpoint_streams_too(tmp_path):
    src = write_random_checkpoint(tmp_path / "src", tiny_text_config(), seed=1,
                                  dtype=torch.bfloat16, num_shards=3)
    quantize_streaming(src, tmp_path / "stream", "int4")
    save_quantized(src, tmp_path / "whole", "int4")
    _same_model(load_model(tmp_path / "stream", torch.bfloat16)[0],
                load_model(tmp_path / "whole", torch.bfloat16)[0])
    assert (tmp_path / "stream" / "config.json").read_text() == (src / "config.json").read_text()


def test_mismatched_checkpoint_fails_and_leaves_nothing(tmp_path):
    src = write_moe_checkpoint(tmp_path / "src", tiny_moe_config(), seed=3, num_shards=2)
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["moe_intermediate_size"] = 16
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape mismatch: .*experts.0.gate_proj.weight"
                       "\\+up_proj: expected \\[32, 48\\], found \\[40, 48\\]"):
        quantize_streaming(src, tmp_path / "out", "int8")
    assert not (tmp_path / "out").exists()


PARTS = ("self_attn", "linear_attn", "shared_expert")


def _qweights(model) -> dict:
    return {n: m.qweight for n, m in model.named_modules() if getattr(m, "qweight", None)}


def test_int8_parts_stay_at_8_bits_under_int4(tmp_path):
    """``hybridrt quantize --int8``: the weights whose names hold a part are int8, bit for bit
    the int8 model's; the others what int4 makes of them (experts 4 bits, embedding 6); the
    stored checkpoint, the streamed one and quantizing at load give the same model."""
    from hybridrt.kernels import int4, quant

    src = write_moe_checkpoint(tmp_path / "src", tiny_moe_config(), seed=3,
                               dtype=torch.bfloat16, num_shards=3)
    quantize_streaming(src, tmp_path / "stream", "int4", int8_parts=PARTS)
    save_quantized(src, tmp_path / "whole", "int4", int8_parts=PARTS)
    mixed = load_model(tmp_path / "stream", torch.bfloat16)[0]
    _same_model(mixed, load_model(tmp_path / "whole", torch.bfloat16)[0])
    _same_model(mixed, load_model(src, torch.bfloat16, quantization="int4",
                                  int8_parts=PARTS)[0])
    q8 = _qweights(load_model(src, torch.bfloat16, quantization="int8")[0])
    q4 = _qweights(load_model(src, torch.bfloat16, quantization="int4")[0])
    got = _qweights(mixed)
    eight = [n for n in got if any(p in n for p in PARTS)]
    assert any("shared_expert" in n for n in eight) and any("linear_attn" in n for n in eight)
    for n, qw in got.items():
        want = q8[n] if n in eight else q4[n]
        assert type(qw) is type(want), n
        assert all(torch.equal(x, y) for x, y in zip(qw.tensors(), want.tensors())), n
    assert isinstance(got[eight[0]], quant.QuantWeight)
    assert isinstance(got["model.layers.0.mlp.experts.0.down_proj"], int4.Int4Weight)
    assert isinstance(got["model.embed_tokens"], int4.Int6Weight)


def test_int8_parts_that_cannot_apply_are_refused(tmp_path):
    src = write_moe_checkpoint(tmp_path / "src", tiny_moe_config(), seed=3)
    with pytest.raises(ValueError, match="int8 part 'q_proj_typo' names no quantized weight"):
        quantize_streaming(src, tmp_path / "a", "int4", int8_parts=("q_proj_typo",))
    assert not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match="apply under int4 quantization, not int8"):
        load_model(src, quantization="int8", int8_parts=("self_attn",))
    save_quantized(src, tmp_path / "q", "int4")
    with pytest.raises(ValueError, match="quantized already"):
        load_model(tmp_path / "q", quantization="int4", int8_parts=("self_attn",))


def test_quantize_cli_int8_parts(tmp_path):
    """``hybridrt quantize --int8 PARTS``: written as asked; mistakes are one-line errors."""
    from typer.testing import CliRunner

    from hybridrt.cli.main import app
    from hybridrt.kernels import quant

    src = write_moe_checkpoint(tmp_path / "src", tiny_moe_config(), seed=3)

    def run(*args):
        return CliRunner().invoke(app, ["quantize", str(src), *map(str, args)])

    res = run(tmp_path / "ok", "--quantization", "int4", "--int8", "self_attn, linear_attn")
    assert res.exit_code == 0, res.output
    got = _qweights(load_model(tmp_path / "ok", torch.bfloat16)[0])
    assert all(isinstance(qw, quant.QuantWeight) == ("_attn" in n) for n, qw in got.items())
    for args, why in (
            (("--int8", "self_attn"), "--int8 applies under --quantization int4"),
            (("--quantization", "int4", "--int8", " ,"), "--int8: name at least one part"),
            (("--quantization", "int4", "--int8", "nope"),
             "--int8: int8 part 'nope' names no quantized weight")):
        res = run(tmp_path / "bad", *args)
        assert res.exit_code == 2 and why in res.output, res.output
        assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())
