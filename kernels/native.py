"""Small C kernels for the CPU path, compiled on first use with the system C compiler.

- ``csrc/gdn_decode.c``: PyTorch has no fused CPU op for the gated-delta-rule decode step: the
  torch formulation (``delta_rule._step_in_place``) makes three passes over every state plus
  small batched products; this does one read pass and one update pass per (sequence, head)
  while the 64 KiB state sits in L2.
- ``csrc/gdn_fused.c``: the rest of a GDN layer's recurrent tokens around that step (conv,
  q/k norms, gates, the gated output norm) in the same call, from the in-projections' outputs
  to out_proj's input; the torch ops for them are some thirty small calls per layer.
- ``csrc/attn_decode.c``: a gated attention layer's decode or verification tokens (q/k norms,
  partial RoPE, the KV write, attention over the paged cache, the output gate) in one call;
  a row's context split across the threads in fixed partitions (flash-decoding).
- ``csrc/norm.c``: RMSNorm of bf16 rows with the residual add fused in.
- ``csrc/half_gemm.c``: x W^T for bf16/fp16 weights in fp32 on AVX2 + FMA + F16C CPUs, reading
  the half-precision weights as the model holds them instead of an fp32 copy of them, and with
  the bf16 dot-product instruction for bf16 x bf16 where the CPU has AVX512-BF16 (``half_path``;
  kernels/linear.py says when each is used; docs/performance.md what it was measured against).
- ``csrc/int8_gemm.c``: x W^T for int8 weights with one scale per 32 inputs, on AVX-512 VNNI,
  AVX2 or plain C (kernels/quant.py binds it and picks the path).
- ``csrc/int4_gemm.c``: the same for 4-bit weights (kernels/int4.py), on AVX-512 VNNI, 256-bit
  VNNI, AVX2 or plain C; ``csrc/int4_quant.c`` quantizes them (a search per group).
- ``csrc/gguf_repack.c``: a GGUF file's quantized blocks into those formats in one pass
  (hybridrt/gguf/repack.py binds it).
- ``csrc/argmax.c``: the greedy token of each row of logits (fp32 or bf16), torch's argmax in
  one vectorised pass and a short second one.
- ``csrc/step.c``: a decode step's layers in one call, a list of the kernels above with their
  arguments (kernels/step.py builds it).
- ``csrc/stream.c``: a streaming read loop and register-only loops of each product path's
  instructions, the bandwidth and arithmetic ceilings the benchmarks measure.

All are built into one library with ``cc -O3 -march=native -fopenmp`` into the options'
``cache_dir`` (``HYBRIDRT_CACHE``; default ``~/.cache/hybridrt``), keyed by a hash of the
source, the flags and this CPU's model and feature flags (a ``-march=native`` build must not be
reused on another CPU), and loaded with ctypes, once per process. The options' ``march``
(``HYBRIDRT_MARCH``, e.g. ``haswell`` for AVX2 only, ``skylake-avx512`` for AVX-512 without
VNNI or BF16) builds for another target instead, so that a forced kernel path is also compiled
for that instruction level (the compiler's own vectorisation included): the key holds it too.
Without a C compiler that builds it (with OpenMP), or on Windows, ``load()`` returns None and
callers keep the torch path (same math, tested against each other); so does the CPU backend
with ``native=False`` (``HYBRIDRT_NATIVE=0``).

The paths and vector widths a caller picks (``half_path``, ``simd``) are arguments, decided
once by the backend from its ``KernelOptions``; nothing here reads the environment for them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .options import SIMD_AVX512

_SRCS = [Path(__file__).parent / "csrc" / name
         for name in ("gdn_decode.c", "gdn_fused.c", "attn_decode.c", "norm.c", "half_gemm.c",
                      "int8_gemm.c", "int4_gemm.c", "int4_quant.c", "gguf_repack.c",
                      "argmax.c", "step.c", "stream.c")]
_HEADERS = [Path(__file__).parent / "csrc" / name  # included by the sources above
            for name in ("bf16.h", "kernels.h")]
_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-std=c11"]  # and -march=<the target>
_BUILD_SECONDS = "20-60"  # what the first build takes on 2-16 cores (the announcement says so)
_lib: ctypes.CDLL | None = None
_march: str | None = None  # the target the loaded library was built for
_simd = False  # half_gemm / half_gemv built with AVX2 + FMA + F16C (asked once, at load)
_bf16dot = False  # ... and the bf16 dot-product versions (AVX512-BF16) built too
_lanes_width = 0  # rows a vector of half_gemm_lanes holds (0: not built)
_tried = False
HALF_PATHS = ("fma", "bf16dot")  # HYBRIDRT_HALF_PATH: "auto" (default) or one of these


def _cache_dir(root: str | None) -> Path:
    return Path(root) if root else Path.home() / ".cache" / "hybridrt"


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _cpu_id() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    keep = ("model name", "flags", "Features", "CPU part")
    return platform.machine() + "".join(sorted({ln for ln in lines if ln.startswith(keep)}))


def _build(cc: str, cache_dir: str | None, march: str = "native") -> Path:
    flags = [*_FLAGS, f"-march={march}"]
    src = b"".join(f.read_bytes() for f in _SRCS + _HEADERS)
    key = hashlib.sha256(src + " ".join([cc, *flags, _cpu_id()]).encode()).hexdigest()[:16]
    out = _cache_dir(cache_dir) / f"hybridrt-cpu-{key}.so"
    if out.is_file():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(out.parent, os.W_OK):
            raise PermissionError(out.parent)
    except OSError:  # read-only home: build into the temp dir instead
        out = Path(tempfile.gettempdir()) / f"hybridrt-{os.getuid()}" / out.name
        if out.is_file():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
    # the first start on a machine compiles for a minute or less: say so, where, and for how long
    print(f"hybridrt: compiling the CPU kernels for this CPU (-march={march}), once; about "
          f"{_BUILD_SECONDS} s, cached in {out.parent}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        objs = [Path(tmp) / (f.stem + ".o") for f in _SRCS]
        # one compiler per source, as many at once as there are cores, then one link
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            for r in pool.map(lambda so: subprocess.run(
                    [cc, *flags, "-c", "-o", str(so[1]), str(so[0])], check=False,
                    capture_output=True, text=True, timeout=300), zip(_SRCS, objs)):
                r.check_returncode()
        subprocess.run([cc, *flags, "-shared", "-o", str(part), *map(str, objs)], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(part, out)  # atomic: concurrent builders end with one complete file
    print(f"hybridrt: CPU kernels compiled in {time.monotonic() - t0:.0f} s", file=sys.stderr,
          flush=True)
    return out


def load(cache_dir: str | None = None, march: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernels, or None (torch fallback). Builds at most once per process, into
    ``cache_dir`` (default ``~/.cache/hybridrt``) at the first call, for ``march`` (the
    compiler's ``-march``; None: "native", or whatever this process loaded already). Asking for
    another target than the loaded one is a RuntimeError: a process runs one build."""
    global _lib, _simd, _bf16dot, _tried, _march, _lanes_width
    if _tried:
        if march is not None and _march is not None and march != _march:
            raise RuntimeError(f"the CPU kernels are loaded for -march={_march} in this process; "
                               f"-march={march} needs a new process")
        return _lib
    _tried = True
    _march = march or "native"
    cc = _compiler()
    if cc is None or sys.platform == "win32":
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc, cache_dir, _march)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        warnings.warn(f"hybridrt: native CPU kernels unavailable, using torch ops ({detail})",
                      RuntimeWarning, stacklevel=2)
        return None
    fn = lib.gdn_decode_step
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 4 + [ctypes.c_int]
    P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gdn_fused.restype = ctypes.c_int  # 0, or -1 where its scratch could not be allocated
    lib.gdn_fused.argtypes = [P, I64] * 4 + [P] * 8 + [ctypes.c_float, P] + [I64] * 7 + [INT] * 3
    lib.attn_decode.restype = ctypes.c_int  # 0, or -1 where its scratch could not be allocated
    lib.attn_decode.argtypes = ([P, I64] * 3 + [P, P, ctypes.c_float, P, P, I64, P, P, P, P, I64,
                                                P, I64, ctypes.c_float, P] + [I64] * 5
                                + [INT] * 4)
    lib.rms_norm_bf16.restype = None
    lib.rms_norm_bf16.argtypes = [P, I64, P, P, P, P, ctypes.c_float, I64, I64, INT]
    lib.stream_sum.restype = ctypes.c_double  # csrc/stream.c: hybridrt/ceilings.py uses it
    lib.stream_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.stream_vector_bytes.restype = ctypes.c_int
    lib.dot_peak.restype = ctypes.c_double  # csrc/stream.c: each path's arithmetic ceiling
    lib.dot_peak.argtypes = [INT, I64, INT]
    lib.dot_peak_has.restype = INT
    lib.dot_peak_has.argtypes = [INT]
    lib.dot_peak_ops.restype = ctypes.c_double
    lib.dot_peak_ops.argtypes = [INT]
    lib.half_gemm.restype = None
    lib.half_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    lib.half_gemv.restype = None
    lib.half_gemv.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 3
    lib.half_gemm_simd.restype = ctypes.c_int
    lib.half_gemm_simd.argtypes = []
    lib.half_gemm_bf16dot.restype = ctypes.c_int
    lib.half_gemm_bf16dot.argtypes = []
    lib.half_gemm_bf16.restype = None
    lib.half_gemm_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.half_gemv_bf16.restype = None
    lib.half_gemv_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    lib.half_gemv_rows.restype = None
    lib.half_gemv_rows.argtypes = lib.half_gemv.argtypes
    lib.half_gemv_bf16_rows.restype = None
    lib.half_gemv_bf16_rows.argtypes = lib.half_gemv_bf16.argtypes
    lib.half_gemm_lanes.restype = INT  # 0, or -1 where its buffers could not be allocated
    lib.half_gemm_lanes.argtypes = [P, INT, P, P] + [I64] * 3 + [INT] * 3
    lib.half_gemm_lanes_width.restype = INT
    lib.half_gemm_lanes_width.argtypes = []
    lib.f32_gemm_rows.restype = None
    lib.f32_gemm_rows.argtypes = [P] * 3 + [I64] * 3 + [INT]
    lib.silu_mul.restype = None
    lib.silu_mul.argtypes = [P, I64, P, I64, P, I64, I64, INT, INT]
    lib.run_step.restype = ctypes.c_int  # csrc/step.c: kernels/step.py builds its list
    lib.run_step.argtypes = [P, I64, INT]
    lib.argmax_rows.restype = None
    lib.argmax_rows.argtypes = [P, I64, I64, I64, INT, P, INT]
    _simd = bool(lib.half_gemm_simd())
    _bf16dot = _simd and bool(lib.half_gemm_bf16dot())
    _lanes_width = lib.half_gemm_lanes_width()
    _lib = lib
    return _lib


