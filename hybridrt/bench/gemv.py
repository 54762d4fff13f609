"""Few-row products against the machine's limits (``hybridrt bench gemv``): one decode step's
products at the 0.8B shape (every layer's merged projections and the tied LM head, random
weights), on each CPU kernel path this build has (bf16dot, fma, int8 vnni / avx2, int4 vnni /
avxvnni / avx2), for 1, 2, 3, 4 and 8 rows of x, against two bounds measured in the same run:

- the bandwidth bound: the read loop (kernels/csrc/stream.c) over the same weight bytes, in the
  same order, with the same threads, alternated with the products;
- the arithmetic bound: the step's multiply-adds over the path's dot-product peak (its inner
  instructions in a register-only loop, ``ceilings.dot_peak``);

and beside them the kernel's own time from cache: the same product on a weight that stays in
each core's L2 (half of it a thread), called over and over, its time per byte (the slope between
that weight and one of 16 rows, so that the per-call cost drops out) times the step's bytes, plus
the step's calls at the small weight's cost each. Where that exceeds the read loop's time, no
overlap of loads and arithmetic can bring M rows down to the bandwidth bound.

A product of M rows reads each weight once, so at the bandwidth bound its time does not grow
with M until the arithmetic bound passes the bandwidth bound. Each path is called as the decode
loop calls it (``native.gemv_bf16``, ``quant.linear`` / ``int4.linear`` on bf16 x). The int4
paths multiply the layers' weights in 4 bits and the LM head in 6 bits (as ``quantization="int4"``
keeps it), the bytes random (the kernels' time does not depend on them; quantizing the
step's weights would take minutes). Rounds alternate every path, row count and the read loop;
each figure is the median of its rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from hybridrt.bench import ceilings
from hybridrt.bench.fixtures import QWEN35_08B_TEXT_CONFIG

PATHS = ("bf16dot", "fma", "int8-vnni", "int8-avx2", "int4-vnni", "int4-avxvnni", "int4-avx2")
ROWS = (1, 2, 3, 4, 8)
HOT_CALLS = 128  # calls a round on each weight that stays in cache
WEIGHT_BYTES = {"bf16": 2.0, "int8": 1 + 2 / 32, "int4": 4.625 / 8}  # a weight's, with scales


def l2_bytes(sysfs: str = "/sys/devices/system/cpu/cpu0/cache/index2/size") -> int:
    """One core's L2 cache in bytes, as Linux reports it ("1024K", "2M"); 512 KiB elsewhere."""
    try:
        text = Path(sysfs).read_text().strip().upper()
        return int(text[:-1]) << {"K": 10, "M": 20}[text[-1]] if text[-1] in "KM" else int(text)
    except (OSError, ValueError, IndexError):
        return 512 << 10


