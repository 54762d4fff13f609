"""What this machine allows, measured in the benchmark's own run: the CPU's model and vector
flags, the streaming read bandwidth (kernels/csrc/stream.c), each product path's arithmetic peak
(its instructions in a register-only loop, the same file), an fp32 matmul rate, and the bytes
of weights a batch-1 decode step must read, whose quotient is the batch-1 decode ceiling."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import torch

# the flags that decide which kernels a CPU can run (AMX: amx_tile, amx_bf16, amx_int8)
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8")


def cpu_info(cpuinfo: str | None = None) -> dict:
    """{"model": the first ``model name`` of /proc/cpuinfo, "flags": those of ``CPU_FLAGS`` it
    lists}; model None and no flags where there is no /proc/cpuinfo."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name"), "flags": [f for f in CPU_FLAGS if f in flags]}


def stream_sum(x: torch.Tensor, threads: int) -> float:
    """The sum of a contiguous fp32 CPU tensor, read by the C streaming loop with ``threads``
    threads (fp32 within blocks of 64 Ki floats, fp64 across them: exact for small integers)."""
    from hybridrt import env
    from hybridrt.kernels import native

    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"stream_sum: x must be a contiguous CPU float32 tensor, got "
                         f"{x.dtype} on {x.device}")
    opts = env.kernel_options()
    lib = native.load(opts.cache_dir, opts.march)
    if lib is None:
        raise RuntimeError("stream_sum: native CPU kernels unavailable")
    return lib.stream_sum(x.data_ptr(), x.numel(), threads)


def stream_read(threads: int, size_bytes: int = 1 << 30, passes: int = 5,
                huge_pages: bool | None = None) -> dict:
    """Read bandwidth: ``size_bytes`` of fp32 (more than the caches hold) summed by the C
    streaming loop with ``threads`` threads, best of ``passes`` -> {"gb_s", "method",
    "vector_bits", "bytes", "threads", "passes", "huge_pages"}. Without the native library, a
    torch sum (method "torch sum", slower than the loop). ``huge_pages``: the buffer in
    transparent-huge-page memory (``HugeArena``), as the loaded weights are; default: where
    the weights get them (the kernel options and the OS). On 4 KiB pages the loop reads slower
    (docs/performance.md), which would understate the weights' ceiling."""
    from hybridrt import env
    from hybridrt.kernels import native
    from hybridrt.kernels.memory import HugeArena, weights_on_huge_pages

    opts = env.kernel_options()
    if huge_pages is None:
        huge_pages = weights_on_huge_pages(opts)
    arena = HugeArena(size_bytes) if huge_pages else None
    buf = (arena.empty((size_bytes // 4,), torch.float32) if arena is not None
           else torch.empty(size_bytes // 4))
    buf.fill_(1.0)  # written here: its pages are mapped before timing
    lib = native.load(opts.cache_dir, opts.march)
    if lib is not None:
        method, bits = "C read loop", lib.stream_vector_bytes() * 8

        def read():
            return stream_sum(buf, threads)
    else:
        method, bits = "torch sum", None

        def read():
            return float(buf.sum())

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        read()
        best = float("inf")
        for _ in range(passes):
            t = time.perf_counter()
            total = read()
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    if total != buf.numel():  # every element is 1.0: a partial read shows here
        raise RuntimeError(f"stream read summed {total}, expected {buf.numel()}")
    return {"gb_s": buf.numel() * 4 / best / 1e9, "method": method, "vector_bits": bits,
            "bytes": buf.numel() * 4, "threads": threads, "passes": passes,
            "huge_pages": huge_pages}


def stream_read_apart(threads: int, size_bytes: int = 1 << 30, passes: int = 3) -> float:
    """``stream_read``'s GB/s measured in a child process, so that its buffer never counts in
    this process's peak RSS (a benchmark reads the bandwidth before each of its rounds)."""
    code = ("import sys; from hybridrt.bench.ceilings import stream_read; "
            "print(stream_read(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))['gb_s'])")
    out = subprocess.run([sys.executable, "-c", code, str(threads), str(size_bytes),
                          str(passes)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"stream read in a child process failed: "
                           f"{(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return float(out.stdout.strip().splitlines()[-1])


# the product paths' inner instructions, as csrc/stream.c's dot_peak numbers them
DOT_KINDS = {"fma": 0, "bf16dot": 1, "int8-vnni": 2, "int8-avx2": 3}


def dot_peak(kind: str, threads: int, seconds: float = 0.2, passes: int = 3) -> dict | None:
    """The arithmetic peak of one product path's inner instructions (``DOT_KINDS``: the fma and
    bf16dot half paths, int8's vnni and avx2), ``threads`` threads each running independent
    accumulations in registers, best of ``passes`` runs of about ``seconds`` -> {"gop_s" (2 x
    multiply-adds a second, in G), "threads", "passes"}; None where the build lacks them."""
    from hybridrt import env
    from hybridrt.kernels import native

    lib = native.load(env.kernel_options().cache_dir)
    if lib is None or not lib.dot_peak_has(DOT_KINDS[kind]):
        return None
    k, ops = DOT_KINDS[kind], lib.dot_peak_ops(DOT_KINDS[kind])
    iters = 1 << 16
    t = time.perf_counter()
    lib.dot_peak(k, iters, threads)
    iters = max(iters, int(iters * seconds / max(time.perf_counter() - t, 1e-6)))
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        lib.dot_peak(k, iters, threads)
        best = min(best, time.perf_counter() - t)
    return {"gop_s": ops * iters * threads / best / 1e9, "threads": threads, "passes": passes}


def matmul_rate(threads: int, m: int = 512, k: int = 1024, n: int = 1024, reps: int = 10) -> dict:
    """torch fp32 matmul [m, k] x [k, n] with ``threads`` threads, best of ``reps`` ->
    {"gflop_s", "shape", "threads"}."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a @ b
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return {"gflop_s": 2 * m * k * n / best / 1e9, "shape": [m, k, n], "threads": threads}


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one batch-1 decode step reads (``Qwen35ForCausalLM.bytes_read``)."""
    return model.bytes_read()


def state_bytes_per_token(tensors) -> int:
    """Bytes of recurrent state one batch-1 decode step reads and writes besides the weights:
    every GDN layer's conv and ssm state of one sequence (statecache.CacheTensors), read once
    and written once."""
    one = 0
    for t in (tensors.conv_states, tensors.ssm_states):
        one += t.shape[0] * math.prod(t.shape[2:]) * t.element_size()  # 0 without GDN layers
    return 2 * one