def gdn_decode_step(states: torch.Tensor, slots: torch.Tensor, q: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                    beta: torch.Tensor, checked: bool = False) -> torch.Tensor | None:
    """In-place decode step over ``states`` [S, H, DK, DV] (see csrc/gdn_decode.c) -> o
    [B, H, DV], or None when the native kernel is not available for these tensors.
    ``checked``: the caller has already checked that every slot is inside the pool (the CPU
    backend does, once per step, on its host copy); otherwise it is checked here."""
    if states.device.type != "cpu" or not states.is_contiguous():
        return None
    lib = load()
    if lib is None:
        return None
    B, H, DK = q.shape
    DV = v.shape[-1]
    slots = slots.to(torch.int64).contiguous()
    if not checked and slots.numel() and not (
            0 <= int(slots.min()) <= int(slots.max()) < states.shape[0]):
        raise IndexError(f"state slots out of range [0, {states.shape[0]})")
    q, k, v, decay, beta = (t.float().contiguous() for t in (q, k, v, decay, beta))
    out = torch.empty(B, H, DV, dtype=torch.float32)
    lib.gdn_decode_step(states.data_ptr(), slots.data_ptr(), q.data_ptr(), k.data_ptr(),
                        v.data_ptr(), decay.data_ptr(), beta.data_ptr(), out.data_ptr(),
                        B, H, DK, DV, torch.get_num_threads())
    return out


