"""A/B the M-row products of several builds of int8_gemm.c / half_gemm.c in one process,
rounds alternated (docs/performance.md, "Few-row products"): each source tree's kernels are
compiled side by side and called on the same weights; the outputs must be identical.

    python scripts/gemv_ab.py M[,M] kind[,kind] name=srcdir[:-DFLAG,...] ...

kinds: vnni avx2 bf16dot fma (int8 and half weights); int4-vnni int4-avxvnni int4-avx2 int4-ref
(4-bit weights: int4_gemm.c linked with its tree's int8_gemm.c, random packed bytes, the LM
head in int8 on the int8 path of the same level, as ``quantization="int4"`` kept it before its
6-bit head, so that older trees compare; scripts/head_ab.py times the two heads). Times:
process CPU ms of one decode step's products (0.8B shape, one thread; ``NL=n`` the first n
layers only, ``HEAD=0`` without the LM head), per row count, every variant and row count in
each round. E.g. ``python scripts/gemv_ab.py 1,2,3,4,8 int4-vnni old=/path/to/old/tree new=.``
(a checkout of an older commit as the old tree). ``-mno-avx512f`` as a flag builds a tree as for
an AVX2 CPU (16 ymm registers). ``THREADS=n``: the products on n threads, timed in wall seconds.
``HOT=n``: instead of the step's products, 96 calls on one weight of n x 1024 (n = 384: 768 KiB
in bf16, within a core's L2 here), so that the kernels' arithmetic alone is timed, not the
read from memory (multiply-adds a second: n x 1024 x 96 x M over the time printed)."""

import ctypes
import hashlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from hybridrt.bench.fixtures import QWEN35_08B_TEXT_CONFIG as cfg
from hybridrt.bench.gemv import step_products
from hybridrt.kernels import int4, quant

THREADS = int(os.environ.get("THREADS", "1"))  # >1: wall time on that many threads
torch.set_num_threads(THREADS)
clock = time.process_time if THREADS == 1 else time.perf_counter
BUILD = os.path.join(os.environ.get("TMPDIR", "/tmp"), "hybridrt-gemv-ab")
os.makedirs(BUILD, exist_ok=True)
MS = [int(m) for m in sys.argv[1].split(",")]
kinds = sys.argv[2].split(",")
variants = []
for spec in sys.argv[3:]:
    name, rest = spec.split("=", 1)
    src, _, flags = rest.partition(":")
    flags = [f for f in flags.split(",") if f]
    libs = {}
    for f in ("int8_gemm.c", "half_gemm.c", "int4_gemm.c"):
        path = os.path.join(src, "kernels/csrc", f)
        if not os.path.exists(path):
            continue
        srcs = [path] + ([os.path.join(src, "kernels/csrc/int8_gemm.c")] if f == "int4_gemm.c"
                         else [])
        src_bytes = b"".join(Path(s).read_bytes() for s in srcs)
        key = hashlib.sha256(src_bytes + " ".join(flags).encode()).hexdigest()[:12]
        out = os.path.join(BUILD, f"{f[:-2]}-{key}.so")
        if not os.path.exists(out):
            subprocess.run(
                [
                    "cc",
                    "-O3",
                    "-march=native",
                    "-fopenmp",
                    "-shared",
                    "-fPIC",
                    "-std=c11",
                    *flags,
                    "-o",
                    out,
                    *srcs,
                ],
                check=True,
            )
        libs[f] = ctypes.CDLL(out)
    variants.append((name, libs))
# the step's products in bench gemv's order: 4 a layer, then the LM head; NL=n keeps the first n
# layers, HEAD=0 leaves the head out
products = step_products(cfg)
layers = products[:-1][: 4 * int(os.environ.get("NL", cfg["num_hidden_layers"]))]
shapes = layers + (products[-1:] if os.environ.get("HEAD", "1") != "0" else [])
HOT = int(os.environ.get("HOT", "0"))
if HOT:  # one weight, called 96 times: it stays in cache
    layers = shapes = [(HOT, 1024)] * 96
g = torch.Generator().manual_seed(0)
ws = [(torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16) for n, k in shapes]
ws = ws[:1] * len(ws) if HOT else ws
xs = {m: {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for _, k in shapes} for m in MS}
xf = {m: {k: v.float() for k, v in x.items()} for m, x in xs.items()}
qws = ([quant.quantize(w.float()) for w in (ws[:1] if HOT else ws)]
       if {"vnni", "avx2"} & set(kinds) else [])
qws = qws * len(ws) if HOT else qws
ISA = {"vnni": 4, "avx2": 2}
ISA4 = {"int4-ref": 1, "int4-avx2": 2, "int4-vnni": 4, "int4-avxvnni": 8}


