"""kernels/prefill_attention.py: a prompt chunk's attention over its paged KV in tiles, against
paged_attention's SDPA over the whole gathered context (bf16, fp32 and int8 caches, GQA) at
lengths crossing tile and block boundaries, and the CPU backend with small tiles against
transformers at a tiny fp32 shape (one-shot and chunked prefill)."""

from __future__ import annotations

import pytest
import torch
from helpers import PackedRunner, assert_rel_close, build_pair, hf_prefill_decode
from kernel_helpers import generator

from hybridrt.kernels import kvquant, paged_attention, prefill_attention, write_kv
from hybridrt.kernels.backend import CPUBackend
from hybridrt.kernels.prefill_attention import TiledPrefill, chunk_attention

pytestmark = pytest.mark.skipif(not prefill_attention.available(),
                                reason="torch has no CPU flash-attention kernel")

BS = 8  # block size; tiles of 16 and 24 positions


def _sequence(ctx, n, H=8, HKV=2, D=64, kv_dtype=torch.float32, seed=0):
    """One sequence of ``ctx`` tokens in shuffled blocks of a cache holding garbage elsewhere,
    its last ``n`` the chunk -> (query [n, H, D], key cache, value cache, table [1, M])."""
    gen = generator(seed)
    nb = -(-ctx // BS) + 5
    width = kvquant.packed_width(D) if kv_dtype == torch.int8 else D
    kc = torch.randint(-100, 100, (nb, BS, HKV, width), generator=gen).to(kv_dtype)
    vc = torch.randint(-100, 100, (nb, BS, HKV, width), generator=gen).to(kv_dtype)
    blocks = torch.randperm(nb, generator=gen)[:-(-ctx // BS)]
    pos = torch.arange(ctx)
    k = torch.randn(ctx, HKV, D, generator=gen)
    v = torch.randn(ctx, HKV, D, generator=gen)
    write_kv(k, v, kc, vc, blocks[pos // BS] * BS + pos % BS)
    q_dtype = torch.float32 if kv_dtype == torch.int8 else kv_dtype
    q = (2 * torch.randn(n, H, D, generator=gen)).to(q_dtype)
    return q, kc, vc, blocks[None]


def _current(q, kc, vc, table, ctx, scale):
    n = q.shape[0]
    return paged_attention(q, kc, vc, torch.tensor([0, n]), torch.tensor([ctx]), table, scale,
                           query_lens=[n], context_lens=[ctx])


# (context, chunk): chunks starting at 0, mid-block, on a tile boundary, past several tiles,
# a one-block tail, a single cached token before the chunk
SHAPES = [(37, 37), (40, 17), (48, 16), (61, 9), (100, 33), (33, 32), (16, 2)]


@pytest.mark.parametrize("ctx,n", SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("tile", [16, 24])
def test_fp32_tiles_equal_the_whole_context(ctx, n, tile):
    q, kc, vc, table = _sequence(ctx, n)
    ref = _current(q, kc, vc, table, ctx, 0.125)
    out = chunk_attention(q, kc, vc, table[0], ctx, 0.125, tile, torch.float32)
    assert_rel_close(out, ref, 2e-6, f"ctx {ctx}, chunk {n}, tile {tile}")


@pytest.mark.parametrize("ctx,n", SHAPES, ids=lambda x: str(x))
def test_int8_kv_tiles_equal_the_whole_context(ctx, n):
    """int8 caches: the tiles dequantize the same rows paged_attention does."""
    q, kc, vc, table = _sequence(ctx, n, kv_dtype=torch.int8)
    ref = _current(q, kc, vc, table, ctx, 0.125)
    out = chunk_attention(q, kc, vc, table[0], ctx, 0.125, 16, torch.float32)
    assert_rel_close(out, ref, 2e-6, f"int8, ctx {ctx}, chunk {n}")
    # computed in bf16 (what the CPU backend does on a bf16 model where bf16 matrices are fast)
    out = chunk_attention(q.bfloat16(), kc, vc, table[0], ctx, 0.125, 16, torch.bfloat16)
    assert_rel_close(out, ref, 2e-2, f"int8 in bf16, ctx {ctx}, chunk {n}")


@pytest.mark.parametrize("ctx,n", SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("fast", [False, True])
def test_bf16_hook_equals_the_whole_context(ctx, n, fast):
    """The hook as the CPU backend installs it: bf16 out, computed in bf16 (fast) or fp32,
    within bf16's rounding of the fp32 attention over the same values."""
    q, kc, vc, table = _sequence(ctx, n, kv_dtype=torch.bfloat16)
    ref = _current(q.float(), kc.float(), vc.float(), table, ctx, 0.125)
    hook = TiledPrefill(16, bf16_fast=fast, bf16_from=0)
    out = paged_attention(q, kc, vc, torch.tensor([0, n]), torch.tensor([ctx]), table, 0.125,
                          query_lens=[n], context_lens=[ctx], prefill=hook)
    assert out.dtype == torch.bfloat16
    assert_rel_close(out.float(), ref, 1e-2 if fast else 4e-3, f"ctx {ctx}, chunk {n}")


def test_queries_below_bf16_from_are_computed_in_fp32():
    """The compute dtype follows a query's position: rows before ``bf16_from`` are the fp32
    tiles' (so a short prompt's tail recomputed after a prefix-cache hit, or a few verification
    rows, round as its cold prefill did), the rest bf16 tiles' over the whole context."""
    q, kc, vc, table = _sequence(61, 33, kv_dtype=torch.bfloat16)  # positions 28 .. 60
    out = TiledPrefill(16, bf16_fast=True, bf16_from=40)(q, kc, vc, table[0], 61, 0.125)
    low = chunk_attention(q[:12], kc, vc, table[0], 40, 0.125, 16, torch.float32)
    high = chunk_attention(q[12:], kc, vc, table[0], 61, 0.125, 16, torch.bfloat16)
    assert torch.equal(out[:12], low.bfloat16())
    assert torch.equal(out[12:], high.bfloat16())
    high32 = chunk_attention(q[12:], kc, vc, table[0], 61, 0.125, 16, torch.float32)
    assert not torch.equal(high.bfloat16(), high32.bfloat16())  # the bf16 tiles differ
    short = TiledPrefill(16, bf16_fast=True)(q, kc, vc, table[0], 61, 0.125)  # all below 2048
    assert torch.equal(short, chunk_attention(q, kc, vc, table[0], 61, 0.125, 16,
                                              torch.float32).bfloat16())


def test_gqa_head_maps_to_its_kv_head():
    """Query head h reads KV head h // (H / HKV): zeroing KV head 1's values zeroes exactly
    query heads 4..7 of 8."""
    q, kc, vc, table = _sequence(40, 17)
    vc[:, :, 1] = 0
    out = chunk_attention(q, kc, vc, table[0], 40, 0.125, 16)
    assert out[:, 4:].abs().max() == 0 and out[:, :4].abs().min() > 0


def test_bad_tile_is_refused():
    q, kc, vc, table = _sequence(40, 17)
    with pytest.raises(ValueError, match="multiple of the block size"):
        chunk_attention(q, kc, vc, table[0], 40, 0.125, 12)
    with pytest.raises(ValueError, match="tile must be positive"):
        TiledPrefill(0)


@pytest.fixture(scope="module")
def tiled_pair():
    """The CPU backend with 16-position tiles on the tiny fp32 parity config."""
    from hybridrt.bench.fixtures import tiny_text_config

    net, ref, config = build_pair(tiny_text_config(), seed=0)
    backend = CPUBackend(config)
    backend.ref.prefill_attention = TiledPrefill(16)
    net.set_backend(backend)
    return net, ref, config


@pytest.mark.parametrize("pieces", [[130], [50, 1, 64, 15], [16, 17, 97]],
                         ids=lambda p: "-".join(map(str, p)))
def test_tiled_prefill_matches_transformers(tiled_pair, pieces):
    """130 tokens (8 tiles of 16, blocks of 8) one-shot and in chunks: logits within 1e-4 of
    transformers' and decoding after them too."""
    net, ref, config = tiled_pair
    prompt = torch.randint(0, config.vocab_size, (sum(pieces),),
                           generator=torch.Generator().manual_seed(3))
    ref_prefill, fed, ref_decode = hf_prefill_decode(ref, prompt, 4)
    runner = PackedRunner(net, 1, len(prompt) + 4, block_size=8)
    out, start = [], 0
    for n in pieces:
        out.append(runner.step([(0, prompt[start:start + n])])[0])
        start += n
    assert_rel_close(torch.cat(out), ref_prefill, 1e-4, f"prefill in {pieces}")
    decode = torch.cat([runner.step([(0, t.view(1))])[0] for t in fed])
    assert_rel_close(decode, ref_decode, 1e-4, "decode after it")