def half_gemm_available() -> bool:
    """Whether ``half_gemm`` / ``half_gemv`` run here (the library built, with AVX2 + FMA +
    F16C)."""
    return load() is not None and _simd


def _check_half_weight(name: str, x: torch.Tensor, weight: torch.Tensor, max_rows=None):
    if weight.dtype not in (torch.bfloat16, torch.float16) or weight.dim() != 2 or not (
            weight.is_contiguous() and weight.device.type == "cpu"):
        raise ValueError(f"{name}: weight must be a contiguous CPU bf16/fp16 matrix, got "
                         f"{weight.dtype} {list(weight.shape)}")
    K = weight.shape[1]
    if x.dim() != 2 or x.shape[1] != K or (max_rows is not None and x.shape[0] > max_rows):
        rows = "M" if max_rows is None else f"M <= {max_rows}"
        raise ValueError(f"{name}: x must be [{rows}, {K}], got {list(x.shape)}")


def half_paths() -> list[str]:
    """The half-weight kernel paths built for this CPU: "fma" (AVX2 + FMA + F16C: weights and
    activations widened to fp32) and "bf16dot" (AVX512-BF16 dot products, for bf16 activations
    times bf16 weights)."""
    if load() is None or not _simd:
        return []
    return ["fma", "bf16dot"] if _bf16dot else ["fma"]