def step_products(cfg: dict = QWEN35_08B_TEXT_CONFIG) -> list[tuple[int, int]]:
    """(N, K) of each product of one decode step, in the order the step runs them: per layer the
    mixer's merged in-projection, its out-projection, the MLP's gate+up and down; then the tied
    LM head."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    gdn = [(2 * hk * dk + hv * dv + hv * dv + 2 * hv, h), (h, hv * dv)]  # qkv, z, b, a; out
    attn = [(2 * heads * d + 2 * kv * d, h), (h, heads * d)]  # q with its gate, k, v; o
    mlp = [(2 * inter, h), (h, inter)]
    every = cfg.get("full_attention_interval", 4)
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % every == 0
                                       else "linear_attention"
                                       for i in range(cfg["num_hidden_layers"])]
    out = []
    for t in types:
        out += (attn if t == "full_attention" else gdn) + mlp
    return out + [(cfg["vocab_size"], h)]


def _read_loop(tensors: list[torch.Tensor], threads: int):
    """A function reading every byte of ``tensors`` with csrc/stream.c's loop, tensor by tensor."""
    from hybridrt import env
    from hybridrt.kernels import native

    lib = native.load(env.kernel_options().cache_dir)
    views = [(t.data_ptr(), t.numel() * t.element_size() // 4) for t in tensors]

    def read() -> None:
        for ptr, n in views:
            lib.stream_sum(ptr, n, threads)

    return read


def run_gemv_bench(rows=ROWS, threads: int = 2, repeats: int = 5, paths=None, seed: int = 0,
                   json_path: str | Path | None = None, verbose: bool = True,
                   config: dict | None = None, cpu_time: bool = False) -> dict:
    """Time one decode step's products per path and row count against the read loop over the
    same weights, each path's dot-product peak and its own time from cache -> report dict
    (printed as a table, written to ``json_path`` when given). ``config``: the model shape (a
    text config; default the 0.8B one). ``cpu_time``: time in this process's CPU seconds (with
    one thread, what the run takes on a core of its own; a busy machine's other processes then
    count only through the memory bandwidth they take)."""
    from hybridrt import env
    from hybridrt.kernels import int4, native, quant

    opts = env.kernel_options()
    if native.load(opts.cache_dir) is None:
        raise RuntimeError("hybridrt bench gemv: the compiled CPU kernels are unavailable here")
    rows = sorted({int(m) for m in rows})
    if not rows or rows[0] < 1 or rows[-1] > native.HALF_GEMV_MAX_ROWS:
        raise ValueError(f"rows must be in [1, {native.HALF_GEMV_MAX_ROWS}], got {rows}")
    built = native.half_paths() + [f"int{b}-{i}" for b, m in ((8, quant), (4, int4))
                                   for i in m.available_isas() if i != "ref"]
    paths = [p for p in PATHS if p in built] if paths is None else list(paths)
    missing = [p for p in paths if p not in built]
    if missing:
        raise ValueError(f"paths not built here: {', '.join(missing)} (built: {', '.join(built)})")
    from hybridrt.bench import progress

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    pbar = progress.bar("gemv", 3 + repeats, enabled=verbose)
    try:
        report = _run(rows, threads, repeats, paths, seed, config or QWEN35_08B_TEXT_CONFIG,
                      time.process_time if cpu_time else time.perf_counter, pbar)
    finally:
        torch.set_num_threads(before)
        pbar.close()
    if verbose:
        print(format_table(report))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report, indent=2))
        if verbose:
            print(f"wrote {json_path}", file=sys.stderr)
    return report


def _random_int4(n: int, k: int, g: torch.Generator, bits: int = 4):
    """A 4-bit (or 6-bit) weight [n, k] of random bytes (codes, and steps small enough to keep
    sums finite)."""
    from hybridrt.kernels import int4

    *planes, scales_shape = int4.packed_shapes((n, k), bits)
    tensors = [torch.randint(0, 256, s, generator=g, dtype=torch.uint8) for s in planes]
    scales = (torch.rand(scales_shape, generator=g) * 1e-4).bfloat16()
    return (int4.Int6Weight if bits == 6 else int4.Int4Weight)(*tensors, scales, (n, k))


