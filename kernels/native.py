"""Small C kernels for the CPU decode path, compiled on first use with the system C compiler.

PyTorch has no fused CPU op for the gated-delta-rule decode step: the torch formulation
(``delta_rule._step_in_place``) makes three passes over every state plus small batched
products. ``csrc/gdn_decode.c`` does one read pass and one update pass per (sequence, head)
while the 64 KiB state sits in L2. It is built with ``cc -O3 -march=native -fopenmp`` into
``$HYBRIDRT_CACHE`` (default ``~/.cache/hybridrt``), keyed by a hash of the source, the flags
and this CPU's model and feature flags (a ``-march=native`` build must not be reused on another
CPU), and loaded with ctypes. Without a C compiler that builds it (with OpenMP), on Windows, or
with ``HYBRIDRT_NATIVE=0``, ``load()`` returns None and callers keep the torch path (same math,
tested against each other).
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
import warnings
from pathlib import Path

import torch

_SRC = Path(__file__).parent / "csrc" / "gdn_decode.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_lib: ctypes.CDLL | None = None
_tried = False


def enabled() -> bool:
    return os.environ.get("HYBRIDRT_NATIVE", "1") not in ("0", "false", "no", "off")


def _cache_dir() -> Path:
    root = os.environ.get("HYBRIDRT_CACHE")
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


def _build(cc: str) -> Path:
    src = _SRC.read_bytes()
    key = hashlib.sha256(src + " ".join([cc, *_FLAGS, _cpu_id()]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"gdn_decode-{key}.so"
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
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        subprocess.run([cc, *_FLAGS, "-o", str(part), str(_SRC)], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(part, out)  # atomic: concurrent builders end with one complete file
    return out


def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None (torch fallback). Builds at most once per process."""
    global _lib, _tried
    if _tried or not enabled():
        return _lib if enabled() else None
    _tried = True
    cc = _compiler()
    if cc is None or sys.platform == "win32":
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        warnings.warn(f"hybridrt: native CPU kernels unavailable, using torch ops ({detail})",
                      RuntimeWarning, stacklevel=2)
        return None
    fn = lib.gdn_decode_step
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 4 + [ctypes.c_int]
    _lib = lib
    return _lib


def gdn_decode_step(states: torch.Tensor, slots: torch.Tensor, q: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor | None:
    """In-place decode step over ``states`` [S, H, DK, DV] (see csrc/gdn_decode.c) -> o
    [B, H, DV], or None when the native kernel is not available for these tensors."""
    if states.device.type != "cpu" or not states.is_contiguous():
        return None
    lib = load()
    if lib is None:
        return None
    B, H, DK = q.shape
    DV = v.shape[-1]
    slots = slots.to(torch.int64).contiguous()
    if slots.numel() and not 0 <= int(slots.min()) <= int(slots.max()) < states.shape[0]:
        raise IndexError(f"state slots out of range [0, {states.shape[0]})")
    q, k, v, decay, beta = (t.float().contiguous() for t in (q, k, v, decay, beta))
    out = torch.empty(B, H, DV, dtype=torch.float32)
    lib.gdn_decode_step(states.data_ptr(), slots.data_ptr(), q.data_ptr(), k.data_ptr(),
                        v.data_ptr(), decay.data_ptr(), beta.data_ptr(), out.data_ptr(),
                        B, H, DK, DV, torch.get_num_threads())
    return out