def half_path(want: str = "auto") -> str | None:
    """The path ``half_gemm`` / ``half_gemv`` take for bf16 x bf16: the fastest built
    ("auto"), or ``want`` (``HYBRIDRT_HALF_PATH``; an unknown or unbuilt name is an error)."""
    paths = half_paths()
    if want == "auto":
        return paths[-1] if paths else None
    if want not in HALF_PATHS:
        raise ValueError(f"HYBRIDRT_HALF_PATH={want!r}: use auto, {' or '.join(HALF_PATHS)}")
    if want not in paths:
        raise ValueError(f"HYBRIDRT_HALF_PATH={want!r}: not built for this CPU (built: "
                         f"{', '.join(paths) or 'none'})")
    return want


def _bf16_operands(x: torch.Tensor, weight: torch.Tensor, path: str | None) -> bool:
    return (path == "bf16dot" and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and weight.shape[1] % 2 == 0)


def half_gemm(x: torch.Tensor, weight: torch.Tensor, path: str | None = None) -> torch.Tensor:
    """x [M, K] (any float dtype) times a bf16/fp16 weight [N, K] as it is (row-major,
    contiguous; see csrc/half_gemm.c) -> [M, N] fp32. ``path``: "fma" or "bf16dot" (bf16 x and
    weight, even K; otherwise "fma" runs), default ``half_path()``. Callers check
    ``half_gemm_available``."""
    _check_half_weight("half_gemm", x, weight)
    lib = _lib or load()
    if lib is None:
        raise RuntimeError("half_gemm: native CPU kernels unavailable")
    N, K = weight.shape
    y = torch.empty(x.shape[0], N, dtype=torch.float32)
    if K == 0:
        return y.zero_()
    if not (x.shape[0] and N):
        return y
    if _bf16_operands(x, weight, path or half_path()):
        x = x.contiguous()
        lib.half_gemm_bf16(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], N, K,
                           torch.get_num_threads())
        return y
    x = x.float().contiguous()
    lib.half_gemm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], N, K,
                  int(weight.dtype == torch.float16), torch.get_num_threads())
    return y


HALF_GEMV_MAX_ROWS = 8  # up to here the GEMV beat half_gemm (docs/performance.md)


