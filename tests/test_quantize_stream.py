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
