"""csrc/attn_decode.c's split decode: a row's context in partitions of 512 positions scored by
separate tasks (all query heads of a KV head at once), their partials merged in partition
order. Checked against softmax attention by hand at lengths crossing partition and block
boundaries (fp32, bf16 and int8 caches, decode and verification rows, GQA), and bitwise: a row
alone gives the bytes it gives inside batches of other rows, at 1, 2 and 3 threads."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import generator, require_native

from hybridrt.kernels import kvquant, native

SPLIT = 512  # csrc/attn_decode.c's partition
BS = 16
H, HKV, D = 8, 2, 64


@pytest.fixture(autouse=True)
def _native():
    require_native()


def _rms(x, w, eps=1e-6):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


class Rows:
    """Caches holding random KV for sequences of the given context lengths, and one step's
    inputs for L new tokens each (fp32 activations, identity RoPE)."""

    def __init__(self, ctx, L=1, kv="fp32", seed=0, act=torch.float32):
        gen = generator(seed)
        nb = sum(-(-c // BS) for c in ctx) + 3
        k = torch.randn(nb, BS, HKV, D, generator=gen)
        v = torch.randn(nb, BS, HKV, D, generator=gen)
        if kv == "int8":
            self.kc, self.vc = kvquant.quantize(k), kvquant.quantize(v)
        else:
            self.kc, self.vc = k.to(act), v.to(act)
        perm = torch.randperm(nb, generator=gen).tolist()
        width = max(-(-c // BS) for c in ctx)
        tabs = []
        for c in ctx:
            t = [perm.pop() for _ in range(-(-c // BS))]
            tabs.append(t + [t[0]] * (width - len(t)))
        self.tables = torch.tensor(tabs)
        self.ctx, self.L = list(ctx), L
        B = len(ctx)
        pos = torch.tensor([c - L + t for c in ctx for t in range(L)])
        rows = torch.arange(B).repeat_interleave(L)
        self.slots = self.tables[rows, pos // BS] * BS + pos % BS
        self.qg = torch.randn(B * L, H * 2 * D, generator=gen).to(act)
        self.k = torch.randn(B * L, HKV * D, generator=gen).to(act)
        self.v = torch.randn(B * L, HKV * D, generator=gen).to(act)
        self.qw = (0.1 * torch.randn(D, generator=gen)).to(act)
        self.kw = (0.1 * torch.randn(D, generator=gen)).to(act)
        self.cos, self.sin = torch.ones(B * L, 16, dtype=act), torch.zeros(B * L, 16, dtype=act)

    def run(self, seqs=None, threads=None):
        """The kernel over sequences ``seqs`` (default all), on copies of the caches."""
        seqs = list(range(len(self.ctx))) if seqs is None else seqs
        L = self.L
        rows = torch.tensor([b * L + t for b in seqs for t in range(L)])
        kc, vc = self.kc.clone(), self.vc.clone()
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            out = native.attn_decode(
                self.qg[rows], self.k[rows], self.v[rows], self.qw, self.kw, 1e-6,
                self.cos[rows], self.sin[rows], kc, vc, self.slots[rows], self.tables[seqs],
                torch.tensor([self.ctx[b] for b in seqs]), D ** -0.5, L, H, HKV, D)
        finally:
            torch.set_num_threads(before)
        return out, kc, vc


def _by_hand(r: Rows, out, kc, vc):
    """Each row's output against softmax attention over its positions' values (dequantized
    for int8), in fp64, times the gate -> the largest error relative to max |ref|."""
    L = r.L
    def values(c):
        flat = c.view(-1, HKV, c.shape[-1])
        return kvquant.dequantize(flat, D) if c.dtype == torch.int8 else flat.float()
    fk, fv = values(kc), values(vc)
    qv = r.qg.float().view(-1, H, 2, D)
    worst = 0.0
    for row in range(out.shape[0]):
        b, n = row // L, r.ctx[row // L] - L + row % L + 1
        p = torch.arange(n)
        sl = r.tables[b, p // BS] * BS + p % BS
        for h in range(H):
            q = _rms(qv[row, h, 0].double(), r.qw.double())
            kk, vv = fk[sl, h // (H // HKV)].double(), fv[sl, h // (H // HKV)].double()
            ref = ((q @ kk.t()) * D ** -0.5).softmax(-1) @ vv * torch.sigmoid(qv[row, h, 1])
            got = out[row].view(H, D)[h].double()
            worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
    return worst


CTX = [1, 31, SPLIT - 1, SPLIT, SPLIT + 1, 2 * SPLIT + 17, 3 * SPLIT + BS]


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("kv", ["fp32", "int8"])
def test_split_rows_equal_softmax_attention(L, kv):
    r = Rows([max(c, L) for c in CTX], L=L, kv=kv)
    out, kc, vc = r.run()
    assert _by_hand(r, out, kc, vc) < 2e-5


def test_bf16_split_rows_within_bf16_rounding():
    r = Rows(CTX, kv="bf16", act=torch.bfloat16, seed=1)
    out, kc, vc = r.run()
    assert _by_hand(r, out.float(), kc, vc) < 2e-2


@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
def test_a_row_alone_gives_its_bytes_inside_any_batch(kv):
    """The deep row (5 partitions) alone at 1 thread, then with neighbours of other lengths
    before and after it, at 1, 2 and 3 threads: the same bytes each time."""
    act = torch.bfloat16 if kv == "bf16" else torch.float32
    r = Rows([2 * SPLIT + 3, 5 * SPLIT - 7, 40, SPLIT, 3 * SPLIT + 1], kv=kv, act=act, seed=2)
    alone = r.run([1], threads=1)[0]
    for threads in (1, 2, 3):
        assert torch.equal(r.run([1], threads=threads)[0], alone), f"alone, {threads} threads"
        for seqs in ([0, 1], [1, 2, 3], [4, 3, 1, 0, 2]):
            out = r.run(seqs, threads=threads)[0]
            assert torch.equal(out[seqs.index(1)], alone[0]), f"{seqs}, {threads} threads"


@pytest.mark.parametrize("simd", [1, 2])
@pytest.mark.parametrize("L", [2, 5])
@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
def test_verification_rows_give_their_decode_bytes(kv, L, simd):
    """A verification step's rows (scored together over the partitions they share, up to four
    rows at once with AVX-512) give each row the bytes it gets as a decode row over the same
    positions: speculation changes no token."""
    act = torch.bfloat16 if kv == "bf16" else torch.float32
    r = Rows([3 * SPLIT + 5, 2 * SPLIT + L - 1, SPLIT + 2], L=L, kv=kv, act=act, seed=3)
    rows = list(range(len(r.ctx) * L))
    out = native.attn_decode(
        r.qg, r.k, r.v, r.qw, r.kw, 1e-6, r.cos, r.sin, kc := r.kc.clone(), vc := r.vc.clone(),
        r.slots, r.tables, torch.tensor(r.ctx), D ** -0.5, L, H, HKV, D, simd)
    for row in rows:
        b, n = row // L, r.ctx[row // L] - L + row % L + 1
        one = slice(row, row + 1)
        alone = native.attn_decode(
            r.qg[one], r.k[one], r.v[one], r.qw, r.kw, 1e-6, r.cos[one], r.sin[one],
            kc.clone(), vc.clone(), r.slots[one], r.tables[b:b + 1], torch.tensor([n]),
            D ** -0.5, 1, H, HKV, D, simd)
        assert torch.equal(alone[0], out[row]), f"row {row} (sequence {b}, {n} positions)"