def half_gemv(x: torch.Tensor, weight: torch.Tensor, path: str | None = None,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] (M <= ``HALF_GEMV_MAX_ROWS``, any float dtype) times a bf16/fp16 weight [N, K]
    as it is (row-major, contiguous) -> [M, N] in ``out_dtype`` (fp32, or bf16: the fp32 sums
    rounded): each weight element read once, for decode at small batch and draft verification.
    ``path`` as in ``half_gemm`` (bf16dot: any K). Callers check ``half_gemm_available``."""
    _, y = _half_output("half_gemv", x, weight, out_dtype, HALF_GEMV_MAX_ROWS)
    if y.numel():
        _gemv(x, weight, y, path or half_path())
    return y


def _half_output(name: str, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
                 max_rows: int | None = None) -> tuple[ctypes.CDLL, torch.Tensor]:
    """The checks and output of the half-weight products that write fp32 or bf16: x and the
    weight checked, ``out_dtype`` one of the two, the kernels loaded -> (the library, an empty
    [M, N] output)."""
    _check_half_weight(name, x, weight, max_rows)
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{name}: out_dtype must be float32 or bfloat16, got {out_dtype}")
    lib = _lib or load()
    if lib is None:
        raise RuntimeError(f"{name}: native CPU kernels unavailable")
    return lib, torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype)


def _gemv(x, weight, y, path) -> None:
    """half_gemv's call, shapes checked: bf16 x and weight on the bf16dot path, else x
    widened to fp32."""
    M, N, K = x.shape[0], weight.shape[0], weight.shape[1]
    out_bf16 = int(y.dtype == torch.bfloat16)
    if path == "bf16dot" and x.dtype == weight.dtype == torch.bfloat16:
        x = x.contiguous()
        _lib.half_gemv_bf16(x.data_ptr(), weight.data_ptr(), y.data_ptr(), M, N, K, out_bf16,
                            torch.get_num_threads())
        return
    x = x.float().contiguous()
    _lib.half_gemv(x.data_ptr(), weight.data_ptr(), y.data_ptr(), M, N, K,
                   int(weight.dtype == torch.float16), out_bf16, torch.get_num_threads())


def gemv_bf16(x: torch.Tensor, weight: torch.Tensor, path: str | None) -> torch.Tensor:
    """``half_gemv`` for the CPU backend's decode products, without its checks: x [M <= 8, K]
    bf16 contiguous, weight a contiguous bf16 [N, K] (the backend checked it once) -> [M, N]
    bf16; ``path`` the backend's ``half_path``."""
    M, K = x.shape
    if M > HALF_GEMV_MAX_ROWS or weight.shape[1] != K:
        raise ValueError(f"gemv_bf16: x {list(x.shape)} for a weight {list(weight.shape)}")
    y = torch.empty(M, weight.shape[0], dtype=torch.bfloat16)
    _gemv(x, weight, y, path)
    return y


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, path: str | None = None,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``half_gemv`` for any number of rows, each row's result bit for bit what
    ``half_gemv`` gives it alone (csrc/half_gemm.c ``half_gemv_rows``): the batch-invariant
    product. x [M, K], weight a contiguous CPU bf16/fp16 [N, K] -> [M, N] in ``out_dtype``
    (fp32 or bf16). Callers check ``half_gemm_available``."""
    lib, y = _half_output("gemv_rows", x, weight, out_dtype)
    (M, N), K = y.shape, weight.shape[1]
    if not y.numel():
        return y
    if M <= HALF_GEMV_MAX_ROWS:  # the decode kernel itself (the same sums)
        _gemv(x, weight, y, path or half_path())
        return y
    out_bf16 = int(out_dtype == torch.bfloat16)
    if (path or half_path()) == "bf16dot" and x.dtype == weight.dtype == torch.bfloat16:
        x = x.contiguous()
        lib.half_gemv_bf16_rows(x.data_ptr(), weight.data_ptr(), y.data_ptr(), M, N, K,
                                out_bf16, torch.get_num_threads())
        return y
    x = x.float().contiguous()
    lib.half_gemv_rows(x.data_ptr(), weight.data_ptr(), y.data_ptr(), M, N, K,
                       int(weight.dtype == torch.float16), out_bf16, torch.get_num_threads())
    return y


def lanes_width() -> int:
    """Rows a vector of ``gemm_lanes`` holds in this build: 16 with AVX-512, 8 with AVX2 (0:
    not built)."""
    load()
    return _lanes_width


def lanes_padded_rows(M: int) -> int:
    """The rows ``gemm_lanes`` computes for M rows of x: groups of two vectors of rows, the
    last group one vector where its rows fit one (0 where the kernels are not built)."""
    v = lanes_width()
    if not v:
        return 0
    full, rest = divmod(M, 2 * v)
    return full * 2 * v + (0 if rest == 0 else v if rest <= v else 2 * v)


def gemm_lanes(x: torch.Tensor, weight: torch.Tensor,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] (fp32 or bf16; others widened) times a contiguous CPU bf16/fp16 weight [N, K]
    on the fma path with the rows along the vector lanes (csrc/half_gemm.c
    ``half_gemm_lanes``: outer products, the weight widened once per panel) -> [M, N] in
    ``out_dtype`` (fp32, or bf16: the fp32 sums rounded). Each row's sums are one FMA chain
    per block of 512 inputs, the blocks added in order, whatever M and the rows beside it.
    Callers check ``half_gemm_available``."""
    lib, y = _half_output("gemm_lanes", x, weight, out_dtype)
    (M, N), K = y.shape, weight.shape[1]
    if not y.numel():
        return y
    x = (x if x.dtype == torch.bfloat16 else x.float()).contiguous()
    if lib.half_gemm_lanes(x.data_ptr(), int(x.dtype == torch.bfloat16), weight.data_ptr(),
                           y.data_ptr(), M, N, K, int(weight.dtype == torch.float16),
                           int(out_dtype == torch.bfloat16), torch.get_num_threads()):
        raise MemoryError(f"gemm_lanes: could not allocate buffers for x {list(x.shape)} and "
                          f"a weight {list(weight.shape)}")
    return y


