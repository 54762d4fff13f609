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


_MADV_DONTNEED = 4
_libc = None


def release_pages(t) -> int:
    """Give the pages that lie wholly inside CPU tensor ``t``'s bytes back to the OS (Linux
    ``madvise(MADV_DONTNEED)``), for a tensor about to be dropped whose memory would otherwise
    stay resident: a copy's source in a file mapping other tensors keep alive, or a block the
    heap keeps (the thresholds above) -> the bytes released (0 where it does not apply, and for
    a tensor that is only part of its storage: the rest may be something else's). ``t`` must
    not be read afterwards: its pages read back as the file's or as zeros."""
    global _libc
    if not sys.platform.startswith("linux") or t.device.type != "cpu" or (
            t.untyped_storage().nbytes() != t.numel() * t.element_size()):
        return 0
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return 0
    import mmap

    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end <= start or _libc.madvise(start, end - start, _MADV_DONTNEED) != 0:
        return 0
    return end - start
