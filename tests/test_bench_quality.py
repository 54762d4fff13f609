"""hybridrt/bench/quality.py: llama-perplexity's procedure, and GGUF tensors put into our model
(the comparison of llama.cpp's formats with ours on one computation)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrt.bench import quality
from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("q"), tiny_text_config(), seed=2,
                                   dtype=torch.bfloat16)


def test_chunked_perplexity_is_llama_perplexitys(tiny):
    """Whole chunks of n_ctx tokens (the rest dropped), each from an empty cache, the tokens
    after the first half scored: n_ctx - n_ctx / 2 - 1 per chunk, as llama-perplexity counts."""
    model = quality._load(tiny, None)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (3 * 16 + 5,), generator=g).tolist()
    ppl, count = quality.chunked_perplexity(model, ids, n_ctx=16)
    assert count == 3 * 7
    nll = 0.0
    for c in range(3):
        chunk = ids[16 * c:16 * (c + 1)]
        (lp, _), = quality.score(model, [chunk])
        nll -= lp[8:].sum().item()  # predictions of tokens 9..15 from what precedes them
    assert ppl == pytest.approx(math.exp(nll / 21), rel=1e-12)


def test_gguf_names_cover_every_layer_matrix(tiny):
    net, _, _ = load_model(tiny, torch.bfloat16, with_mtp=True)
    names = {n: quality.gguf_name(n) for n, p in net.named_parameters() if p.dim() == 2}
    assert names["model.embed_tokens.weight"] == "token_embd.weight"
    assert names["model.layers.0.linear_attn.in_proj_qkv.weight"] == "blk.0.attn_qkv.weight"
    assert names["model.layers.3.self_attn.o_proj.weight"] == "blk.3.attn_output.weight"
    assert all(v is None for k, v in names.items() if k.startswith("mtp."))
    layer = [v for k, v in names.items() if k.startswith("model.")]
    assert None not in layer and len(set(layer)) == len(layer)


def test_gguf_tensors_in_our_model(tiny, tmp_path):
    """A GGUF written with our weights (the gguf package's writer) reads back into the model
    exactly; a tensor under another's name is refused."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    net, _, _ = load_model(tiny, torch.bfloat16)
    mats = {quality.gguf_name(n): p.float() for n, p in net.named_parameters()
            if p.dim() == 2 and quality.gguf_name(n)}

    def write(path, tensors):
        w = gguf.GGUFWriter(str(path), "qwen35")
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        for name, t in tensors.items():
            w.add_tensor(name, t.numpy().astype(np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write(tmp_path / "m.gguf", mats)
    kind, tensors = quality.gguf_matrices(tmp_path / "m.gguf")
    assert kind == "ALL_F32" and tensors.keys() == mats.keys()
    model = quality.model_with_gguf_weights(tiny, tensors, "exact")
    sd = dict(model.named_parameters())
    assert torch.equal(sd["model.layers.1.mlp.down_proj.weight"],
                       net.model.layers[1].mlp.down_proj.weight)
    swapped = dict(mats)
    swapped["blk.0.ffn_gate.weight"], swapped["blk.0.ffn_up.weight"] = (
        mats["blk.0.ffn_up.weight"], mats["blk.0.ffn_gate.weight"])
    write(tmp_path / "bad.gguf", swapped)
    _, tensors = quality.gguf_matrices(tmp_path / "bad.gguf")
    with pytest.raises(ValueError, match="GGUF tensor blk.0.ffn_gate.weight is not this "
                                         "model's model.layers.0.mlp.gate_proj.weight"):
        quality.model_with_gguf_weights(tiny, tensors, "close")


def test_mixed_models_are_loaded_as_quantize_int8_writes_them(tmp_path):
    """``--mixed PARTS``: one more model, int4 with the parts' weights at 8 bits, named after
    them and scored after bf16, int8 and int4; it holds more bytes than int4 and a batch-1
    token reads more of them (the measures ``bench throughput``'s ceiling uses)."""
    from hybridrt.bench.ceilings import weight_bytes_per_token
    from hybridrt.bench.moe_fixtures import tiny_moe_config, write_moe_checkpoint
    from hybridrt.kernels import quant

    src = write_moe_checkpoint(tmp_path / "moe", tiny_moe_config(), seed=1, dtype=torch.bfloat16)
    names = [n for n, _, _ in quality._variants(("int8", "int4"), (("linear_attn",),))]
    assert names == ["bf16", "int8", "int4", "int4+int8:linear_attn"]
    int4 = quality._load(src, "int4")
    mixed = quality._load(src, "int4", int8_parts=("linear_attn",))
    assert {type(m.qweight).__name__ for n, m in mixed.named_modules()
            if "linear_attn" in n and getattr(m, "qweight", None) is not None} == {"QuantWeight"}
    assert quant.weight_bytes(mixed) > quant.weight_bytes(int4)
    assert weight_bytes_per_token(mixed) > weight_bytes_per_token(int4)
