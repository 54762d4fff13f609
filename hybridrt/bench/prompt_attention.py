"""``hybridrt bench attention``: one attention layer of the 0.8B shape (8 query heads, 2 KV
heads of 256, blocks of 16) over a long context, its kernels alone.

- prompt: a chunk of ``chunk`` queries at the end of a context of each of ``lengths`` tokens
  (the rest cached), through ``paged_attention``'s SDPA over the whole gathered context (the
  reference) and through kernels/prefill_attention.py's tiles (the CPU backend's), per KV
  dtype; ms per call, the speed-up and the largest difference between the two.
- decode: csrc/attn_decode.c for one row after each of ``lengths`` tokens (the q/k norms,
  RoPE, the KV write and the gate included), and for each of ``verify`` rows of one sequence
  (a verification step of k = rows - 1 drafts), ms per call (where the compiled kernels load):
  one layer called again and again (its cache warm), and ``LAYERS`` layers' caches called in
  turn after a read of ``flush_bytes`` that empties the CPU's caches, per layer (what a decode
  step sees: the model's weights pass between two attention layers).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

H, HKV, D, BS = 8, 2, 256, 16
LAYERS = 6  # the 0.8B shape's attention layers
FLUSH_BYTES = 640 << 20  # more than the L3 a core of the machines measured here could hold


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _caches(ctx: int, kv: torch.dtype, gen):
    from hybridrt.kernels import kvquant, write_kv

    nb = -(-ctx // BS)
    width = kvquant.packed_width(D) if kv == torch.int8 else D
    kc = torch.zeros(nb, BS, HKV, width, dtype=kv)
    vc = torch.zeros(nb, BS, HKV, width, dtype=kv)
    table = torch.randperm(nb, generator=gen)
    pos = torch.arange(ctx)
    write_kv(torch.randn(ctx, HKV, D, generator=gen), torch.randn(ctx, HKV, D, generator=gen),
             kc, vc, table[pos // BS] * BS + pos % BS)
    return kc, vc, table


def prompt_rows(lengths, chunk: int, kv_dtypes, repeats: int) -> list[dict]:
    from hybridrt.kernels import paged_attention
    from hybridrt.kernels.prefill_attention import TiledPrefill

    gen = torch.Generator().manual_seed(0)
    rows, tiled = [], TiledPrefill()
    for kv in kv_dtypes:
        for ctx in lengths:
            n = min(chunk, ctx)
            kc, vc, table = _caches(ctx, kv, gen)
            q = torch.randn(n, H, D, generator=gen).bfloat16()
            args = (q, kc, vc, torch.tensor([0, n]), torch.tensor([ctx]), table[None],
                    D ** -0.5)
            kw = {"query_lens": [n], "context_lens": [ctx]}
            ref = paged_attention(*args, **kw)
            new = paged_attention(*args, **kw, prefill=tiled)
            t_ref = _best(lambda: paged_attention(*args, **kw), repeats)  # noqa: B023
            t_new = _best(lambda: paged_attention(*args, **kw, prefill=tiled), repeats)  # noqa: B023
            rows.append({"kind": "prompt", "kv": str(kv).removeprefix("torch."), "ctx": ctx,
                         "chunk": n, "ref_ms": 1e3 * t_ref, "tiled_ms": 1e3 * t_new,
                         "speedup": t_ref / t_new,
                         "max_diff": (new.float() - ref.float()).abs().max().item()})
    return rows


def _decode_inputs(gen, rows: int = 1) -> tuple:
    """``rows`` new tokens' projections, norm weights and RoPE rows (identity rotation)."""
    qg = torch.randn(rows, H * 2 * D, generator=gen).bfloat16()
    k, v = (torch.randn(rows, HKV * D, generator=gen).bfloat16() for _ in range(2))
    w = torch.zeros(D, dtype=torch.bfloat16)
    cos = torch.ones(rows, 64, dtype=torch.bfloat16)
    return qg, k, v, w, cos, torch.zeros_like(cos)


def _decode(inputs, ctx: int, kc, vc, table) -> None:
    from hybridrt.kernels import native

    qg, k, v, w, cos, sin = inputs
    L = qg.shape[0]
    pos = torch.arange(ctx - L, ctx)
    slot = table[pos // BS] * BS + pos % BS
    native.attn_decode(qg, k, v, w, w, 1e-6, cos, sin, kc, vc, slot, table[None],
                       torch.tensor([ctx]), D ** -0.5, L, H, HKV, D)


def _cold(layers, inputs, ctx: int, flush: torch.Tensor) -> float:
    """Seconds per layer of one decode row through ``layers`` in turn, the caches emptied first."""
    flush.sum()
    t = time.perf_counter()
    for layer in layers:
        _decode(inputs, ctx, *layer)
    return (time.perf_counter() - t) / len(layers)


def decode_rows(lengths, kv_dtypes, repeats: int, flush_bytes: int = FLUSH_BYTES,
                verify=(1,)) -> list[dict]:
    from functools import partial

    from hybridrt.kernels import native

    if native.load() is None:
        return []
    gen = torch.Generator().manual_seed(1)
    flush = torch.ones(max(flush_bytes // 4, 1))
    rows = []
    for kv in kv_dtypes:
        for ctx in lengths:
            layers = [_caches(ctx, kv, gen) for _ in range(LAYERS)]
            for n in verify:
                inputs = _decode_inputs(gen, n)
                _cold(layers, inputs, ctx, flush)
                rows.append({"kind": "decode", "kv": str(kv).removeprefix("torch."),
                             "ctx": ctx, "rows": n,
                             "ms": 1e3 * _best(partial(_decode, inputs, ctx, *layers[0]),
                                               repeats),
                             "cold_ms": 1e3 * min(_cold(layers, inputs, ctx, flush)
                                                  for _ in range(repeats))})
    return rows


def run(lengths=(2048, 4096, 8192), chunk: int = 2048, kv=("bf16", "int8"),
        threads: int = 2, repeats: int = 3, json_path: str | None = None,
        flush_bytes: int = FLUSH_BYTES, verify=(1,)) -> dict:
    """The measurements, printed as a table."""
    kvs = [torch.bfloat16 if k == "bf16" else torch.int8 for k in kv]
    torch.set_num_threads(threads)
    report = {"threads": threads, "rows": prompt_rows(lengths, chunk, kvs, repeats)
              + decode_rows(lengths, kvs, repeats, flush_bytes, verify),
              "load": os.getloadavg()}
    print(table(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    return report


def table(report: dict) -> str:
    lines = [f"{'':<7} {'KV':<9} {'context':>8} {'chunk':>6} {'whole ms':>9} {'tiled ms':>9} "
             f"{'speed-up':>9} {'max diff':>9}   decode: ms (warm), ms (cold, {LAYERS} layers)"]
    for r in report["rows"]:
        if r["kind"] == "prompt":
            lines.append(f"{'prompt':<7} {r['kv']:<9} {r['ctx']:>8} {r['chunk']:>6} "
                         f"{r['ref_ms']:>9.1f} {r['tiled_ms']:>9.1f} {r['speedup']:>8.2f}x "
                         f"{r['max_diff']:>9.2e}")
        else:
            lines.append(f"{'decode':<7} {r['kv']:<9} {r['ctx']:>8} {r['rows']:>6} {'':>9} "
                         f"{r['ms']:>9.2f} {r['cold_ms']:>9.2f}")
    load = report["load"]
    lines.append(f"{report['threads']} threads; load average {load[0]:.2f} {load[1]:.2f} "
                 f"{load[2]:.2f} (figures taken under it)")
    return "\n".join(lines)
