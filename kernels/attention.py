"""Causal attention over paged KV for a packed batch of sequences, plain torch.

KV layout per attention layer: ``key_cache, value_cache: [num_blocks, block_size, HKV, D]``.
A token's KV slot is ``block * block_size + offset``; ``block_tables[b]`` lists the blocks of
sequence b in order. An int8 cache (``kvquant``) holds rows of D codes and their scales,
[NB, BS, HKV, kvquant.packed_width(D)]: written quantized, read back as fp32. Each sequence
attends only to its own blocks (per-request isolation), and
query i of a sequence with context length n and q_len new tokens sits at position
n - q_len + i (causal within the sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import kvquant
from .meta import as_arrays


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value: [T, HKV, D]; caches: [NB, BS, HKV, D] (or int8 rows); slot_mapping: [T]
    flat slots."""
    nb, bs = key_cache.shape[:2]
    if key_cache.dtype == torch.int8:
        key, value = kvquant.quantize(key), kvquant.quantize(value)
    key_cache.view(nb * bs, *key_cache.shape[2:])[slot_mapping] = key.to(key_cache.dtype)
    value_cache.view(nb * bs, *value_cache.shape[2:])[slot_mapping] = value.to(value_cache.dtype)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """-> [B, num_tokens, HKV, D] keys (or values) of positions 0..num_tokens-1 per sequence."""
    bs = cache.shape[1]
    pos = torch.arange(num_tokens, device=cache.device)
    blocks = block_tables[:, pos // bs]  # [B, n]
    flat = blocks * bs + pos % bs
    return cache.view(-1, *cache.shape[2:])[flat]


def _load(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int,
          D: int) -> torch.Tensor:
    """``_gather`` as fp32 values (an int8 cache's rows dequantized)."""
    rows = _gather(cache, block_tables, num_tokens)
    return kvquant.dequantize(rows, D) if cache.dtype == torch.int8 else rows.float()


@dataclass(slots=True)
class AttentionPlan:
    """Per-step index data for ``paged_attention``, built once by ``attention_plan`` and shared
    by every attention layer. Single-token sequences (decode) are computed together in one
    padded batch; longer ones (prefill chunks, draft verification) one sequence at a time."""

    decode_rows: torch.Tensor | None  # [b] query rows of the single-token sequences
    decode_tables: torch.Tensor | None  # [b, M] their block tables
    decode_len: int  # the longest of their contexts
    decode_valid: torch.Tensor | None  # [b, decode_len] bool, None when all lengths are equal
    prefill: list[tuple[int, int, int, torch.Tensor, torch.Tensor | None]]  # (start, n, ctx,
    # table [1, M], causal mask [n, ctx] or None for a prompt with no cached prefix) per
    # longer sequence


def attention_plan(query_lens: list[int], context_lens: list[int], block_tables: torch.Tensor,
                   arrays) -> AttentionPlan:
    """``arrays``: the step's arrays (kernels/meta.py) that index tensors go into, or a device
    (new arrays there)."""
    arr = as_arrays(arrays)
    device = block_tables.device
    starts = _starts(query_lens)
    single = [b for b, n in enumerate(query_lens) if n == 1]
    rows = tables = valid = None
    n_max = 0
    if single:
        rows = arr.tensor(arr.put([starts[b] for b in single]))
        tables = block_tables if len(single) == len(query_lens) else block_tables[
            arr.tensor(arr.put(single))]
        lens = [context_lens[b] for b in single]
        n_max = max(lens)
        if min(lens) < n_max:
            valid = torch.arange(n_max, device=device)[None, :] < arr.tensor(
                arr.put(lens))[:, None]
    prefill = []
    for b, n in enumerate(query_lens):
        if n <= 1:
            continue
        c = context_lens[b]
        mask = None  # ctx == n: SDPA's own (top-left) causal mask is this one
        if c != n:
            qpos = torch.arange(c - n, c, device=device)
            mask = torch.arange(c, device=device)[None, :] <= qpos[:, None]  # [n, c]
        prefill.append((starts[b], n, c, block_tables[b:b + 1], mask))
    return AttentionPlan(rows, tables, n_max, valid, prefill)


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
    plan: AttentionPlan | None = None,
    prefill=None,
) -> torch.Tensor:
    """Causal attention of new tokens over each sequence's cached + new KV (already written).

    query: [T, H, D]; key_cache/value_cache: [NB, BS, HKV, D]; cu_seqlens_q: [B+1];
    seq_lens: [B] context length including this step's tokens; block_tables: [B, M].
    ``query_lens``/``context_lens`` are optional host-side copies; ``plan``: the step's
    ``attention_plan`` (built here when not given); ``prefill``: what computes each longer
    sequence, ``prefill(query [n, H, D], key_cache, value_cache, table [M], ctx, scale)``
    (kernels/prefill_attention.py), None for SDPA over its whole context. Returns [T, H, D].
    The math runs in fp32 (the output is rounded to the query's dtype): CPU SDPA on bf16
    inputs is several times slower on CPUs without bf16 matrix instructions
    (docs/performance.md).
    """
    H, HKV, D = query.shape[1], key_cache.shape[2], query.shape[2]
    if H % HKV:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({HKV})")
    if plan is None:
        qlens = query_lens if query_lens is not None else (
            cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        ctx = context_lens if context_lens is not None else seq_lens.tolist()
        plan = attention_plan(qlens, ctx, block_tables, query.device)
    out = torch.empty_like(query)
    if plan.decode_rows is not None:
        rows = plan.decode_rows
        k = _load(key_cache, plan.decode_tables, plan.decode_len, D)  # [b, n, HKV, D]
        v = _load(value_cache, plan.decode_tables, plan.decode_len, D)
        mask = None
        if plan.decode_valid is not None:
            valid = plan.decode_valid
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

    for start, n, c, table, mask in plan.prefill:
        if prefill is not None:
            out[start:start + n] = prefill(query[start:start + n], key_cache, value_cache,
                                           table[0], c, scale)
            continue
        # 4-D [1, H, n, D]: SDPA's fused (flash) kernels take only 4-D inputs; 3-D ones fall
        # back to the math path, which materialises the [H, n, c] scores
        k = _load(key_cache, table, c, D).transpose(1, 2)  # [1, HKV, c, D]
        v = _load(value_cache, table, c, D).transpose(1, 2)
        q = query[start:start + n].float().transpose(0, 1)[None]  # [1, H, n, D]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=H != HKV,
        )
        out[start:start + n] = o[0].transpose(0, 1).to(out.dtype)
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
            query[s:e].transpose(0, 1)[None], key[s:e].transpose(0, 1)[None],
            value[s:e].transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=H != HKV,
        )
        out[s:e] = o[0].transpose(0, 1)
    return out


def _starts(lens: list[int]) -> list[int]:
    acc, out = 0, []
    for n in lens:
        out.append(acc)
        acc += n
    return out
