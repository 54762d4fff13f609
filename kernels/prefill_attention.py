"""Causal attention of one prompt chunk over its paged KV, in tiles of the context: the CPU
backend's prompt attention (``kernels/attention.py`` ``paged_attention``'s prefill hook).

``paged_attention`` gathers a sequence's whole context into fp32 and runs one SDPA with an
``[n, ctx]`` mask for a chunk that follows cached tokens. Here the context is read a tile of
``tile`` positions at a time (tiles fixed by absolute position, whole KV blocks), each tile
gathered (and, for an int8 cache, dequantized) into the compute dtype and given to torch's
CPU flash-attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu``: blocked,
online softmax, never the [heads, q, k] scores), which returns each tile's output and
log-sum-exp; a query's tiles are merged in tile order by their log-sum-exp, in fp32. A tile
that holds positions past some query gets an additive mask of at most ``rows`` x ``tile``.
GQA: a KV head's rows are expanded to its query heads with stride 0, not copied.

Why torch's kernel and not a C one beside csrc/attn_decode.c: on CPUs with AMX / AVX512-BF16
its bf16 path runs on the matrix units (measured at 1024 queries x 4096 keys, 8 heads of 256,
2 threads: 376 GFLOP/s in bf16 against 96 in fp32), above what an fp32 C kernel reaches on
the same cores. ``compute_dtype`` picks bf16 only for bf16 queries on such a CPU (there the
inputs are bf16 already; what changes is the probabilities' rounding to bf16 before the
product with V, as in GPU flash kernels), fp32 otherwise (the same math as ``paged_attention``).
"""

from __future__ import annotations

import torch

from . import kvquant

TILE = 4096  # context positions gathered per call (a multiple of any block size used)
ROWS = 2048  # queries per call (with TILE, bounds a call's mask: ROWS x TILE)
BF16_FROM = 2048  # queries at positions below this are computed in fp32 (see TiledPrefill)

_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def available() -> bool:
    """Whether this torch has the CPU flash-attention kernel with log-sum-exp."""
    return _flash is not None


def fast_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (AMX tiles or AVX512-BF16)."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(cpu, c, lambda: False)() for c in checks)


def compute_dtype(query_dtype: torch.dtype, bf16_fast: bool) -> torch.dtype:
    """The dtype the tiles are computed in: bf16 for bf16 queries where ``bf16_fast``, else
    fp32."""
    return torch.bfloat16 if query_dtype == torch.bfloat16 and bf16_fast else torch.float32


class TiledPrefill:
    """``paged_attention``'s ``prefill`` hook: ``(query [n, H, D], key_cache, value_cache,
    table [M], ctx, scale) -> [n, H, D]`` in the query's dtype. ``tile``: context positions
    per call (a multiple of the caches' block size); ``bf16_fast``: see ``compute_dtype``."""

    def __init__(self, tile: int = TILE, bf16_fast: bool | None = None,
                 bf16_from: int = BF16_FROM):
        if tile <= 0:
            raise ValueError(f"tile must be positive, got {tile}")
        self.tile, self.bf16_from = tile, bf16_from
        self.bf16_fast = fast_bf16() if bf16_fast is None else bf16_fast

    def __call__(self, query, key_cache, value_cache, table, ctx: int, scale: float):
        """Queries at positions below ``bf16_from`` in fp32, the rest in ``compute_dtype``: the
        dtype follows a query's position, not its chunk, so a prefix-cache hit recomputing a
        short prompt's tail, or a step verifying a few drafts, rounds as the cold prompt did
        (and as before bf16 tiles existed); bf16 pays where a context is long."""
        dtype = compute_dtype(query.dtype, self.bf16_fast)
        n = query.shape[0]
        m = n if dtype == torch.float32 else min(max(self.bf16_from - (ctx - n), 0), n)
        parts = []
        if m:
            parts.append(chunk_attention(query[:m], key_cache, value_cache, table, ctx - n + m,
                                         scale, self.tile, torch.float32))
        if m < n:
            parts.append(chunk_attention(query[m:], key_cache, value_cache, table, ctx, scale,
                                         self.tile, dtype))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.to(query.dtype)


def chunk_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    table: torch.Tensor, ctx: int, scale: float, tile: int = TILE,
                    dtype: torch.dtype = torch.float32, rows: int = ROWS) -> torch.Tensor:
    """Query i of ``query`` [n, H, D] sits at position ctx - n + i and attends to positions
    0 .. ctx - n + i of the sequence whose blocks ``table`` [M] lists (its KV already written)
    -> [n, H, D] fp32, computed in ``dtype`` tile by tile, ``rows`` queries per call.

    A query's result depends only on its position and the context, not on where its chunk
    starts: every query meets the same tiles (fixed by absolute position) in the same order,
    with a mask wherever a tile holds positions past it, and the merge is elementwise."""
    n, H, D = query.shape
    HKV = key_cache.shape[2]
    bs = key_cache.shape[1]
    if H % HKV:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({HKV})")
    if tile % bs:
        raise ValueError(f"tile ({tile}) must be a multiple of the block size ({bs})")
    G = H // HKV
    q = query.to(dtype).reshape(n, HKV, G, D).permute(1, 2, 0, 3)  # [HKV, G, n, D]
    start = ctx - n
    out = torch.empty(HKV, G, n, D)
    for a in range(0, n, rows):
        b = min(a + rows, n)
        acc = lse = None
        for t0 in range(0, start + b, tile):
            t1 = min(t0 + tile, start + b)
            r0 = max(a, t0 - start)  # the first of the rows that see a position of this tile
            k = _tile(key_cache, table, t0, t1, D, dtype, G)
            v = _tile(value_cache, table, t0, t1, D, dtype, G)
            mask = None
            if start + r0 < t1 - 1:  # some row does not see the whole tile
                pos = torch.arange(start + r0, start + b)
                mask = torch.zeros(b - r0, t1 - t0, dtype=dtype).masked_fill_(
                    torch.arange(t0, t1)[None, :] > pos[:, None], float("-inf"))
            o, s = _flash(q[:, :, r0:b], k, v, 0.0, False, attn_mask=mask, scale=scale)
            o = o.float()
            if acc is None:  # the first tile: every row of the piece sees position 0
                acc, lse = o, s
                continue
            i = r0 - a
            total = torch.logaddexp(lse[..., i:], s)
            acc[:, :, i:] = (acc[:, :, i:] * (lse[..., i:] - total).exp()[..., None]
                             + o * (s - total).exp()[..., None])
            lse[..., i:] = total
        out[:, :, a:b] = acc
    return out.permute(2, 0, 1, 3).reshape(n, H, D)


def _tile(cache: torch.Tensor, table: torch.Tensor, t0: int, t1: int, D: int,
          dtype: torch.dtype, G: int) -> torch.Tensor:
    """Positions t0 .. t1 - 1 of the sequence as [HKV, G, t1 - t0, D] in ``dtype`` (each KV
    head's rows seen by its G query heads, stride 0)."""
    bs, HKV = cache.shape[1], cache.shape[2]
    b0, b1 = t0 // bs, -(-t1 // bs)
    rows = cache.index_select(0, table[b0:b1]).view(-1, HKV, cache.shape[-1])
    rows = rows[t0 - b0 * bs:t1 - b0 * bs]
    x = kvquant.dequantize(rows, D) if cache.dtype == torch.int8 else rows
    x = x.to(dtype).transpose(0, 1).contiguous()  # [HKV, t, D]
    return x[:, None].expand(HKV, G, *x.shape[1:])
