"""Triton paged attention for decode / speculative verify, and the paged KV write.

KV cache per attention layer: ``key_cache, value_cache: [num_blocks, block_size, HKV, D]``
(the model dtype); ``block_tables: [B, M]`` int lists the blocks of each sequence in order; a
token's flat slot is ``block * block_size + offset``.

* ``write_kv(key, value, key_cache, value_cache, slot_mapping)``: ``key, value: [T, HKV, D]``
  (strided views allowed, last dim contiguous), ``slot_mapping: [T]``. A slot < 0 is padding:
  nothing is written for that row. One launch writes both caches.
* ``paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
  num_queries_per_seq=L) -> [B * L, H, D]``: every sequence has exactly L query rows (L = 1 for
  decode, 1 + k when verifying k drafts), rows ``b*L .. b*L+L-1``. ``seq_lens[b]`` is the
  context length including the L new tokens (whose K/V are already in the cache); query t sits
  at position ``seq_lens[b] - L + t`` and attends causally to positions ``0 .. seq_lens[b] - L +
  t``. GQA: query head h reads kv head ``h // (H // HKV)``. Rows with ``seq_lens[b] <= 0`` are
  padding: their output is zero and nothing of theirs is read. Nothing past a sequence's length
  is ever read (block-table padding and foreign blocks may hold garbage).
* ``paged_attention_varlen(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
  tile_seq, tile_q0, scale, tokens_per_tile, out=None)``: the same attention for sequences with
  any number of new tokens (a step with prompt chunks), sequence b's at rows
  ``cu_seqlens_q[b] ..``; one program per tile of ``tokens_per_tile`` new tokens of one
  sequence (``varlen_tiles`` lists them on the host), no split-KV, only tiled rows written.

Design: one program per (sequence, kv head, KV partition) processes all ``L * H/HKV`` query rows
of that kv head at once (a query tile padded to >= 16 rows for ``tl.dot``), so every K/V block
is read once per (sequence, kv head). Online softmax in fp32. Split-KV: the context of every
sequence is cut into ``P`` partitions (P chosen on the host from B, HKV and a max-context
*hint*, never from tensor values, so the call is CUDA-graph capturable; each program computes
its share from the actual ``seq_len``, so any length is correct whatever the hint), and a small
second kernel merges the partial (max, sum, acc) triples. With P == 1 the first kernel writes
the output directly. The varlen form is the same kernel (``VARLEN``): a program reads its
sequence and first token from the tile list and its queries' rows from ``cu_seqlens_q``, and
stops at the keys its last query sees.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------
# write_kv


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    HKV, D,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < HKV) & (offs_d[None, :] < D)
        src_k = k_ptr + t.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
        src_v = v_ptr + t.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
        dst_k = (kc_ptr + blk * stride_kc_b + off * stride_kc_s
                 + offs_h[:, None] * stride_kc_h + offs_d[None, :])
        dst_v = (vc_ptr + blk * stride_vc_b + off * stride_vc_s
                 + offs_h[:, None] * stride_vc_h + offs_d[None, :])
        k = tl.load(src_k, mask=mask)
        v = tl.load(src_v, mask=mask)
        tl.store(dst_k, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(dst_v, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key, value [T, HKV, D]`` into the paged caches at ``slot_mapping [T]``.

    Slots < 0 are skipped. Values are cast to the cache dtype. In place; one launch.
    """
    T, HKV, D = key.shape
    assert value.shape == key.shape, (key.shape, value.shape)
    assert key_cache.shape == value_cache.shape and key_cache.shape[2:] == (HKV, D)
    assert slot_mapping.shape == (T,)
    if T == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    # A dtype change is done by torch (round-to-nearest-even; the Triton interpreter's in-kernel
    # fp32 -> bf16 cast truncates). Production passes K/V already in the cache dtype.
    if key.dtype != key_cache.dtype:
        key = key.to(key_cache.dtype)
    if value.dtype != value_cache.dtype:
        value = value.to(value_cache.dtype)
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    _write_kv_kernel[(T,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        HKV, D,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(HKV),
        BLOCK_D=triton.next_power_of_2(D),
        num_warps=4 if HKV * D >= 1024 else 1,
    )


# --------------------------------------------------------------------------------------------
# paged attention (decode / verify)

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attn_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, cu_q_ptr, tile_seq_ptr, tile_q0_ptr,
    out_ptr, part_acc_ptr, part_ml_ptr,
    qk_scale,  # scale * log2(e)
    stride_qt, stride_qh,
    stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    stride_bt,
    stride_ot, stride_oh,
    H,
    NUM_PARTS,  # runtime: a new partition count does not recompile
    L: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST_DOT: tl.constexpr, VARLEN: tl.constexpr,
):
    # A program's queries: n_q (<= L) consecutive new tokens of sequence b, from its q0-th;
    # the sequence has qlen new tokens, the first at query row row0.
    if VARLEN:  # a tile of the host's list: (sequence, first token) per program
        tile = tl.program_id(0)
        b = tl.load(tile_seq_ptr + tile).to(tl.int32)
        q0 = tl.load(tile_q0_ptr + tile).to(tl.int32)
        row0 = tl.load(cu_q_ptr + b).to(tl.int32)
        qlen = tl.load(cu_q_ptr + b + 1).to(tl.int32) - row0
        n_q = tl.minimum(qlen - q0, L)
    else:  # every sequence has exactly L new tokens, rows b * L ...
        b = tl.program_id(0)
        q0 = 0
        row0 = b * L
        qlen = L
        n_q = L
    kvh = tl.program_id(1)
    part = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    seq_len = tl.maximum(seq_len, 0)

    # Rows of the query tile: r = t * G + g -> query q0 + t of this sequence, head kvh * G + g.
    offs_m = tl.arange(0, BLOCK_M)
    row_t = q0 + offs_m // G
    row_h = kvh * G + offs_m % G
    row_valid = offs_m < n_q * G
    q_row = row0 + row_t  # global query row
    q_pos = seq_len - qlen + row_t  # causal limit (inclusive)
    offs_d = tl.arange(0, D)

    q_ptrs = (q_ptr + q_row.to(tl.int64)[:, None] * stride_qt
              + row_h[:, None] * stride_qh + offs_d[None, :])
    # (a padding sequence reads no query; written as a bound, not `vector & scalar`, which the
    # Triton interpreter rejects)
    q_live = offs_m < tl.where(seq_len > 0, n_q * G, 0)
    q = tl.load(q_ptrs, mask=q_live[:, None], other=0.0)
    q = q.to(kc_ptr.dtype.element_ty)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # The keys the program's last query sees, and this partition's share of them, in whole
    # BLOCK_N tiles.
    kv_len = tl.maximum(tl.minimum(seq_len - qlen + q0 + n_q, seq_len), 0)
    n_tiles = tl.cdiv(kv_len, BLOCK_N)
    tiles_per_part = tl.cdiv(n_tiles, NUM_PARTS)
    start = part * tiles_per_part * BLOCK_N
    end = tl.minimum(start + tiles_per_part * BLOCK_N, kv_len)

    # The running max starts at a finite -1e30 (not -inf) so rows / partitions that see no key
    # stay NaN-free: exp2(-1e30 - -1e30) = 1 multiplies a zero sum, exp2(-inf - -1e30) = 0.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)

    offs_n0 = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_n0
        n_mask = offs_n < end
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = offs_n % BLOCK_SIZE
        k_ptrs = (kc_ptr + blk[:, None] * stride_kc_b + off[:, None] * stride_kc_s
                  + kvh * stride_kc_h + offs_d[None, :])
        v_ptrs = (vc_ptr + blk[:, None] * stride_vc_b + off[:, None] * stride_vc_s
                  + kvh * stride_vc_h + offs_d[None, :])
        k = tl.load(k_ptrs, mask=n_mask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=n_mask[:, None], other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
        valid = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    if not SPLIT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no key seen: acc == 0 -> 0
        o_ptrs = (out_ptr + q_row.to(tl.int64)[:, None] * stride_ot
                  + row_h[:, None] * stride_oh + offs_d[None, :])
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        # Partials: acc [B*L, H, P, D] fp32 (unnormalised), ml [B*L, H, P, 2] (max, sum).
        pidx = (q_row.to(tl.int64) * H + row_h) * NUM_PARTS + part
        tl.store(part_acc_ptr + pidx[:, None] * D + offs_d[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(part_ml_ptr + pidx * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + pidx * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _paged_attn_reduce_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr,
    stride_ot, stride_oh,
    H,
    NUM_PARTS,
    D: tl.constexpr, BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, D)
    p_mask = offs_p < NUM_PARTS
    base = (row.to(tl.int64) * H + h) * NUM_PARTS
    m = tl.load(part_ml_ptr + (base + offs_p) * 2, mask=p_mask, other=-1.0e30)
    lse = tl.load(part_ml_ptr + (base + offs_p) * 2 + 1, mask=p_mask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # empty partitions: lse == 0 and acc == 0
    l_tot = tl.sum(lse * w, 0)
    acc = tl.load(part_acc_ptr + (base + offs_p)[:, None] * D + offs_d[None, :],
                  mask=p_mask[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0)
    o = o / tl.where(l_tot > 0, l_tot, 1.0)  # padding row: o == 0
    tl.store(out_ptr + row.to(tl.int64) * stride_ot + h * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty))


def _dot_mode(query: torch.Tensor, key_cache: torch.Tensor) -> tuple[str | None, bool]:
    """(input precision, upcast) of the kernel's dot products. The Triton interpreter (CPU
    tensors) multiplies bf16/fp16 tiles as raw uint16 bits: there, dot operands are upcast to
    fp32 (on GPU the dots run in the cache dtype); fp32 must not silently drop to tf32."""
    fp32 = key_cache.dtype == torch.float32
    upcast = query.device.type == "cpu" and not fp32
    return ("ieee" if fp32 or upcast else None), upcast


def _decode_config(L: int, G: int, D: int, batch: int, hkv: int, max_seq_len: int) -> dict:
    """Launch parameters from shapes and the max-context hint (never tensor values).

    Split-KV: aim for ~512 programs (B * HKV * P; ~4 per SM of an H200), each partition at
    least 2 tiles of context, at most 64 partitions (timings in docs/performance.md).
    """
    block_m = max(16, triton.next_power_of_2(L * G))
    block_n = 32 if D >= 256 else 64
    num_warps = 4 if block_m * D <= 16 * 256 else 8
    by_len = max(1, max_seq_len // (2 * block_n))
    want = triton.cdiv(512, max(1, batch * hkv))
    parts = max(1, min(want, by_len, 64))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=2,
                num_partitions=parts)


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_queries_per_seq: int = 1,
    max_seq_len: int | None = None,
    num_partitions: int | None = None,
) -> torch.Tensor:
    """Paged causal attention of L = ``num_queries_per_seq`` new queries per sequence.

    query: [B * L, H, D] (strided view ok, last dim contiguous); key_cache / value_cache:
    [NB, BS, HKV, D]; block_tables: [B, M] int; seq_lens: [B] int (context length including
    the L new tokens; <= 0 marks a padding row: zero output). ``max_seq_len`` is a host-side
    sizing hint for the split-KV partition count (default: ``M * BS``); results are correct for
    any actual length. ``num_partitions`` forces the partition count (tests). Returns
    [B * L, H, D] in query's dtype.
    """
    L = int(num_queries_per_seq)
    T, H, D = query.shape
    NB, BS, HKV, Dk = key_cache.shape
    B = seq_lens.shape[0]
    assert L >= 1 and T == B * L, (T, B, L)
    _check_paged(query, key_cache, value_cache, block_tables, B)
    G = H // HKV
    out = torch.empty((T, H, D), dtype=query.dtype, device=query.device)
    if T == 0:
        return out

    hint = max_seq_len if max_seq_len is not None else block_tables.shape[1] * BS
    cfg = _decode_config(L, G, D, B, HKV, int(hint))
    P = cfg["num_partitions"] if num_partitions is None else max(1, int(num_partitions))
    dot_prec, upcast_dot = _dot_mode(query, key_cache)

    if P > 1:
        part_acc = torch.empty((T, H, P, D), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((T, H, P, 2), dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # unused
    _launch((B, HKV, P), query, key_cache, value_cache, block_tables, seq_lens, None,
            out, part_acc, part_ml, scale, P,
            L=L, G=G, D=D, BLOCK_SIZE=BS,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], SPLIT=P > 1,
            DOT_PREC=dot_prec, UPCAST_DOT=upcast_dot,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if P > 1:
        _paged_attn_reduce_kernel[(T, H)](
            part_acc, part_ml, out,
            out.stride(0), out.stride(1),
            H,
            P,
            D=D, BLOCK_P=triton.next_power_of_2(P),
            num_warps=4 if D >= 128 else 1,
        )
    return out


# --------------------------------------------------------------------------------------------
# paged attention (any mix of new-token counts: prompt chunks with decodes and verifications)


def varlen_tokens_per_tile(H: int, HKV: int) -> int:
    """New tokens per program of ``paged_attention_varlen``: a query tile of ~64 rows
    (tokens x the H / HKV query heads of a kv head), a power of two."""
    return 1 << max(0, (64 // (H // HKV)).bit_length() - 1)


def varlen_tiles(query_lens: list[int], seqs, tokens_per_tile: int) -> tuple[list, list]:
    """Host-side tile list for ``paged_attention_varlen``: (sequence, first new token) of each
    program covering the new tokens of the sequences ``seqs`` (indices into ``query_lens``)."""
    tile_seq, tile_q0 = [], []
    for b in seqs:
        for q0 in range(0, query_lens[b], tokens_per_tile):
            tile_seq.append(b)
            tile_q0.append(q0)
    return tile_seq, tile_q0


def paged_attention_varlen(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    tile_seq: torch.Tensor,
    tile_q0: torch.Tensor,
    scale: float,
    tokens_per_tile: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged causal attention for sequences with any number of new tokens.

    query: [T, H, D] (strided view ok, last dim contiguous), sequence b's new tokens at rows
    ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1``; seq_lens [B]: context length including them
    (their K/V already in the cache), so new token t sits at position
    ``seq_lens[b] - n_b + t`` and attends causally up to it; block_tables [B, M]. The programs
    are the tiles ``(tile_seq[i], tile_q0[i])`` (``varlen_tiles``): ``tokens_per_tile`` new
    tokens of one sequence each. Only the rows of tiled tokens are written (into ``out`` when
    given, else a new [T, H, D] tensor in query's dtype); others are left as they are.
    """
    T, H, D = query.shape
    NB, BS, HKV, Dk = key_cache.shape
    B = seq_lens.shape[0]
    n_tiles = tile_seq.shape[0]
    _check_paged(query, key_cache, value_cache, block_tables, B)
    assert cu_seqlens_q.shape == (B + 1,) and tile_q0.shape == (n_tiles,)
    L = int(tokens_per_tile)
    assert L >= 1 and L & (L - 1) == 0, f"tokens_per_tile must be a power of two, got {L}"
    G = H // HKV
    if out is None:
        out = torch.empty((T, H, D), dtype=query.dtype, device=query.device)
    assert out.shape == (T, H, D) and out.stride(-1) == 1
    if n_tiles == 0:
        return out
    block_m = max(16, triton.next_power_of_2(L * G))
    dot_prec, upcast_dot = _dot_mode(query, key_cache)
    _launch((n_tiles, HKV, 1), query, key_cache, value_cache, block_tables, seq_lens,
            (cu_seqlens_q, tile_seq, tile_q0), out, out, out, scale, 1,
            L=L, G=G, D=D, BLOCK_SIZE=BS,
            BLOCK_M=block_m, BLOCK_N=32 if D >= 256 else 64, SPLIT=False,
            DOT_PREC=dot_prec, UPCAST_DOT=upcast_dot,
            num_warps=4 if block_m * D <= 16 * 256 else 8, num_stages=2)
    return out


def _check_paged(query, key_cache, value_cache, block_tables, B: int) -> None:
    """The shapes and strides both paged-attention forms take."""
    D, (_, _, HKV, Dk) = query.shape[-1], key_cache.shape
    assert Dk == D and value_cache.shape == key_cache.shape
    assert D >= 16 and D & (D - 1) == 0, f"head dim must be a power of two >= 16, got {D}"
    assert query.shape[1] % HKV == 0, (query.shape[1], HKV)
    assert block_tables.shape[0] == B and block_tables.stride(-1) == 1
    assert query.stride(-1) == 1 and key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1


def _launch(grid, query, key_cache, value_cache, block_tables, seq_lens, varlen, out,
            part_acc, part_ml, scale, num_parts, **meta):
    """One launch of ``_paged_attn_kernel`` over these tensors (their strides); ``varlen``:
    (cu_seqlens_q, tile_seq, tile_q0) for the tiled form, None for the uniform one."""
    cu, tile_seq, tile_q0 = varlen if varlen is not None else (seq_lens,) * 3  # unread
    _paged_attn_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens, cu, tile_seq, tile_q0,
        out, part_acc, part_ml,
        float(scale) * _LOG2E,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        query.shape[1],
        num_parts,
        VARLEN=varlen is not None, **meta,
    )
