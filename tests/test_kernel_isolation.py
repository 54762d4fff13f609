"""Padding and other requests' blocks never leak into a sequence's attention output."""

import torch

from hybridrt.kernels import paged_attention


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
