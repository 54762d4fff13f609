"""kernels/rope.py: the partial rotary embedding against transformers' (text positions of its
mrope)."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import generator

from hybridrt.kernels import apply_partial_rope, rope_cos_sin
from hybridrt.kernels.rope import RopeRows


def _hf_rotary(text_config):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    cfg = dict(text_config)
    cfg.pop("model_type", None)
    return Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(**cfg))


@pytest.mark.parametrize("shape", ["tiny-R6-D12", "0.8B-R64-D256"])
def test_rope_cos_sin_matches_transformers_mrope_for_text(shape):
    """Text-only input: the three M-RoPE rows are equal, so interleaved M-RoPE == 1-D RoPE."""
    from hybridrt.bench.fixtures import QWEN35_08B_TEXT_CONFIG, tiny_text_config

    text = tiny_text_config() if shape.startswith("tiny") else QWEN35_08B_TEXT_CONFIG
    rope = text["rope_parameters"]
    R = int(text["head_dim"] * rope["partial_rotary_factor"])
    positions = torch.tensor([0, 1, 2, 7, 63, 64, 1000, 4095])
    cos, sin = rope_cos_sin(positions, R, rope["rope_theta"], torch.float32)
    hf_cos, hf_sin = _hf_rotary(text)(torch.zeros(1, dtype=torch.float32), positions[None])
    assert cos.shape == (positions.numel(), R)
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("T,H,D,R", [(9, 3, 12, 6), (5, 2, 10, 4), (4, 2, 8, 8)],
                         ids=lambda v: str(v))
def test_partial_rope_matches_transformers_and_passes_through(T, H, D, R):
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    gen = generator(16)
    q = torch.randn(T, H, D, generator=gen)
    k = torch.randn(T, 1, D, generator=gen)
    positions = torch.arange(T) * 7 + 3
    cos, sin = rope_cos_sin(positions, R, 10000.0, torch.float32)
    q_out, k_out = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
    # dims >= R untouched, bitwise
    assert torch.equal(q_out[..., R:], q[..., R:])
    assert torch.equal(k_out[..., R:], k[..., R:])
    # rotate-half pairs (i, i + R/2) keep their norm; the rotated part really moves
    half = R // 2

    def pair_norm(t):
        return t[..., :half] ** 2 + t[..., half:R] ** 2

    torch.testing.assert_close(pair_norm(q_out), pair_norm(q))
    assert not torch.allclose(q_out[..., :R], q[..., :R])
    # transformers layout: [B, H, T, D] with cos/sin [B, T, R]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      cos[None], sin[None])
    torch.testing.assert_close(q_out, hf_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(k_out, hf_k[0].transpose(0, 1), rtol=0, atol=1e-6)


def test_rope_position_zero_is_identity():
    x = torch.randn(1, 2, 12)
    cos, sin = rope_cos_sin(torch.tensor([0]), 6, 1e7, torch.float32)
    assert torch.equal(apply_partial_rope(x, cos, sin), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_rope_rows_are_rope_cos_sins_bits(dtype, threads):
    """RopeRows (the CPU backend's RoPE): by position the bits rope_cos_sin gives for the same
    positions in a step of any length, across the table's blocks and its growth; the Qwen3.5
    rotary width (64) and its own rows when asked in any order."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = RopeRows(64, 10_000_000.0)
        for pos in (torch.tensor([3]), torch.tensor([255, 256, 0]), torch.arange(700),
                    torch.tensor([1000, 7, 999]), torch.arange(513, 530)):
            cos, sin = rows(pos, dtype)
            rc, rs = rope_cos_sin(pos, 64, 10_000_000.0, dtype)
            assert cos.dtype == dtype and cos.shape == (len(pos), 64)
            assert torch.equal(cos, rc) and torch.equal(sin, rs)
            assert cos.is_contiguous() and sin.is_contiguous()
        # blocks of 256 positions, at least doubling: 256, 512, 1024
        assert rows.tables[(dtype, pos.device)][0].shape[0] == 1024
    finally:
        torch.set_num_threads(before)


def test_cpu_backend_rope_by_table_where_its_width_allows():
    """The CPU backend looks RoPE up (RopeRows) where the width is a multiple of 32, else
    computes it; the batch-invariant mode keeps its own table."""
    from hybridrt.kernels.backend.cpu import CPUBackend
    from hybridrt.kernels.options import KernelOptions
    b = CPUBackend(None, options=KernelOptions())
    pos = torch.tensor([5, 9])
    b.rope(pos, 64, 1e6, torch.bfloat16)
    assert isinstance(b.rope_table, RopeRows)
    b2 = CPUBackend(None, options=KernelOptions())
    c, s = b2.rope(pos, 12, 1e6, torch.bfloat16)
    assert b2.rope_table is None and torch.equal(c, rope_cos_sin(pos, 12, 1e6, torch.bfloat16)[0])
