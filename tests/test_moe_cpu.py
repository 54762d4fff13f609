"""MoE experts on the CPU backend: quantized at load like the dense weights (int8, 4-bit; the
router and the shared expert's gate stay in the model's dtype), written by ``hybridrt
quantize`` and read back, and the batch-invariant mode (a request's bytes whatever runs
beside it) in bf16, int8 and 4-bit."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import PackedRunner, assert_rel_close
from helpers import output_bytes as _key

from hybridrt import LLM, SamplingParams
from hybridrt.bench.moe_fixtures import tiny_moe_config, write_moe_checkpoint
from hybridrt.kernels import int4, native, quant
from hybridrt.kernels.backend import CPUBackend, ReferenceBackend
from hybridrt.loader import load_model, save_quantized

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tests/conftest.py
needs_kernels = pytest.mark.skipif(not native.half_paths(),
                                   reason="compiled CPU kernels unavailable")

# wide enough for the products' blocking to matter (the batch-invariance harness)
CFG = tiny_moe_config(hidden_size=128, head_dim=32, vocab_size=300, linear_key_head_dim=32,
                      linear_value_head_dim=32, moe_intermediate_size=64,
                      shared_expert_intermediate_size=96, num_experts=8, num_experts_per_tok=3)
VOCAB = 300
FORMATS = {"int8": quant.QuantWeight, "int4": int4.Int4Weight}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_moe_checkpoint(tmp_path_factory.mktemp("moe"), CFG, seed=2,
                                dtype=torch.bfloat16, experts="fused")


def _logits(net, config, prompt, backend=CPUBackend):
    net.set_backend(backend(config))
    return PackedRunner(net, 1, 64).step([(0, prompt)])[0]


def _dequantized(ckpt, quantization, dtype):
    """The checkpoint's model with every weight that ``quantization`` quantizes replaced by
    its dequantized value (plain tensors: the reference's math on them)."""
    net, config, _ = load_model(ckpt, dtype)
    quantized, _, _ = load_model(ckpt, dtype, quantization=quantization)
    qw = {f"{n}.weight": m.qweight for n, m in quantized.named_modules()
          if getattr(m, "qweight", None) is not None}
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name in qw:
                p.copy_(qw[name].dequantize(dtype))
    if isinstance(quantized.model.embed_tokens, quant.QuantEmbedding):
        with torch.no_grad():
            net.model.embed_tokens.weight.copy_(
                quantized.model.embed_tokens.qweight.dequantize(dtype))
    return net, quantized, config


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_experts_are_quantized_at_load(ckpt, quantization):
    """Every expert (the MTP layer's too) and the shared expert in the format, the router and
    the shared expert's gate in bf16; on the reference backend the model computes exactly
    what the dequantized weights give. (Whole-model logits are no measure of the kernels: a
    small change of a layer's input flips some token's top-k choice, a jump, not an error.)"""
    ref, net, config = _dequantized(ckpt, quantization, torch.float32)
    blocks = [m for m in net.modules() if type(m).__name__ == "SparseMoeBlock"]
    assert len(blocks) == config.num_hidden_layers + 1
    for b in blocks:
        for e in b.experts:
            for lin in (e.gate_up_proj, e.down_proj):
                assert lin.weight is None and isinstance(lin.qweight, FORMATS[quantization])
        assert isinstance(b.shared_expert.down_proj.qweight, FORMATS[quantization])
        assert b.gate.weight.dtype == b.shared_expert_gate.weight.dtype == torch.float32
    prompt = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(net, config, prompt, ReferenceBackend),
                       _logits(ref, config, prompt, ReferenceBackend))


@pytest.mark.parametrize("quantization, tol", [("int8", 0.02), ("int4", 0.05)])
def test_quantized_block_on_the_cpu_kernels(ckpt, quantization, tol):
    """One MoE block with quantized experts on the CPU backend's kernels (activations
    quantized per group of 32 too) against the same block's dequantized weights on the
    reference: the same routing (the router is not quantized), products within ``tol``, on
    37 tokens (grouped by expert, the GEMM) and on one (the k experts' GEMVs)."""
    ref, net, config = _dequantized(ckpt, quantization, torch.bfloat16)
    ref.set_backend(ReferenceBackend(config))
    net.set_backend(CPUBackend(config))
    x = torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(3))
    x = x.bfloat16()
    with torch.no_grad():
        for layer in (0, 3):
            ours, want = net.model.layers[layer].mlp, ref.model.layers[layer].mlp
            for rows in (x, x[4:5]):
                assert_rel_close(ours(rows), want(rows), tol, f"layer {layer}, {len(rows)} rows")


