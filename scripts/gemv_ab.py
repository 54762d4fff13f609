"""A/B the M-row products of several builds of int8_gemm.c / half_gemm.c in one process,
rounds alternated (docs/performance.md, "Few-row products"): each source tree's kernels are
compiled side by side and called on the same weights; the outputs must be identical.

    python scripts/gemv_ab.py M[,M] kind[,kind] name=srcdir[:-DFLAG,...] ...

kinds: vnni avx2 bf16dot fma. Times: process CPU ms of one decode step's products (0.8B
shape, one thread; ``NL=n`` the first n layers only, ``HEAD=0`` without the LM head). E.g.
``python scripts/gemv_ab.py 1 vnni,bf16dot old=/path/to/old/tree new=.`` (a checkout of an
older commit as the old tree). Several row counts (``1,2,3,4,8``): every (variant, row count)
alternated in each round, and each variant's times also over its own one-row time (the first
count). ``-mno-avx512f`` as a flag builds a tree as for an AVX2 CPU (16 ymm registers)."""

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
from hybridrt.kernels import quant

torch.set_num_threads(1)
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
    for f in ("int8_gemm.c", "half_gemm.c"):
        path = os.path.join(src, "kernels/csrc", f)
        src_bytes = Path(path).read_bytes()
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
                    path,
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
g = torch.Generator().manual_seed(0)
ws = [(torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16) for n, k in shapes]
xs = {(m, k): torch.randn(m, k, generator=g).to(torch.bfloat16) for m in MS for _, k in shapes}
xf = {mk: v.float() for mk, v in xs.items()}
qws = [quant.quantize(w.float()) for w in ws] if {"vnni", "avx2"} & set(kinds) else []
ISA = {"vnni": 4, "avx2": 2}


def run(libs, kind, M):
    outs = []
    if kind in ISA:
        L = libs["int8_gemm.c"]
        for q in qws:
            N, K = q.shape
            y = torch.empty(M, N, dtype=torch.bfloat16)
            x = xs[M, K]
            L.int8_gemm_bf16(
                ctypes.c_void_p(x.data_ptr()),
                ctypes.c_void_p(q.qs.data_ptr()),
                ctypes.c_void_p(q.scales.data_ptr()),
                ctypes.c_void_p(y.data_ptr()),
                ctypes.c_int64(M),
                ctypes.c_int64(N),
                ctypes.c_int64(K),
                ctypes.c_int64(q.scales.shape[1] * 32),
                ISA[kind],
                1,
            )
            outs.append(y)
    else:
        L = libs["half_gemm.c"]
        for w in ws:
            N, K = w.shape
            y = torch.empty(M, N, dtype=torch.bfloat16)
            if kind == "bf16dot":
                x = xs[M, K]
                L.half_gemv_bf16(
                    ctypes.c_void_p(x.data_ptr()),
                    ctypes.c_void_p(w.data_ptr()),
                    ctypes.c_void_p(y.data_ptr()),
                    ctypes.c_int64(M),
                    ctypes.c_int64(N),
                    ctypes.c_int64(K),
                    1,
                    1,
                )
            else:
                x = xf[M, K]
                L.half_gemv(
                    ctypes.c_void_p(x.data_ptr()),
                    ctypes.c_void_p(w.data_ptr()),
                    ctypes.c_void_p(y.data_ptr()),
                    ctypes.c_int64(M),
                    ctypes.c_int64(N),
                    ctypes.c_int64(K),
                    0,
                    1,
                    1,
                )
            outs.append(y)
    return outs


reps = int(os.environ.get("REPS", "9"))
for kind in kinds:
    for M in MS:
        ref = None
        for name, libs in variants:
            o = run(libs, kind, M)
            if ref is None:
                ref = o
            else:
                same = all(torch.equal(a, b) for a, b in zip(ref, o))
                print(f"  {kind} M={M} {name} identical to first: {same}")
    times = {(name, M): [] for name, _ in variants for M in MS}
    for _ in range(reps):
        for M in MS:
            for name, libs in variants:
                t0 = time.process_time()
                run(libs, kind, M)
                times[name, M].append(time.process_time() - t0)
    med = {key: statistics.median(t) for key, t in times.items()}
    for M in MS:
        base = med[variants[0][0], M]
        print(
            f"M={M} {kind}: "
            + "  ".join(
                f"{n} {1e3 * med[n, M]:.1f}ms ({med[n, M] / base:.3f}; "
                f"{med[n, M] / med[n, MS[0]]:.2f}x {MS[0]} row)"
                for n, _ in variants
            ),
            flush=True,
        )
