"""``qwen35moe`` GGUF files made by llama.cpp's own converter from a tiny random Qwen3.5 MoE
checkpoint (8 experts of 32, top 2, a shared expert of 64, three value heads per key head):
config from the ``qwen35moe.expert_*`` metadata, every weight recovered from the stacked
expert tensors (separate gate / up, and ``--fuse-gate-up-exps``), a Q8_0 file's experts bit for
bit gguf's dequantization, greedy output equal to transformers' ``Qwen3_5MoeForCausalLM`` on
the original checkpoint (fp32) with and without the MTP (nextn) block (docs/gguf.md)."""

import struct

import gguf_convert
import pytest
import torch

from hybridrt import LLM, SamplingParams
from hybridrt.bench.moe_fixtures import hf_moe_reference, tiny_moe_config, write_moe_checkpoint
from hybridrt.config import ModelConfig
from hybridrt.gguf import names
from hybridrt.gguf.reader import GGUFError, GGUFFile
from hybridrt.kernels import quant
from hybridrt.loader import load_model

pytestmark = pytest.mark.skipif(gguf_convert.available() is not None,
                                reason=gguf_convert.available() or "")

# expert and shared widths multiples of 32, so that Q8_0 takes every expert matrix
CONFIG = tiny_moe_config(
    vocab_size=6208, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
    linear_value_head_dim=32, eos_token_id=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=64)
FILES = {"f32_mtp": ("f32", True, ()), "f32": ("f32", False, ()),
         "f32_fused": ("f32", True, ("--fuse-gate-up-exps",)), "q8_0_mtp": ("q8_0", True, ())}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return gguf_convert.with_tokenizer(
        write_moe_checkpoint(tmp_path_factory.mktemp("gguf-moe-src"), CONFIG, seed=3))


@pytest.fixture(scope="module")
def files(ckpt, tmp_path_factory):
    return gguf_convert.convert_all(ckpt, tmp_path_factory.mktemp("gguf-moe"), FILES)


@pytest.fixture(scope="module")
def original(ckpt):
    net, config, _ = load_model(ckpt, torch.float32, with_mtp=True)
    return net.state_dict(), config


def test_config_from_moe_metadata(files, original):
    _, want = original
    f = GGUFFile(files["f32_mtp"])
    assert f.arch == "qwen35moe" and "blk.0.ffn_gate_exps.weight" in f.tensors
    assert "blk.0.ffn_gate_up_exps.weight" in GGUFFile(files["f32_fused"]).tensors
    _, got, _ = load_model(files["f32_mtp"], "float32", with_mtp=False)
    assert got.model_type == "qwen3_5_moe_text"
    for field in ModelConfig.__slots__:
        if field not in ("eos_token_ids", "model_type"):
            assert getattr(got, field) == getattr(want, field), field


@pytest.mark.parametrize("key", ["f32_mtp", "f32", "f32_fused"])
def test_float_weights_recovered_exactly(files, original, key):
    want, config = original
    net, _, _ = load_model(files[key], "auto", with_mtp=True)
    if key == "f32":
        assert net.mtp is None
        want = {k: v for k, v in want.items() if not k.startswith("mtp.")}
    gguf_convert.check_float_weights(net.state_dict(), want, config, torch.float32)


def test_q8_0_experts_are_ggufs_dequantization(files, original):
    """Every Q8_0 weight (each expert's gate|up and down, the shared expert, attention, GDN,
    the embedding) is an int8 QuantWeight whose dequantization equals gguf's numpy
    dequantization of its matrices bit for bit; the router and the shared expert's gate are
    stored F32 by the converter and stay float."""
    from gguf.quants import dequantize

    want, config = original
    net, _, _ = load_model(files["q8_0_mtp"], "auto", with_mtp=True)
    f = GGUFFile(files["q8_0_mtp"])
    srcs = names.sources(config, True)
    packed = {n: m.qweight for n, m in net.named_modules()
              if isinstance(getattr(m, "qweight", None), quant.PackedWeight)}
    assert len(packed) == sum(w.dim() == 2 and ".mlp.gate." not in k
                              and "shared_expert_gate" not in k for k, w in want.items())
    assert sum(".experts." in n for n in packed) == 2 * 8 * 5  # 4 layers and the MTP one
    for name, qw in packed.items():
        assert isinstance(qw, quant.QuantWeight), name
        src = srcs[f"{name}.weight"]
        ref = []
        for stored in src.names:
            t = f.tensors[stored]
            assert t.tensor_type.name == "Q8_0", stored
            full = torch.from_numpy(dequantize(t.data, t.tensor_type)).view(GGUFFile.shape(t))
            ref.append(full if src.expert is None else full[src.expert])
        assert torch.equal(qw.dequantize(), names.restore(torch.cat(ref), src)), name
        orig = want[f"{name}.weight"]
        assert (qw.dequantize() - orig).abs().max() <= orig.abs().max() / 127, name
    router = net.model.layers[0].mlp.gate.weight
    assert router.dtype == torch.bfloat16 and torch.equal(
        router, want["model.layers.0.mlp.gate.weight"].bfloat16())