def test_saved_int4_checkpoint_is_read_back(ckpt, tmp_path):
    """``save_quantized`` writes every expert's 4-bit tensors; the saved checkpoint loads them
    unchanged and computes the same logits as quantizing at load."""
    out = save_quantized(ckpt, tmp_path / "q", "int4")["path"]
    fresh, config, _ = load_model(ckpt, torch.bfloat16, quantization="int4")
    stored, _, _ = load_model(out, torch.bfloat16)
    qf = {n: m.qweight for n, m in fresh.named_modules() if getattr(m, "qweight", None)}
    qs = {n: m.qweight for n, m in stored.named_modules() if getattr(m, "qweight", None)}
    assert qf.keys() == qs.keys() and "model.layers.0.mlp.experts.7.down_proj" in qs
    assert all(torch.equal(a, b) for n in qf for a, b in zip(qf[n].tensors(), qs[n].tensors()))
    prompt = torch.tensor([5, 9, 2, 77, 31, 8])
    assert torch.equal(_logits(fresh, config, prompt), _logits(stored, config, prompt))


SETTINGS = [("bfloat16", None), ("bfloat16", "int8"), ("bfloat16", "int4")]


@needs_kernels
@pytest.mark.parametrize("setting", SETTINGS, ids=["bf16", "int8", "int4"])
def test_batch_invariant_outputs_do_not_depend_on_the_batch(ckpt, setting):
    """batch_invariant=True: two targets (greedy, seeded sampling) alone at k=0 against runs
    among random neighbours with other step budgets and k=2: the same token ids and logprob
    bytes."""
    dtype, quantization = setting
    rng = random.Random(0)
    targets = [([rng.randrange(3, VOCAB) for _ in range(n)], SamplingParams(
        ignore_eos=True, max_tokens=10, logprobs=1, **p))
        for n, p in ((37, dict(temperature=0)), (21, dict(temperature=0.8, seed=5)))]

    def llm(**kw):
        return LLM(ckpt, dtype=dtype, quantization=quantization, batch_invariant=True,
                   speculative_tokens=2, max_model_len=128, cache_memory=32 << 20, **kw)

    alone = llm(max_num_batched_tokens=64)
    ref = [_key(alone.generate([p], [sp], use_tqdm=False, speculative_tokens=0)[0])
           for p, sp in targets]
    for budget, k in ((7, 2), (33, 0)):
        items = list(targets) + [([rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 50))],
                                  SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True,
                                                 temperature=rng.choice([0, 1.0])))
                                 for _ in range(4)]
        order = list(range(len(items)))
        rng.shuffle(order)
        outs = llm(max_num_batched_tokens=budget, max_num_seqs=4).generate(
            [items[i][0] for i in order], [items[i][1] for i in order], use_tqdm=False,
            speculative_tokens=k)
        got = {i: _key(o) for i, o in zip(order, outs) if i < len(targets)}
        assert [got[0], got[1]] == ref, (budget, k)


