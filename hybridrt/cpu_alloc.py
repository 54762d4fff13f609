"""Keep large freed buffers in the process heap (glibc), so that steps stop re-faulting pages.

glibc serves allocations above its mmap threshold (at most 32 MiB, raised dynamically) with a
fresh ``mmap`` and gives them back to the OS on free. A decode step allocates such buffers over
and over (the [32, vocab] fp32 logits alone are 32 MiB), and each comes back as untouched pages
that fault in on first write, which costs several times the copy itself (docs/performance.md).
Raising the mmap and trim thresholds keeps freed blocks for reuse (what vLLM's CPU backend gets
by preloading tcmalloc); the cost is that the heap keeps its peak size. A no-op off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_THRESHOLD = 1 << 30

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds to 1 GiB, once per process -> whether it applied."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _THRESHOLD))
    return _done
