"""Triton paged attention (decode / verify) and write_kv against the plain-torch reference."""

import pytest
import torch

from hybridrt.kernels.attention import paged_attention as ref_paged_attention
from hybridrt.kernels.attention import write_kv as ref_write_kv
from hybridrt.kernels.cuda.attention import (
    paged_attention_decode,
    paged_attention_varlen,
    varlen_tiles,
    varlen_tokens_per_tile,
    write_kv,
)

GARBAGE_BLOCK_IDS = (-5, 10**6, 2**31 - 1, -(2**31))


def _make_case(device, dtype, *, bs, H, HKV, D, lens, L=1, seed=0, qlens=None):
    """Random paged KV for sequences of the given lengths, NaN everywhere a sequence does not own;
    ``L`` new tokens' queries per sequence (or ``qlens[b]`` for sequence b).

    Returns (query, key_cache, value_cache, bt_kernel, bt_ref, seq_lens): ``bt_kernel`` has
    garbage (out-of-range) padded entries, ``bt_ref`` points them at an all-NaN block instead
    (the reference gathers past each sequence's length, the kernel must not).
    """
    g = torch.Generator().manual_seed(seed)
    nblk = [(n + bs - 1) // bs for n in lens]
    M = max(nblk) + 1
    NB = sum(nblk) + 3  # spare blocks stay NaN (foreign / free)
    kc = torch.full((NB, bs, HKV, D), float("nan"), dtype=dtype)
    vc = torch.full_like(kc, float("nan"))
    perm = torch.randperm(NB, generator=g)
    nan_block = int(perm[-1])
    bt_k = torch.empty((len(lens), M), dtype=torch.int32)
    bt_r = torch.full((len(lens), M), nan_block, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        blocks = perm[used:used + nblk[b]]
        used += nblk[b]
        for i, blk in enumerate(blocks.tolist()):
            valid = min(bs, n - i * bs)
            kc[blk, :valid] = torch.randn((valid, HKV, D), generator=g).to(dtype)
            vc[blk, :valid] = torch.randn((valid, HKV, D), generator=g).to(dtype)
        bt_r[b, :nblk[b]] = blocks
        bt_k[b] = torch.tensor(
            [GARBAGE_BLOCK_IDS[(b + j) % len(GARBAGE_BLOCK_IDS)] for j in range(M)])
        bt_k[b, :nblk[b]] = blocks
    # A strided query view (like the q half of a fused q/gate projection).
    qlens = [L] * len(lens) if qlens is None else qlens
    qg = torch.randn((sum(qlens), H, 2 * D), generator=g).to(dtype)
    for b, n in enumerate(lens):
        if n <= 0:
            start = sum(qlens[:b])
            qg[start:start + qlens[b]] = float("nan")
    query = qg.to(device)[..., :D]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return (query, kc.to(device), vc.to(device), bt_k.to(device), bt_r.to(device),
            seq_lens.to(device))


def _reference(query, kc, vc, bt_ref, seq_lens, scale, L):
    """Reference over the non-padding sequences; padding rows expected to be zero."""
    lens = seq_lens.tolist()
    keep = [b for b, n in enumerate(lens) if n > 0]
    out = torch.zeros(query.shape, dtype=query.dtype)
    if not keep:
        return out
    rows = torch.tensor([b * L + t for b in keep for t in range(L)])
    cu = torch.arange(len(keep) + 1, dtype=torch.int32) * L
    idx = torch.tensor(keep)
    o = ref_paged_attention(query.cpu()[rows], kc.cpu(), vc.cpu(), cu, seq_lens.cpu()[idx],
                            bt_ref.cpu()[idx], scale)
    out[rows] = o
    return out


def _check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=2e-5)
    else:
        torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2e-2, atol=2e-2)


def _lens(bs, L):
    lens = [max(L, 1), bs - 1, bs, bs + 1, 3 * bs + 2, 0, 70]
    return [n if n == 0 else max(n, L) for n in lens]