def test_hybridrt_quantize_reads_a_moe_gguf(files, tmp_path):
    """``hybridrt quantize`` (``save_quantized``) from the Q8_0 MoE file: a checkpoint that
    loads with every weight (experts included) as the GGUF loaded it."""
    import json

    from hybridrt.loader import save_quantized

    out = tmp_path / "q"
    save_quantized(files["q8_0_mtp"], out, "int8")
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "Qwen3_5MoeForCausalLM"]
    a, ca, _ = load_model(files["q8_0_mtp"], "auto", with_mtp=True)
    b, cb, _ = load_model(out, "auto", with_mtp=True)
    assert (cb.num_experts, cb.mtp_num_hidden_layers) == (ca.num_experts, 1)
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    for name, m in a.named_modules():
        if isinstance(getattr(m, "qweight", None), quant.PackedWeight):
            other = b.get_submodule(name).qweight
            assert all(torch.equal(x, y) for x, y in zip(m.qweight.tensors(),
                                                         other.tensors())), name


@pytest.mark.parametrize("key,spec", [("f32_mtp", 0), ("f32_mtp", 2), ("f32", 0),
                                      ("f32_fused", 2)])
def test_greedy_equals_transformers_on_the_original(files, original, key, spec):
    sd, _ = original
    ref = hf_moe_reference(CONFIG, {k: v for k, v in sd.items() if not k.startswith("mtp.")})
    prompt = torch.randint(5, 6144, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(16):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    llm = LLM(files[key], dtype="float32", max_model_len=64, max_num_seqs=2,
              cache_memory=8 << 20, speculative_tokens=spec)
    (out,) = llm.generate({"prompt_token_ids": prompt},
                          SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                          use_tqdm=False)
    assert out.outputs[0].token_ids == ids[len(prompt):]


def _tensor_info(data: bytearray, name: str) -> int:
    """The byte offset of tensor ``name``'s n_dims field in the header."""
    needle = struct.pack("<Q", len(name)) + name.encode()
    return data.index(needle) + len(needle)


def _expert_shape(data):
    """blk.0.ffn_down_exps [8, 64, 32] declared with 4 experts (its data still fits)."""
    at = _tensor_info(data, "blk.0.ffn_down_exps.weight")
    assert struct.unpack_from("<IQQQ", data, at) == (3, 32, 64, 8)
    struct.pack_into("<Q", data, at + 20, 4)


def _gate_up_types(data):
    """blk.0.ffn_up_exps declared F16 (half its F32 bytes: it still fits) beside an F32
    gate."""
    at = _tensor_info(data, "blk.0.ffn_up_exps.weight")
    assert struct.unpack_from("<I", data, at + 28)[0] == 0  # after n_dims and 3 dims
    struct.pack_into("<I", data, at + 28, 1)


@pytest.mark.parametrize("patch,expected", [
    (_expert_shape, "tensor blk.0.ffn_down_exps.weight has shape [4, 64, 32], expected "
                    "[8, 64, 32]"),
    (_gate_up_types, "tensors blk.0.ffn_gate_exps.weight and blk.0.ffn_up_exps.weight hold "
                     "one weight (the experts' gate and up) in different types (F16, F32)"),
])
def test_malformed_moe_file_is_one_line(files, tmp_path, patch, expected):
    data = bytearray(files["f32"].read_bytes())
    patch(data)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError) as e:
        load_model(bad, "float32")
    msg = str(e.value)
    assert "\n" not in msg and expected in msg, msg