def _int4_random(n, k):
    """An Int4Weight's three tensors [N, K] of random bytes (the kernels' time does not depend
    on the values): qs, codes, and bf16 D, M small enough that the sums stay finite."""
    (P, G, *_), sh_c, sh_s = int4.packed_shapes((n, k))
    qs = torch.randint(0, 256, (P, G, 4, 64), generator=g, dtype=torch.uint8)
    codes = torch.randint(0, 256, sh_c, generator=g, dtype=torch.uint8)
    scales = (torch.rand(sh_s, generator=g) * 1e-4).bfloat16()
    return qs, codes, scales, G * 32


# int4: every product of the layers in 4 bits, the LM head in int8 (an older tree has no 6-bit one)
q4s = [_int4_random(n, k) for n, k in layers] if set(ISA4) & set(kinds) else []
q4s = q4s[:1] * len(q4s) if HOT else q4s
q4head = ([quant.quantize(ws[-1].float())] if q4s and len(shapes) > len(layers) and not HOT
          else [])


def _int8(lib, q, M, isa):
    """One int8 product of M rows on path ``isa`` (one thread) -> y [M, N] bf16."""
    N, K = q.shape
    y = torch.empty(M, N, dtype=torch.bfloat16)
    lib.int8_gemm_bf16(
        ctypes.c_void_p(xs[M][K].data_ptr()),
        ctypes.c_void_p(q.qs.data_ptr()),
        ctypes.c_void_p(q.scales.data_ptr()),
        ctypes.c_void_p(y.data_ptr()),
        ctypes.c_int64(M),
        ctypes.c_int64(N),
        ctypes.c_int64(K),
        ctypes.c_int64(q.scales.shape[1] * 32),
        isa,
        THREADS,
    )
    return y


def run(libs, kind, M):
    outs = []
    if kind in ISA4:
        L = libs["int4_gemm.c"]
        for (qs, codes, scales, Kp), (N, K) in zip(q4s, layers):
            y = torch.empty(M, N, dtype=torch.bfloat16)
            L.int4_gemm(
                ctypes.c_void_p(xs[M][K].data_ptr()),
                1,
                ctypes.c_void_p(qs.data_ptr()),
                ctypes.c_void_p(codes.data_ptr()),
                ctypes.c_void_p(scales.data_ptr()),
                ctypes.c_void_p(y.data_ptr()),
                1,
                ctypes.c_int64(M),
                ctypes.c_int64(N),
                ctypes.c_int64(K),
                ctypes.c_int64(Kp),
                ISA4[kind],
                THREADS,
            )
            outs.append(y)
        isa8 = 4 if kind == "int4-vnni" else 2 if kind != "int4-ref" else 1
        for q in q4head:  # the int8 LM head on the int8 path of the same level
            outs.append(_int8(libs["int8_gemm.c"], q, M, isa8))
    elif kind in ISA:
        for q in qws:
            outs.append(_int8(libs["int8_gemm.c"], q, M, ISA[kind]))
    else:
        L = libs["half_gemm.c"]
        for w in ws:
            N, K = w.shape
            y = torch.empty(M, N, dtype=torch.bfloat16)
            if kind == "bf16dot":
                x = xs[M][K]
                L.half_gemv_bf16(
                    ctypes.c_void_p(x.data_ptr()),
                    ctypes.c_void_p(w.data_ptr()),
                    ctypes.c_void_p(y.data_ptr()),
                    ctypes.c_int64(M),
                    ctypes.c_int64(N),
                    ctypes.c_int64(K),
                    1,
                    THREADS,
                )
            else:
                x = xf[M][K]
                L.half_gemv(
                    ctypes.c_void_p(x.data_ptr()),
                    ctypes.c_void_p(w.data_ptr()),
                    ctypes.c_void_p(y.data_ptr()),
                    ctypes.c_int64(M),
                    ctypes.c_int64(N),
                    ctypes.c_int64(K),
                    0,
                    1,
                    THREADS,
                )
            outs.append(y)
    return outs


reps = int(os.environ.get("REPS", "9"))
for kind in kinds:
    for M in MS:
        ref = None
        for name, libs in variants:
            o = run(libs, kind, M)
            same = None if ref is None else all(torch.equal(a, b) for a, b in zip(ref, o))
            if ref is None:
                ref = o
            if same is not None:
                print(f"  M={M} {kind} {name} identical to first: {same}")
    times = {(name, M): [] for name, _ in variants for M in MS}
    for _ in range(reps):  # every variant and row count in each round
        for M in MS:
            for name, libs in variants:
                t0 = clock()
                run(libs, kind, M)
                times[name, M].append(clock() - t0)
    med = {key: statistics.median(t) for key, t in times.items()}
    first = variants[0][0]
    for M in MS:
        print(
            f"M={M} {kind}: "
            + "  ".join(
                f"{n} {1e3 * med[n, M]:.2f}ms ({med[n, M] / med[first, M]:.3f}"
                + (f"; {med[n, M] / med[n, MS[0]]:.2f}x M={MS[0]})" if MS[0] != M else ")")
                for n, _ in variants
            ),
            flush=True,
        )