# Every pair of settings of any two of (new tokens L, block size, grouped or equal heads,
# partitions) in some case: the cross product's 16 cases ran each kernel path many times over.
DECODE_CASES = [(1, 4, (4, 2), 1), (1, 16, (2, 2), 3), (3, 4, (2, 2), 3), (3, 16, (4, 2), 3),
                (3, 16, (2, 2), 1)]


@pytest.mark.parametrize("L, bs, heads, parts", DECODE_CASES)
def test_paged_attention_fp32(device, L, bs, heads, parts):
    H, HKV = heads
    D = 16
    lens = _lens(bs, L)
    q, kc, vc, bt_k, bt_r, sl = _make_case(device, torch.float32, bs=bs, H=H, HKV=HKV, D=D,
                                           lens=lens, L=L, seed=L * 100 + bs + parts)
    scale = D ** -0.5
    out = paged_attention_decode(q, kc, vc, bt_k, sl, scale, num_queries_per_seq=L,
                                 num_partitions=parts)
    _check(out, _reference(q, kc, vc, bt_r, sl, scale, L), torch.float32)


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("parts", [1, 2])
def test_paged_attention_bf16_realistic(device, L, parts):
    """Qwen3.5-0.8B head shape (H=8, HKV=2, D=256, block 16), bf16."""
    lens = [100, 17, 0, 33, L]
    q, kc, vc, bt_k, bt_r, sl = _make_case(device, torch.bfloat16, bs=16, H=8, HKV=2, D=256,
                                           lens=lens, L=L, seed=7 + L)
    scale = 256 ** -0.5
    out = paged_attention_decode(q, kc, vc, bt_k, sl, scale, num_queries_per_seq=L,
                                 num_partitions=parts)
    _check(out, _reference(q, kc, vc, bt_r, sl, scale, L), torch.bfloat16)


@pytest.mark.parametrize("L", [1, 2])
def test_paged_attention_bf16_small(device, L):
    lens = [1, 3, 4, 5, 0, 14]
    lens = [n if n == 0 else max(n, L) for n in lens]
    q, kc, vc, bt_k, bt_r, sl = _make_case(device, torch.bfloat16, bs=4, H=4, HKV=2, D=32,
                                           lens=lens, L=L, seed=3)
    out = paged_attention_decode(q, kc, vc, bt_k, sl, 0.3, num_queries_per_seq=L,
                                 num_partitions=2)
    _check(out, _reference(q, kc, vc, bt_r, sl, 0.3, L), torch.bfloat16)


def test_paged_attention_auto_partitions(device):
    """Partition count from a large max_seq_len hint (most partitions empty) and a too-small
    hint (one partition for a long context): both exact."""
    lens = [70, 0]
    q, kc, vc, bt_k, bt_r, sl = _make_case(device, torch.float32, bs=4, H=4, HKV=2, D=16,
                                           lens=lens, L=1, seed=11)
    ref = _reference(q, kc, vc, bt_r, sl, 0.25, 1)
    for hint in (8192, 1):
        out = paged_attention_decode(q, kc, vc, bt_k, sl, 0.25, max_seq_len=hint)
        _check(out, ref, torch.float32)


def _varlen(device, q, kc, vc, bt, sl, qlens, scale, tokens, seqs=None, out=None):
    seqs = range(len(qlens)) if seqs is None else seqs
    ts, tq = varlen_tiles(qlens, seqs, tokens)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], device=device)
    return paged_attention_varlen(q, kc, vc, bt, sl, cu, torch.tensor(ts, device=device),
                                  torch.tensor(tq, device=device), scale, tokens, out=out)


# (context, new tokens): decodes, a verification, continued chunks that end inside and on a
# KV block, a fresh prompt, a chunk longer than two tiles
VARLEN_SEQS = [(9, 1), (30, 4), (70, 20), (17, 17), (40, 8), (1, 1), (45, 37)]