def test_shape_checkpoint_is_written_quantized_and_runs(tmp_path):
    """``bench/moe_shape.py`` (here with the tiny widths): written in 4 bits straight away,
    it loads without quantizing again and decodes; the layer count is the one asked."""
    from hybridrt.bench.moe_shape import write_shape_checkpoint

    info = write_shape_checkpoint(tmp_path / "s", layers=5, quantization="int4",
                                  text_config=tiny_moe_config(tie_word_embeddings=False))
    llm = LLM(info["path"], cache_memory=16 << 20, max_model_len=64)
    assert llm.quantization == "int4" and llm.model.config.num_hidden_layers == 5
    assert llm.model.config.layer_types[3] == "full_attention"
    two = write_shape_checkpoint(tmp_path / "two", layers=2, quantization="int8",
                                 text_config=tiny_moe_config())
    assert LLM(two["path"], cache_memory=16 << 20).model.config.layer_types == [
        "linear_attention", "full_attention"]
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_shape_checkpoint_distinct_layers_repeat_the_first_ones(tmp_path):
    """``--distinct-layers 4`` of 8: layers 4-7 hold layers 0-3's tensors byte for byte (each in
    its own shard, quantized parts included), layers 0-3 are those of a run without it, and
    the checkpoint loads and decodes; a count that is no multiple of the interval is refused."""
    from safetensors import safe_open

    from hybridrt.bench.moe_shape import write_shape_checkpoint

    cfg = tiny_moe_config(tie_word_embeddings=False)
    write_shape_checkpoint(tmp_path / "r", layers=8, quantization="int4", text_config=cfg,
                           distinct=4)
    write_shape_checkpoint(tmp_path / "all", layers=8, quantization="int4", text_config=cfg)

    def tensors(d):
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
        return out

    r, full = tensors(tmp_path / "r"), tensors(tmp_path / "all")
    assert r.keys() == full.keys()
    for name, x in r.items():
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            src = name.replace(f"model.layers.{i}.", f"model.layers.{i % 4}.", 1)
            assert torch.equal(x, full[src]), name
    assert not torch.equal(full["model.layers.5.mlp.experts.0.down_proj.weight.codes"],
                           full["model.layers.1.mlp.experts.0.down_proj.weight.codes"])
    llm = LLM(str(tmp_path / "r"), cache_memory=16 << 20, max_model_len=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="multiple of 4"):
        write_shape_checkpoint(tmp_path / "bad", layers=8, text_config=cfg, distinct=3)


def test_shape_checkpoint_bf16_is_published_layout_and_quantizes_to_the_straight_one(tmp_path):
    """``bench/moe_shape.py`` in bf16: shards (one per decoder layer) and an index, the
    published names and per-expert experts (what llama.cpp's converter reads); ``hybridrt
    quantize`` of it is tensor for tensor the checkpoint written in 4 bits straight away."""
    import json

    from safetensors import safe_open

    from hybridrt.bench.moe_shape import write_shape_checkpoint
    from hybridrt.quantize_stream import quantize_streaming

    cfg = tiny_moe_config(tie_word_embeddings=False)
    bf16 = write_shape_checkpoint(tmp_path / "bf16", layers=2, quantization=None, text_config=cfg)
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
    wmap = index["weight_map"]
    assert len(set(wmap.values())) == 5  # embedding, 2 layers, norm + head, MTP
    assert "model.language_model.layers.1.mlp.experts.3.up_proj.weight" in wmap
    assert wmap["model.language_model.layers.0.mlp.experts.0.gate_proj.weight"] != wmap[
        "model.language_model.layers.1.mlp.experts.0.gate_proj.weight"]
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["model_type"] == \
        "qwen3_5_moe"
    quantize_streaming(bf16["path"], tmp_path / "q", "int4")
    write_shape_checkpoint(tmp_path / "straight", layers=2, quantization="int4", text_config=cfg)

    def tensors(d):
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                stored = h.keys()
                out.update({k: h.get_tensor(k) for k in stored})
        return out

    got, want = tensors(tmp_path / "q"), tensors(tmp_path / "straight")
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_read_ceiling_counts_only_the_chosen_experts(ckpt):
    """The bench's bytes a batch-1 decode step reads: k of each layer's E experts."""
    from hybridrt.bench.ceilings import weight_bytes_per_token

    net, config, _ = load_model(ckpt, torch.bfloat16, with_mtp=False)
    every = sum(p.numel() * 2 for p in net.parameters())
    untied_embedding = config.vocab_size * config.hidden_size * 2
    expert = 3 * config.moe_intermediate_size * config.hidden_size * 2
    unread = config.num_hidden_layers * (config.num_experts - config.num_experts_per_tok)
    want = every - unread * expert - (0 if config.tie_word_embeddings else untied_embedding)
    assert weight_bytes_per_token(net) == want
    net, config, _ = load_model(ckpt, torch.bfloat16, with_mtp=True)
    if config.mtp_num_hidden_layers:  # an MoE MTP layer: a draft pass reads k experts too
        mtp = sum(p.numel() * 2 for p in net.mtp.parameters())
        unread = config.mtp_num_hidden_layers * (config.num_experts - config.num_experts_per_tok)
        assert net.bytes_read(mtp=True) == mtp - unread * expert
        assert net.bytes_read() == want
