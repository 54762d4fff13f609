"""kernels/attention.py: paged attention over a mixed batch against a dense reference, prompts
against varlen causal attention, and sequences isolated from each other (padding and other
requests' blocks never leak into a sequence's output)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rel_close
from kernel_helpers import TOL, generator

from hybridrt.kernels import paged_attention, varlen_causal_attention, write_kv


def dense_reference(q, k, v, ctx, scale):
    """One sequence, plain softmax: q [n, H, D] at positions ctx-n.., k/v [ctx, HKV, D]."""
    n, H, _ = q.shape
    HKV = k.shape[1]
    out = torch.empty_like(q)
    for h in range(H):
        kv = h // (H // HKV)  # consecutive query heads share a kv head
        scores = (q[:, h] @ k[:, kv].t()) * scale  # [n, ctx]
        pos = torch.arange(ctx - n, ctx)
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos[:, None], float("-inf"))
        out[:, h] = scores.softmax(-1) @ v[:, kv]
    return out


def paged_setup(ctx_q, H=6, HKV=2, D=10, block_size=8, num_blocks=48, seed=17):
    """Random KV for each sequence written into shuffled, non-contiguous blocks.
    ctx_q: [(context length incl. new tokens, new tokens)] per sequence."""
    gen = generator(seed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = 5 * torch.randn(num_blocks, block_size, HKV, D, generator=gen)  # garbage
    v_cache = 5 * torch.randn(num_blocks, block_size, HKV, D, generator=gen)
    seqs, tables, qs = [], [], []
    for ctx, _ in ctx_q:
        nb = -(-ctx // block_size)
        blocks = [perm.pop() for _ in range(nb)]
        k = torch.randn(ctx, HKV, D, generator=gen)
        v = torch.randn(ctx, HKV, D, generator=gen)
        pos = torch.arange(ctx)
        slot_mapping = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        write_kv(k, v, k_cache, v_cache, slot_mapping)
        seqs.append((k, v))
        tables.append(blocks)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [perm[0]] * (width - len(t)) for t in tables])
    for _ctx, n in ctx_q:
        qs.append(torch.randn(n, H, D, generator=gen))
    query = torch.cat(qs)
    cu = torch.tensor([0] + [n for _, n in ctx_q]).cumsum(0)
    seq_lens = torch.tensor([c for c, _ in ctx_q])
    return query, k_cache, v_cache, cu, seq_lens, block_tables, seqs, D**-0.5


MIXED = [(17, 1), (40, 40), (1, 1), (33, 9), (64, 64), (5, 1), (70, 1)]


def test_paged_attention_mixed_batch_matches_dense_reference():
    query, kc, vc, cu, seq_lens, bt, seqs, scale = paged_setup(MIXED)
    out = paged_attention(query, kc, vc, cu, seq_lens, bt, scale)
    for b, ((ctx, n), (k, v)) in enumerate(zip(MIXED, seqs)):
        s, e = cu[b].item(), cu[b + 1].item()
        ref = dense_reference(query[s:e], k, v, ctx, scale)
        assert_rel_close(out[s:e], ref, TOL, f"seq {b} (ctx {ctx}, q_len {n})")
    # host-side lengths give the same answer
    out2 = paged_attention(query, kc, vc, cu, seq_lens, bt, scale,
                           query_lens=[n for _, n in MIXED], context_lens=[c for c, _ in MIXED])
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


def test_paged_attention_prefill_equals_varlen_causal_attention():
    ctx_q = [(40, 40), (1, 1), (63, 63), (9, 9)]
    query, kc, vc, cu, seq_lens, bt, seqs, scale = paged_setup(ctx_q, seed=18)
    out = paged_attention(query, kc, vc, cu, seq_lens, bt, scale)
    k = torch.cat([k for k, _ in seqs])
    v = torch.cat([v for _, v in seqs])
    dense = varlen_causal_attention(query, k, v, cu, scale)
    assert_rel_close(out, dense, TOL, "paged vs varlen")
    for b, ((ctx, _), (kb, vb)) in enumerate(zip(ctx_q, seqs)):
        s, e = cu[b].item(), cu[b + 1].item()
        assert_rel_close(dense[s:e], dense_reference(query[s:e], kb, vb, ctx, scale), TOL,
                         f"varlen seq {b}")


def test_paged_attention_sequences_never_see_each_others_kv():
    """Rewriting every block a sequence does not own leaves its output bitwise unchanged."""
    query, kc, vc, cu, seq_lens, bt, _, scale = paged_setup(MIXED, seed=19)
    out = paged_attention(query, kc, vc, cu, seq_lens, bt, scale)
    for b, (ctx, _) in enumerate(MIXED):
        owned = bt[b, : -(-ctx // kc.shape[1])].tolist()
        others = [i for i in range(kc.shape[0]) if i not in owned]
        kc2, vc2 = kc.clone(), vc.clone()
        kc2[others] = 1e3 * torch.randn(len(others), *kc.shape[1:])
        vc2[others] = 1e3 * torch.randn(len(others), *vc.shape[1:])
        out2 = paged_attention(query, kc2, vc2, cu, seq_lens, bt, scale)
        s, e = cu[b].item(), cu[b + 1].item()
        assert torch.equal(out2[s:e], out[s:e]), f"sequence {b} read a block it does not own"


def test_varlen_causal_attention_isolates_sequences():
    gen = generator(20)
    cu = torch.tensor([0, 5, 12, 13])
    q = torch.randn(13, 4, 8, generator=gen)
    k = torch.randn(13, 2, 8, generator=gen)
    v = torch.randn(13, 2, 8, generator=gen)
    out = varlen_causal_attention(q, k, v, cu, 8**-0.5)
    k2, v2 = k.clone(), v.clone()
    k2[5:12] += 10.0
    v2[5:12] -= 10.0
    out2 = varlen_causal_attention(q, k2, v2, cu, 8**-0.5)
    torch.testing.assert_close(out2[:5], out[:5], rtol=0, atol=0)
    torch.testing.assert_close(out2[12:], out[12:], rtol=0, atol=0)
    assert not torch.allclose(out2[5:12], out[5:12])


def test_paged_attention_rejects_bad_gqa():
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(torch.randn(1, 5, 4), torch.zeros(2, 4, 2, 4), torch.zeros(2, 4, 2, 4),
                        torch.tensor([0, 1]), torch.tensor([1]), torch.tensor([[0]]), 0.5)


def test_decode_batch_ignores_non_finite_padding_and_foreign_blocks():
    torch.manual_seed(0)
    kc, vc = torch.randn(8, 4, 2, 16), torch.randn(8, 4, 2, 16)
    q = torch.randn(2, 4, 16)
    tables = torch.tensor([[1, 2], [3, 0]])  # seq 1 pads its table with block 0 (not its own)
    lens = torch.tensor([6, 2])
    cu = torch.tensor([0, 1, 2])
    ref = paged_attention(q, kc, vc, cu, lens, tables, 0.25)
    for cache in (kc, vc):
        cache[2, 2:] = float("nan")  # seq 0 past its length
        cache[3, 2:] = float("inf")  # seq 1 past its length
        cache[0] = float("nan")  # the padding block
    out = paged_attention(q, kc, vc, cu, lens, tables, 0.25)
    assert torch.equal(out, ref)