# Every tile size with every head layout, each of both with both block sizes (the cross
# product's 18 cases repeated each pair).
VARLEN_CASES = [(1, 4, (4, 2)), (1, 16, (3, 1)), (1, 4, (2, 2)), (4, 16, (4, 2)),
                (4, 4, (3, 1)), (4, 16, (2, 2)), (16, 4, (4, 2)), (16, 16, (3, 1)),
                (16, 16, (2, 2))]


@pytest.mark.parametrize("tokens, bs, heads", VARLEN_CASES)
def test_paged_attention_varlen_fp32(device, tokens, bs, heads):
    """Any mix of new-token counts (a step with prompt chunks) against the reference, with
    tiles of 1, 4 and 16 tokens (a sequence over several tiles, a tile half full)."""
    H, HKV = heads
    lens, qlens = zip(*VARLEN_SEQS)
    q, kc, vc, bt_k, bt_r, sl = _make_case(device, torch.float32, bs=bs, H=H, HKV=HKV, D=16,
                                           lens=list(lens), qlens=list(qlens), seed=bs + tokens)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    ref = ref_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), cu, sl.cpu(), bt_r.cpu(), 0.25)
    out = _varlen(device, q, kc, vc, bt_k, sl, list(qlens), 0.25, tokens)
    _check(out, ref, torch.float32)


def test_paged_attention_varlen_bf16_realistic(device):
    """Qwen3.5-0.8B head shape (H=8, HKV=2, D=256, block 16), bf16, the tile size the backend
    picks for it."""
    tokens = varlen_tokens_per_tile(8, 2)
    assert tokens == 16
    lens, qlens = (100, 37, 3, 64), (1, 20, 3, 33)
    q, kc, vc, bt_k, bt_r, sl = _make_case(device, torch.bfloat16, bs=16, H=8, HKV=2, D=256,
                                           lens=list(lens), qlens=list(qlens), seed=9)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 256 ** -0.5
    ref = ref_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), cu, sl.cpu(), bt_r.cpu(), scale)
    _check(_varlen(device, q, kc, vc, bt_k, sl, list(qlens), scale, tokens), ref,
           torch.bfloat16)


def test_paged_attention_varlen_writes_only_tiled_rows(device):
    """Only the tiled sequences' rows are written into ``out`` (the backend fills fresh
    prompts' rows by SDPA); a step with no tiles writes nothing."""
    lens, qlens = zip(*VARLEN_SEQS)
    q, kc, vc, bt_k, bt_r, sl = _make_case(device, torch.float32, bs=4, H=4, HKV=2, D=16,
                                           lens=list(lens), qlens=list(qlens), seed=2)
    cu = [0, *torch.tensor(qlens).cumsum(0).tolist()]
    ref = ref_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), torch.tensor(cu), sl.cpu(),
                              bt_r.cpu(), 0.25)
    seqs = [0, 2, 6]
    out = torch.full(q.shape, 7.0, device=device)
    _varlen(device, q, kc, vc, bt_k, sl, list(qlens), 0.25, 4, seqs=seqs, out=out)
    for b in range(len(qlens)):
        got, want = out[cu[b]:cu[b + 1]].cpu(), ref[cu[b]:cu[b + 1]]
        if b in seqs:
            _check(got, want, torch.float32)
        else:
            assert (got == 7.0).all(), f"sequence {b} written"
    none = torch.full(q.shape, 7.0, device=device)
    _varlen(device, q, kc, vc, bt_k, sl, list(qlens), 0.25, 4, seqs=[], out=none)
    assert (none == 7.0).all()


def test_varlen_tiles():
    assert varlen_tiles([3, 1, 9], [0, 2], 4) == ([0, 2, 2, 2], [0, 0, 4, 8])
    assert varlen_tiles([3], [], 4) == ([], [])
    assert [varlen_tokens_per_tile(h, 2) for h in (2, 4, 6, 8, 16, 32)] == [64, 32, 16, 16, 8, 4]