def f32_gemm_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] times a contiguous fp32 weight [N, K] -> [M, N] fp32, each (row, weight row)
    pair summed in one fixed order whatever M (the batch-invariant product for fp32 weights).
    Callers check ``load()``."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or not weight.is_contiguous() or (
            x.dim() != 2 or x.shape[1] != weight.shape[1]):
        raise ValueError(f"f32_gemm_rows: x {list(x.shape)} for a weight {weight.dtype} "
                         f"{list(weight.shape)}")
    M, (N, K) = x.shape[0], weight.shape
    x = x.float().contiguous()
    y = torch.empty(M, N, dtype=torch.float32)
    if M and N:
        _lib.f32_gemm_rows(x.data_ptr(), weight.data_ptr(), y.data_ptr(), M, N, K,
                           torch.get_num_threads())
    return y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows of bf16 or fp32 (2-D, unit column stride, e.g. the two halves
    of one merged projection) -> [M, N] contiguous, each element computed by its column's
    arithmetic whatever the number of rows (csrc/norm.c). Callers check ``load()``."""
    M, N = gate.shape
    out = torch.empty(M, N, dtype=gate.dtype)
    if M and N:
        _lib.silu_mul(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0),
                      out.data_ptr(), M, N, _FUSED_DTYPES[gate.dtype], torch.get_num_threads())
    return out


_FUSED_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

# ``simd``, the vector loops of gdn_fused (conv, output norm) and attn_decode (dot products,
# value sums, gate): 2 = AVX-512 (16 lanes) where the build has it, else AVX2 (8 lanes);
# 1 = AVX2 at most; 0 = their plain C loops (KernelOptions.fused_simd, HYBRIDRT_FUSED_SIMD;
# the tests run each)


def fused_dtype_code(dtype: torch.dtype) -> int | None:
    """0 (fp32) or 1 (bf16): the activation dtypes ``gdn_fused`` and ``attn_decode`` take."""
    return _FUSED_DTYPES.get(dtype)


def gdn_fused(mixed, z, a, b, conv_taps, conv_states, ssm, slots, slots_out, neg_exp_a,
              dt_bias, norm_w, eps: float, L: int, HK: int, DK: int,
              simd: int = SIMD_AVX512) -> torch.Tensor:
    """A GDN layer's recurrent tokens (csrc/gdn_fused.c) -> out [B * L, HV * DV] in the
    activations' dtype, the gated-normed input of out_proj; conv and recurrent states updated
    in their pools (in place, or into ``slots_out`` [B, L]).

    mixed [B*L, C], z [B*L, HV*DV], a, b [B*L, HV]: rows with unit column stride (views into
    one projection output are fine), all fp32 or all bf16 as ``conv_states`` [S, K-1, C] and
    ``norm_w`` [DV]; conv_taps [K, C], neg_exp_a (-exp(A_log)), dt_bias [HV] fp32; ssm
    [S, HV, DK, DV] fp32; slots [B] int64. Callers check shapes and slot ranges (the CPU
    backend does, once per step) and ``load()``. ``simd``: the vector loops (above)."""
    N, HV = a.shape
    DV = norm_w.shape[0]
    K = conv_taps.shape[0]
    out = torch.empty(N, HV * DV, dtype=mixed.dtype)
    failed = _lib.gdn_fused(
        mixed.data_ptr(), mixed.stride(0), z.data_ptr(), z.stride(0), a.data_ptr(), a.stride(0),
        b.data_ptr(), b.stride(0), conv_taps.data_ptr(), conv_states.data_ptr(), ssm.data_ptr(),
        slots.data_ptr(), None if slots_out is None else slots_out.data_ptr(),
        neg_exp_a.data_ptr(), dt_bias.data_ptr(), norm_w.data_ptr(), eps, out.data_ptr(),
        N // L, L, K, HK, HV, DK, DV, _FUSED_DTYPES[mixed.dtype], int(simd),
        torch.get_num_threads())
    if failed:
        raise MemoryError(f"gdn_fused: no memory for the conv outputs of {N} tokens")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """Zero-centred RMSNorm of the rows of bf16 ``x`` (csrc/norm.c), with ``residual``: the
    pair (norm(residual + x), residual + x), what ``kernels.norm.rms_norm`` gives after the
    add. x: [..., D] with unit last stride and rows of D (2-D: any row stride); weight [D] and
    residual (contiguous) bf16. Callers check dtypes and ``load()``."""
    D = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, D)
    out = torch.empty(x.shape, dtype=x.dtype)
    res_out = None if residual is None else torch.empty(x.shape, dtype=x.dtype)
    _lib.rms_norm_bf16(x2.data_ptr(), x2.stride(0),
                       None if residual is None else residual.data_ptr(), out.data_ptr(),
                       None if res_out is None else res_out.data_ptr(), weight.data_ptr(), eps,
                       x2.shape[0], D, torch.get_num_threads())
    return out if residual is None else (out, res_out)


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x.argmax(-1)`` of 2-D fp32 or bf16 CPU logits with unit column stride (csrc/argmax.c:
    the first maximum, or the first NaN) -> [rows] int64; None where ``x`` is not such a tensor
    or this process has not loaded the kernels (the CPU backend loads them unless told not to:
    this never builds them)."""
    if (_lib is None or x.dim() != 2 or x.device.type != "cpu"
            or x.dtype not in (torch.float32, torch.bfloat16) or x.stride(-1) != 1):
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _lib.argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1],
                     int(x.dtype == torch.bfloat16), out.data_ptr(), torch.get_num_threads())
    return out