def _run(rows, threads, repeats, paths, seed, config, clock, pbar) -> dict:
    from hybridrt.bench import progress

    progress.step(pbar, "making the weights")
    from hybridrt.kernels import int4, native, quant

    shapes = step_products(config)
    g = torch.Generator().manual_seed(seed)
    weights = [(torch.randn(n, k, generator=g) * 0.02).bfloat16() for n, k in shapes]
    qws = [quant.quantize(w) for w in weights] if any(p.startswith("int8") for p in paths) else []
    q4s = []
    if any(p.startswith("int4") for p in paths):  # the layers in 4 bits, the LM head in 6
        q4s = [_random_int4(n, k, g) for n, k in shapes[:-1]]
        q4s.append(_random_int4(*shapes[-1], g, 6))
    xs = {(m, k): torch.randn(m, k, generator=g).bfloat16()
          for m in rows for k in {k for _, k in shapes}}
    macs = sum(n * k for n, k in shapes)
    fns, nbytes = {}, {}
    for p in paths:
        if p.startswith("int4"):
            isa = p.split("-")[1]
            fns[p] = lambda m, isa=isa: [int4.linear(xs[m, q.shape[1]], q, isa) for q in q4s]
            nbytes[p] = sum(q.nbytes for q in q4s)
        elif p.startswith("int8"):
            isa = p.split("-")[1]
            fns[p] = lambda m, isa=isa: [quant.linear(xs[m, q.shape[1]], q, isa) for q in qws]
            nbytes[p] = sum(q.nbytes for q in qws)
        else:
            fns[p] = lambda m, p=p: [native.gemv_bf16(xs[m, w.shape[1]], w, p) for w in weights]
            nbytes[p] = sum(w.numel() * 2 for w in weights)
    # the kernels from cache: per path a weight of half a core's L2 a thread, and one of 16 rows
    K = config["hidden_size"]
    hot_rows = {p: max(48, int(threads * l2_bytes() / 2 / (K * WEIGHT_BYTES[_read_of(p)]))
                       // 48 * 48) for p in paths}
    hot = {}
    for p in paths:
        sizes, isa = (hot_rows[p], 16), p.split("-")[-1]
        if p.startswith("int4"):
            ws = [_random_int4(n, K, g) for n in sizes]
            one = lambda x, w, isa=isa: int4.linear(x, w, isa)  # noqa: E731
        elif p.startswith("int8"):
            ws = [quant.quantize(torch.randn(n, K, generator=g).bfloat16()) for n in sizes]
            one = lambda x, w, isa=isa: quant.linear(x, w, isa)  # noqa: E731
        else:
            ws = [(torch.randn(n, K, generator=g) * 0.02).bfloat16() for n in sizes]
            one = lambda x, w, p=p: native.gemv_bf16(x, w, p)  # noqa: E731
        hot[p] = [lambda m, w=w, one=one: [one(xs[m, K], w) for _ in range(HOT_CALLS)]
                  for w in ws]
    reads = {}  # the read loop of each weight format a path multiplies
    if any(_read_of(p) == "bf16" for p in paths):
        reads["bf16"] = _read_loop(weights, threads)
    if any(_read_of(p) == "int8" for p in paths):
        reads["int8"] = _read_loop([t for q in qws for t in (q.qs, q.scales)], threads)
    if q4s:
        reads["int4"] = _read_loop([t for q in q4s for t in q.tensors()], threads)
    load = {"start": list(os.getloadavg())}
    # int4 vnni: the same vpdpbusd as int8 vnni, one a row and 64 weights (the other 4-bit
    # paths' inner steps have no measured peak)
    pbar.update()
    progress.step(pbar, "dot-product peaks")
    peaks = {p: ceilings.dot_peak("int8-vnni" if p == "int4-vnni" else p, threads)
             if p in ceilings.DOT_KINDS or p == "int4-vnni" else None for p in paths}
    pbar.update()
    progress.step(pbar, "warm-up")
    for p in paths:  # warm-up: the first call of a shape faults in its output's pages
        for m in rows:
            fns[p](m)
            for f in hot[p]:
                f(m)
    pbar.update()
    times: dict[str, list[float]] = {}
    for r in range(repeats):
        progress.step(pbar, f"round {r + 1}")
        for name, read in reads.items():
            t = clock()
            read()
            times.setdefault(f"read {name}", []).append(clock() - t)
        for p in paths:
            for m in rows:
                t = clock()
                fns[p](m)
                times.setdefault(f"{p} {m}", []).append(clock() - t)
                for name, f in zip(("hot", "small"), hot[p]):
                    t = clock()
                    f(m)
                    times.setdefault(f"{p} {m} {name}", []).append(clock() - t)
        pbar.update()
    load["end"] = list(os.getloadavg())
    med = {key: statistics.median(v) for key, v in times.items()}
    results = []
    for p in paths:
        bound = med[f"read {_read_of(p)}"]
        peak = peaks[p]
        for m in rows:
            t = med[f"{p} {m}"]
            arith = 2 * m * macs / (peak["gop_s"] * 1e9) if peak else None
            # per round: the time a byte from cache (the slope between the two weights)
            per_byte = statistics.median(
                max(big - small, 0.0) for big, small in zip(times[f"{p} {m} hot"],
                                                           times[f"{p} {m} small"]))
            per_byte /= (hot_rows[p] - 16) * K * WEIGHT_BYTES[_read_of(p)] * HOT_CALLS
            cache = nbytes[p] * per_byte + len(shapes) * med[f"{p} {m} small"] / HOT_CALLS
            results.append({
                "path": p, "rows": m, "ms": t * 1e3, "gb_s": nbytes[p] / t / 1e9,
                "read_bound_ms": bound * 1e3, "share_of_read_bound": bound / t,
                "over_one_row": t / med[f"{p} {rows[0]}"] if rows[0] == 1 else None,
                "arithmetic_bound_ms": None if arith is None else arith * 1e3,
                "from_cache_ms": cache * 1e3,
                "runs_ms": [v * 1e3 for v in times[f"{p} {m}"]],
            })
    return {
        "cpu": ceilings.cpu_info(), "threads": threads, "repeats": repeats, "rows": rows,
        "clock": "cpu" if clock is time.process_time else "wall",
        "products": len(shapes), "weight_gb": 2 * macs / 1e9, "multiply_adds": macs,
        "weight_bytes": nbytes,
        "read_ms": {name: med[f"read {name}"] * 1e3 for name in reads},
        "read_gb_s": {name: _bytes_of(name, nbytes) / med[f"read {name}"] / 1e9
                      for name in reads},
        "dot_peak_gop_s": {p: None if v is None else v["gop_s"] for p, v in peaks.items()},
        "from_cache_rows": hot_rows,
        "load_average": load, "results": results,
    }


def _read_of(path: str) -> str:
    """The read loop of a path: over the weights it multiplies (int8, int4 or bf16)."""
    return path.split("-")[0] if path.startswith(("int8", "int4")) else "bf16"


def _bytes_of(name: str, nbytes: dict) -> int:
    """The weight bytes of the read loop ``name`` (bf16, int8 or int4): those of its paths."""
    return next(v for p, v in nbytes.items() if _read_of(p) == name)


def format_table(report: dict) -> str:
    cpu = report["cpu"]
    lines = [f"CPU: {cpu['model']} ({' '.join(cpu['flags'])}); {report['threads']} threads; "
             f"load average start {report['load_average']['start'][0]:.2f}, end "
             f"{report['load_average']['end'][0]:.2f}; medians of {report['repeats']} rounds"
             + ("; CPU TIME (this process's CPU seconds)" if report["clock"] == "cpu" else ""),
             "read loop over the same weights: " + ", ".join(
                 f"{name} {report['read_ms'][name]:.1f} ms ({report['read_gb_s'][name]:.1f} GB/s)"
                 for name in report["read_ms"]),
             "dot-product peaks: " + ", ".join(
                 f"{p} {v:.0f} Gop/s" if v else f"{p} -"
                 for p, v in report["dot_peak_gop_s"].items())]
    head = (f"{'path':<12} {'rows':>4} {'ms':>8} {'GB/s':>6} {'of read bound':>13} "
            f"{'x 1 row':>8} {'arith. bound ms':>15} {'from cache ms':>13}")
    lines += [head, "-" * len(head)]
    for r in report["results"]:
        x1 = "-" if r["over_one_row"] is None else f"{r['over_one_row']:.2f}"
        ar = "-" if r["arithmetic_bound_ms"] is None else f"{r['arithmetic_bound_ms']:.1f}"
        lines.append(f"{r['path']:<12} {r['rows']:>4} {r['ms']:>8.1f} {r['gb_s']:>6.1f} "
                     f"{r['share_of_read_bound']:>13.2f} {x1:>8} {ar:>15} "
                     f"{r['from_cache_ms']:>13.1f}")
    lines.append(f"one decode step's {report['products']} products ({report['weight_gb']:.3f} GB "
                 f"in bf16), the tied LM head included; of read bound: the read loop's time over "
                 f"the same bytes / the product's;\narith. bound: multiply-adds / the path's "
                 f"dot-product peak; from cache: the same kernel's time for the step's bytes "
                 f"from each core's L2")
    return "\n".join(lines)