def test_paged_attention_all_padding(device):
    q, kc, vc, bt_k, _, sl = _make_case(device, torch.float32, bs=4, H=2, HKV=1, D=16,
                                        lens=[0, 0], L=2, seed=5)
    sl = torch.tensor([0, -3], dtype=torch.int32, device=device)
    for parts in (1, 2):
        out = paged_attention_decode(q, kc, vc, bt_k, sl, 0.25, num_queries_per_seq=2,
                                     num_partitions=parts)
        assert torch.equal(out.cpu(), torch.zeros_like(out.cpu()))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv(device, cache_dtype):
    g = torch.Generator().manual_seed(0)
    NB, BS, HKV, D, T = 5, 4, 3, 10, 7
    kc = torch.full((NB, BS, HKV, D), float("nan"), dtype=cache_dtype)
    kc[1] = 7.0  # a foreign sentinel value
    vc = torch.full_like(kc, -3.0)
    # strided views: key/value are slices of one fused projection output
    kv = torch.randn((T, HKV, 3 * D), generator=g)
    key, value = kv[..., :D], kv[..., 2 * D:]
    slots = torch.tensor([5, -1, 19, 0, -7, 12, 3], dtype=torch.int64)
    exp_k, exp_v = kc.clone(), vc.clone()
    keep = slots >= 0
    ref_write_kv(key[keep], value[keep], exp_k, exp_v, slots[keep])

    kc_d, vc_d = kc.to(device), vc.to(device)
    write_kv(key.to(device), value.to(device), kc_d, vc_d, slots.to(device))
    torch.testing.assert_close(kc_d.cpu(), exp_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(vc_d.cpu(), exp_v, rtol=0, atol=0, equal_nan=True)
    # int32 slots and the realistic shape
    kc2 = torch.zeros((4, 16, 2, 256), dtype=cache_dtype, device=device)
    vc2 = torch.zeros_like(kc2)
    k2 = torch.randn((3, 2, 256), generator=g).to(device)
    v2 = torch.randn((3, 2, 256), generator=g).to(device)
    s2 = torch.tensor([17, -1, 63], dtype=torch.int32, device=device)
    write_kv(k2, v2, kc2, vc2, s2)
    assert torch.equal(kc2.view(64, 2, 256)[[17, 63]].cpu(), k2[[0, 2]].to(cache_dtype).cpu())
    assert torch.equal(vc2.view(64, 2, 256)[[17, 63]].cpu(), v2[[0, 2]].to(cache_dtype).cpu())
    assert kc2.view(64, -1).abs().sum(1).ne(0).sum().item() == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_paged_attention_cuda_graph(device):
    """Captured once (split-KV on), replayed with other seq_lens in the same buffer."""
    lens = [40, 3, 0, 17]
    q, kc, vc, bt_k, bt_r, sl = _make_case(device, torch.bfloat16, bs=16, H=8, HKV=2, D=256,
                                           lens=lens, L=2, seed=1)
    q = q.contiguous()

    def run():
        return paged_attention_decode(q, kc, vc, bt_k, sl, 0.0625, num_queries_per_seq=2,
                                      max_seq_len=4096)

    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for new_lens in ([40, 3, 0, 17], [25, 0, 0, 9], [1, 2, 0, 16]):  # within owned positions
        sl.copy_(torch.tensor(new_lens, dtype=sl.dtype))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, _reference(q, kc, vc, bt_r, sl, 0.0625, 2), torch.bfloat16)