def attn_decode(qg, k, v, q_w, k_w, eps: float, cos, sin, key_cache, value_cache,
                slot_mapping, block_tables, seq_lens, scale: float, L: int, H: int, HKV: int,
                D: int, simd: int = SIMD_AVX512) -> torch.Tensor:
    """Decode or verification tokens of a gated attention layer (csrc/attn_decode.c), L per
    sequence (rows sequence after sequence) -> out [B L, H * D] in the activations' dtype, the
    gated input of o_proj; each token's k and v written to its KV slot. qg [B L, H * 2D],
    k, v [B L, HKV * D] with unit column stride; q_w, k_w [D], cos, sin [B L, R], caches
    [blocks, block size, HKV, D] all in that dtype (fp32 or bf16), or int8 caches in
    kernels/kvquant.py's layout; slot_mapping [B L],
    block_tables [B, M], seq_lens [B] int64. Callers check every slot, block and length against
    the caches, and ``load()``."""
    N = qg.shape[0]
    out = torch.empty(N, H * D, dtype=qg.dtype)
    tables = block_tables.contiguous()
    failed = _lib.attn_decode(
        qg.data_ptr(), qg.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        q_w.data_ptr(), k_w.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(), cos.shape[-1],
        key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(),
        tables.data_ptr(), tables.shape[-1], seq_lens.data_ptr(), key_cache.shape[1], scale,
        out.data_ptr(), N // L, L, H, HKV, D, _FUSED_DTYPES[qg.dtype],
        int(key_cache.dtype == torch.int8), int(simd), torch.get_num_threads())
    if failed:
        raise MemoryError(f"attn_decode: no memory for the partials of {N} rows")
    return out
