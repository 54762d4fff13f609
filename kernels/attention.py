"""Causal attention over paged KV for a packed batch of sequences, plain torch.

KV layout per attention layer: ``key_cache, value_cache: [num_blocks, block_size, HKV, D]``.
A token's KV slot is ``block * block_size + offset``; ``block_tables[b]`` lists the blocks of
sequence b in order. Each sequence attends only to its own blocks (per-request isolation), and
query i of a sequence with context length n and q_len new tokens sits at position
n - q_len + i (causal within the sequence).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value: [T, HKV, D]; caches: [NB, BS, HKV, D]; slot_mapping: [T] flat slots."""
    nb, bs = key_cache.shape[:2]
    key_cache.view(nb * bs, *key_cache.shape[2:])[slot_mapping] = key.to(key_cache.dtype)
    value_cache.view(nb * bs, *value_cache.shape[2:])[slot_mapping] = value.to(value_cache.dtype)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """-> [B, num_tokens, HKV, D] keys (or values) of positions 0..num_tokens-1 per sequence."""
    bs = cache.shape[1]
    pos = torch.arange(num_tokens, device=cache.device)
    blocks = block_tables[:, pos // bs]  # [B, n]
    flat = blocks * bs + pos % bs
    return cache.view(-1, *cache.shape[2:])[flat]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    query_lens: list[int] | None = None,
    context_lens: list[int] | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over each sequence's cached + new KV (already written).

    query: [T, H, D]; key_cache/value_cache: [NB, BS, HKV, D]; cu_seqlens_q: [B+1];
    seq_lens: [B] context length including this step's tokens; block_tables: [B, M].
    ``query_lens``/``context_lens`` are optional host-side copies. Returns [T, H, D].
    Single-token sequences (decode) are computed together in one padded batch; longer ones
    (prefill chunks, draft verification) one sequence at a time. The math runs in fp32 (the
    output is rounded to the query's dtype): CPU SDPA on bf16 inputs is several times slower
    on CPUs without bf16 matrix instructions (docs/performance.md).
    """
    H, HKV = query.shape[1], key_cache.shape[2]
    if H % HKV:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({HKV})")
    qlens = (
        query_lens if query_lens is not None else (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    )
    ctx = context_lens if context_lens is not None else seq_lens.tolist()
    out = torch.empty_like(query)
    starts = cu_seqlens_q[:-1].tolist() if query_lens is None else _starts(qlens)

    single = [b for b, n in enumerate(qlens) if n == 1]
    if single:
        idx = torch.tensor(single, device=query.device)
        rows = torch.tensor([starts[b] for b in single], device=query.device)
        n_max = max(ctx[b] for b in single)
        k = _gather(key_cache, block_tables[idx], n_max).float()  # [b, n, HKV, D]
        v = _gather(value_cache, block_tables[idx], n_max).float()
        mask = None
        if min(ctx[b] for b in single) < n_max:
            lens = seq_lens[idx] if len(single) < len(qlens) else seq_lens
            valid = torch.arange(n_max, device=query.device)[None, :] < lens[:, None]  # [b, n]
            # Padding past a sequence's length may hold anything (other requests' blocks, stale
            # or non-finite values): zero it, since a masked weight of 0 times NaN is still NaN.
            k.masked_fill_(~valid[:, :, None, None], 0)
            v.masked_fill_(~valid[:, :, None, None], 0)
            mask = valid[:, None, None, :]
        q = query[rows][:, :, None, :].float()  # [b, H, 1, D]
        o = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
            enable_gqa=H != HKV,
        )
        out[rows] = o[:, :, 0, :].to(out.dtype)

    for b, n in enumerate(qlens):
        if n <= 1:
            continue
        c = ctx[b]
        k = _gather(key_cache, block_tables[b:b + 1], c)[0].float().transpose(0, 1)  # [HKV, c, D]
        v = _gather(value_cache, block_tables[b:b + 1], c)[0].float().transpose(0, 1)
        q = query[starts[b]:starts[b] + n].float().transpose(0, 1)  # [H, n, D]
        qpos = torch.arange(c - n, c, device=query.device)
        mask = torch.arange(c, device=query.device)[None, :] <= qpos[:, None]  # [n, c]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=H != HKV,
        )
        out[starts[b]:starts[b] + n] = o.transpose(0, 1).to(out.dtype)
    return out


def varlen_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Dense causal attention over a packed batch with no cache (reference / tests).

    query: [T, H, D]; key, value: [T, HKV, D]; cu_seqlens: [B+1] -> [T, H, D]. Tokens of
    different sequences never attend to each other.
    """
    H, HKV = query.shape[1], key.shape[1]
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        o = F.scaled_dot_product_attention(
            query[s:e].transpose(0, 1), key[s:e].transpose(0, 1), value[s:e].transpose(0, 1),
            is_causal=True, scale=scale, enable_gqa=H != HKV,
        )
        out[s:e] = o.transpose(0, 1)
    return out


def _starts(lens: list[int]) -> list[int]:
    acc, out = 0, []
    for n in lens:
        out.append(acc)
        acc += n
    return out
