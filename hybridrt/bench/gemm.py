"""``hybridrt bench gemm``: ms per weight of the CPU GEMM paths at the 0.8B shapes, each path
on the same weights, rounds interleaved."""

from __future__ import annotations

import statistics
import sys
import time

import torch

from hybridrt.bench.throughput import _restores_threads


@_restores_threads
def gemm(rows: list[int] = (1, 2, 8, 32, 512), threads: int = 2, rounds: int = 9) -> list[dict]:
    """ms per weight of the CPU GEMM paths for bf16 weights at the 0.8B shapes (kernels/linear.py):
    the compiled GEMM on the weight as it is, the GEMV's tiles over panels (``gemv_rows``, bf16
    x), on the fma path the rows-along-lanes GEMM (``gemm_lanes``), oneDNN's fp32 copy, for up
    to 8 rows the compiled GEMV, and for 1-2 rows bf16 ``F.linear``; and the int8 and 4-bit
    kernels on the weight quantized (kernels/quant.py, kernels/int4.py). Several weights in turn
    so each streams from memory as in a model; median of interleaved rounds. The kernels are
    built for ``HYBRIDRT_MARCH`` and run ``HYBRIDRT_HALF_PATH`` as a model's would."""
    import torch.nn.functional as F

    from hybridrt import env
    from hybridrt.bench import progress
    from hybridrt.kernels import int4, native, quant
    from hybridrt.kernels.linear import _cpu_gemm, _onednn_available

    opts = env.kernel_options()
    native.load(opts.cache_dir, opts.march)
    hp = native.half_path(opts.half_path) if native.half_gemm_available() else None
    torch.set_num_threads(threads)
    results = []
    shapes = ((7168, 1024, 8), (1024, 3584, 16), (248320, 1024, 1))
    pbar = progress.bar("gemm", len(shapes) * (1 + len(rows)))
    for n, k, copies in shapes:
        progress.step(pbar, f"making the {n}x{k} weights")
        ws = [torch.randn(n, k).bfloat16() for _ in range(copies)]
        paths = {}
        if native.half_gemm_available():
            # bf16 x, as in a bf16 model (the bf16 dot-product path where the CPU has one)
            paths["half_gemm"] = lambda x, ws=ws: [native.half_gemm(x.bfloat16(), w, hp)
                                                   for w in ws]
            # the GEMV's tiles over panels, which linear takes from 9 rows on where they win
            paths["gemv_rows"] = lambda x, ws=ws: [native.gemv_rows(x.bfloat16(), w, hp)
                                                   for w in ws]
            if hp == "fma":  # rows along the lanes, which linear takes where they fill them
                paths["gemm_lanes"] = lambda x, ws=ws: [
                    native.gemm_lanes(x.bfloat16(), w, torch.bfloat16) for w in ws]
        if _onednn_available():
            od = [torch.ops.mkldnn._reorder_linear_weight(w.float().contiguous(), 32) for w in ws]
            paths["onednn_fp32"] = lambda x, od=od: [_cpu_gemm(x, p) for p in od]
        isa = quant.select_isa(env.kernel_options().int8_isa)
        if isa is not None:
            qs = [quant.quantize(w) for w in ws]
            paths[f"int8_{isa}"] = lambda x, qs=qs, isa=isa: [quant.int8_gemm(x, q, isa)
                                                              for q in qs]
        isa4 = int4.select_isa(env.kernel_options().int4_isa)
        if isa4 is not None:
            q4 = [int4.quantize(w) for w in ws]
            paths[f"int4_{isa4}"] = lambda x, q4=q4, isa=isa4: [int4.gemm(x, q, isa) for q in q4]
        pbar.update()
        for m in rows:
            progress.step(pbar, f"{n}x{k}, {m} rows")
            x = torch.randn(m, k)
            fs = dict(paths)
            if m <= native.HALF_GEMV_MAX_ROWS and native.half_gemm_available():
                fs["gemv"] = lambda x, ws=ws: [native.half_gemv(x.bfloat16(), w, hp)
                                               for w in ws]
            if m <= 2:
                xb = x.bfloat16()
                fs["bf16_linear"] = lambda x, xb=xb, ws=ws: [F.linear(xb, w) for w in ws]
            times: dict[str, list[float]] = {name: [] for name in fs}
            for f in fs.values():
                f(x)
            for _ in range(rounds):
                for name, f in fs.items():
                    t = time.perf_counter()
                    f(x)
                    times[name].append(time.perf_counter() - t)
            row = {"weight": f"{n}x{k}", "rows": m}
            row.update({name: statistics.median(v) / copies * 1e3 for name, v in times.items()})
            results.append(row)
            pbar.write("  ".join(f"{key} {val:.2f}" if isinstance(val, float) else f"{key} {val}"
                                 for key, val in row.items()), file=sys.stdout)
            pbar.update()
    pbar.close()
    return results