def _bench(sweep: bool) -> None:  # pragma: no cover - manual, on a GPU
    """Timings at the Qwen3.5-0.8B attention shape (H=8, HKV=2, D=256, block 16, bf16).

    ``python tests/gpu/test_attention.py [--sweep]``: microseconds per call (CUDA-graph
    replay of 20 calls) and the KV read bandwidth it implies.
    """
    import hybridrt.kernels.cuda.attention as A

    dev, H, HKV, D, BS, dt = "cuda", 8, 2, 256, 16, torch.bfloat16

    def setup(B, ctx, L):
        nb = B * ((ctx + BS - 1) // BS)
        kc = torch.randn(nb, BS, HKV, D, device=dev, dtype=dt)
        vc = torch.randn_like(kc)
        bt = torch.randperm(nb, device=dev, dtype=torch.int32).view(B, -1)
        sl = torch.full((B,), ctx, device=dev, dtype=torch.int32)
        q = torch.randn(B * L, H, D, device=dev, dtype=dt)
        return q, kc, vc, bt, sl

    def timeit(fn, n=20, reps=10):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())  # inputs were made on the default stream
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                fn()
        g.replay()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            torch.cuda.synchronize()
            best = min(best, e0.elapsed_time(e1) * 1e3 / n)
        return best

    def one(B, ctx, L, **kw):
        q, kc, vc, bt, sl = setup(B, ctx, L)
        us = timeit(lambda: A.paged_attention_decode(q, kc, vc, bt, sl, D ** -0.5, L,
                                                      max_seq_len=ctx, **kw))
        gbs = B * ctx * 2 * HKV * D * 2 / us / 1e3
        return us, gbs

    # correctness at a long context against the reference (GPU, fp32 math)
    lens = [8000, 1000, 0, 8191]
    q, kc, vc, bt_k, bt_r, sl = _make_case(dev, dt, bs=BS, H=H, HKV=HKV, D=D, lens=lens, L=3)
    for hint in (8192, 16):
        out = A.paged_attention_decode(q, kc, vc, bt_k, sl, D ** -0.5, 3, max_seq_len=hint)
        ref = _reference(q, kc, vc, bt_r, sl, D ** -0.5, 3)
        err = (out.cpu().float() - ref.float()).abs().max().item()
        print(f"long-context check hint={hint}: max abs err {err:.3g}", flush=True)

    if sweep:
        base = A._decode_config
        for B, ctx in ((1, 8192), (32, 2048), (256, 1024)):
            res = []
            for bn in (16, 32, 64):
                for nw in (4, 8):
                    for ns in (2, 3):
                        def cfg(*a, bn=bn, nw=nw, ns=ns):
                            c = base(*a)
                            c.update(BLOCK_N=bn, num_warps=nw, num_stages=ns)
                            return c
                        A._decode_config = cfg
                        try:
                            us, gbs = one(B, ctx, 1)
                            res.append((us, bn, nw, ns))
                        except Exception as e:  # noqa: BLE001
                            print(f"  BLOCK_N={bn} warps={nw} stages={ns}: {e!r:.100}")
                        finally:
                            A._decode_config = base
            res.sort()
            print(f"sweep B={B} ctx={ctx}: " + ", ".join(
                f"{us:.1f}us(bn{bn},w{nw},s{ns})" for us, bn, nw, ns in res[:6]), flush=True)
        for P in (16, 32, 64, 128):
            us, gbs = one(1, 8192, 1, num_partitions=P)
            print(f"B=1 ctx=8192 P={P}: {us:.1f}us {gbs:.0f}GB/s", flush=True)

    print(f"{'B':>4} {'ctx':>5} {'L':>2} {'P':>3} {'us':>8} {'GB/s':>6}")
    for L in (1, 3):
        for B in (1, 16, 256):
            for ctx in (16, 2048, 8192):
                P = A._decode_config(L, H // HKV, D, B, HKV, ctx)["num_partitions"]
                us, gbs = one(B, ctx, L)
                print(f"{B:>4} {ctx:>5} {L:>2} {P:>3} {us:8.1f} {gbs:6.0f}", flush=True)
    q, kc, vc, bt, sl = setup(1, 16, 1)
    k1 = torch.randn(1, HKV, D, device=dev, dtype=dt)
    slots = torch.tensor([5], device=dev, dtype=torch.int32)
    print(f"write_kv T=1: {timeit(lambda: A.write_kv(k1, k1, kc, vc, slots)):.1f}us")


if __name__ == "__main__":
    import sys

    _bench("--sweep" in sys.argv)
