"""Keep large freed buffers in the process heap (glibc), so that steps stop re-faulting pages.

glibc serves allocations above its mmap threshold (at most 32 MiB, raised dynamically) with a
fresh ``mmap`` and gives them back to the OS on free. A decode step allocates such buffers over
and over (the [32, vocab] fp32 logits alone are 32 MiB), and each comes back as untouched pages
that fault in on first write, which costs several times the copy itself (docs/performance.md).
Raising the mmap and trim thresholds keeps freed blocks for reuse (what vLLM's CPU backend gets
by preloading tcmalloc); the cost is that the heap keeps its peak size. A no-op off glibc.

Also here: ``release_pages`` (give a dropped tensor's pages back now) and ``HugeArena``
(weights in transparent-huge-page memory).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import math
import mmap
import os
import sys
import threading
from pathlib import Path

import torch

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
    libc = _load_libc()
    mallopt = getattr(libc, "mallopt", None) if libc else None
    if mallopt is None:  # musl and other libcs have no mallopt
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
    if not sys.platform.startswith("linux") or t.device.type != "cpu" or (
            t.untyped_storage().nbytes() != t.numel() * t.element_size()):
        return 0
    return _release(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())


def _release(begin: int, end: int) -> int:
    """madvise(MADV_DONTNEED) the pages wholly inside [begin, end) -> the bytes released."""
    if not _load_libc():
        return 0
    page = mmap.PAGESIZE
    start = -(-begin // page) * page
    end = end // page * page
    if end <= start or _libc.madvise(start, end - start, _MADV_DONTNEED) != 0:
        return 0
    return end - start


def _load_libc():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    return _libc


_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1
_HUGE = 2 << 20
_collapse: bool | None = None
_settling: list[threading.Thread] = []
settle_at_load = False  # True: arenas take huge pages as they fill (the benchmarks set it)


def collapse_supported() -> bool:
    """Whether this kernel has ``MADV_COLLAPSE`` (Linux 6.1+): ``madvise`` of no bytes checks
    the advice and does nothing else."""
    global _collapse
    if _collapse is None:
        _collapse = False
        libc = _load_libc()
        if libc and sys.platform.startswith("linux"):
            buf = mmap.mmap(-1, mmap.PAGESIZE)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
            _collapse = libc.madvise(addr, 0, _MADV_COLLAPSE) == 0
            buf.close()
    return _collapse


_MADV_POPULATE_READ = 22  # Linux 5.14


def populate(tensors) -> threading.Thread | None:
    """Map the pages of CPU ``tensors`` (a file mapping's, left where the loader put them) into
    the process ahead of use (``MADV_POPULATE_READ``, a ``SETTLE_CHUNK`` at a time; nothing is
    copied): otherwise the first step to read each page faults it in, and a prompt's MoE step,
    which reads every expert, pays some hundred thousand faults. In a background thread at the
    lowest priority (``wait_for_huge_pages`` waits for it too), or at once where
    ``settle_at_load`` asks -> the thread (None: done at once, or nothing to do)."""
    spans = sorted({(t.data_ptr(), t.numel() * t.element_size()) for t in tensors
                    if t.device.type == "cpu" and t.numel()})
    if not spans or not sys.platform.startswith("linux") or not _load_libc():
        return None
    merged: list[list[int]] = []
    for begin, n in spans:  # adjacent tensors of one file: one range
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], begin + n)
        else:
            merged.append([begin, begin + n])
    keep = list(tensors)  # the thread keeps the mappings alive

    def run(background: bool) -> None:
        if background:
            with contextlib.suppress(AttributeError, OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        page = mmap.PAGESIZE
        for begin, end in merged:
            start = begin // page * page
            for off in range(start, end, HugeArena.SETTLE_CHUNK):
                if _libc.madvise(off, min(HugeArena.SETTLE_CHUNK, end - off),
                                 _MADV_POPULATE_READ) != 0:
                    return  # an older kernel: the pages fault in as they are read
        del keep[:]

    if settle_at_load:
        run(False)
        return None
    t = threading.Thread(target=run, args=(True,), name="hybridrt-populate", daemon=True)
    _settling.append(t)
    t.start()
    return t


def wait_for_huge_pages(timeout: float | None = None) -> bool:
    """Wait until every arena's background move into huge pages (``HugeArena.settle``) and
    every background ``populate`` is done -> whether all are."""
    for t in list(_settling):
        t.join(timeout)
    _settling[:] = [t for t in _settling if t.is_alive()]
    return not _settling


def huge_pages_available() -> bool:
    """Whether a ``HugeArena`` gets huge pages here: Linux with transparent huge pages not
    "never" (the CPU backend asks for one where this holds and its options allow it)."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode and bool(_load_libc())


def advise_huge_pages(buf: mmap.mmap) -> None:
    """Ask for transparent huge pages over an anonymous mapping nothing has touched yet: the KV
    blocks and GDN slots a decode step reads, whose blocks lie anywhere in their pool, so that
    a read crosses a page every 2 MiB instead of every 4 KiB. Memory is still taken as it is
    used, 2 MiB at a time. Advice only: a refusal changes nothing."""
    libc = _load_libc()
    if libc and len(buf) >= _HUGE:
        libc.madvise(ctypes.addressof(ctypes.c_char.from_buffer(buf)), len(buf), _MADV_HUGEPAGE)


def weights_on_huge_pages(opts) -> bool:
    """Whether the CPU backend puts the loaded weights in a ``HugeArena``: its options
    (``KernelOptions.huge_pages``) allow it and ``huge_pages_available``."""
    return opts.huge_pages and huge_pages_available()


class HugeArena:
    """One anonymous mapping, 2 MiB-aligned, in transparent huge pages, handed out front to back
    by ``empty``: the weights a decode step streams, so that a stream crosses a page every 2 MiB
    instead of every 4 KiB (the hardware prefetcher stops at page boundaries;
    docs/performance.md). One mapping for all of them wastes at most one page; it lives as long
    as any tensor taken from it.

    Where the kernel has ``MADV_COLLAPSE`` (and ``settle_at_load`` is off) the arena fills in
    ordinary pages and ``settle`` moves them into huge pages in a background thread, the
    addresses unchanged, at the lowest priority (nice 19: it takes the cores the model leaves
    idle): getting 2 MiB pages can cost far more than filling them (on the project's VMs about
    8 ms each, seconds for the 0.8B shape's weights, docs/performance.md), and that no longer
    delays the first token. Otherwise the mapping is advised
    (``MADV_HUGEPAGE``) before anything touches it."""

    ALIGN = 64

    def __init__(self, nbytes: int):
        self._buf = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(self._buf))
        start = -addr % _HUGE
        self._addr, self._nbytes = addr + start, nbytes
        self.later = not settle_at_load and collapse_supported()
        libc = _load_libc()
        if libc and not self.later:
            libc.madvise(addr + start, nbytes, _MADV_HUGEPAGE)  # advice: a refusal changes nothing
        self._bytes = torch.frombuffer(self._buf, dtype=torch.uint8, count=nbytes, offset=start)
        self._next = 0

    SETTLE_CHUNK = 32 << 20  # bytes moved into huge pages by one madvise call in ``settle``

    def settle(self) -> threading.Thread | None:
        """Once filled: move the arena's pages into huge pages in a background thread
        (``MADV_HUGEPAGE``, then ``MADV_COLLAPSE`` a ``SETTLE_CHUNK`` at a time; the contents and
        addresses stay; ``wait_for_huge_pages`` waits for it) -> the thread, or None where the
        arena took huge pages as it filled."""
        if not self.later:
            return None
        self.later = False
        t = threading.Thread(target=self._collapse, name="hybridrt-huge-pages", daemon=True)
        _settling.append(t)
        t.start()
        return t

    def _collapse(self) -> None:
        libc, buf = _load_libc(), self._buf  # the thread keeps the mapping alive
        with contextlib.suppress(AttributeError, OSError):  # the lowest priority: the
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # model's go first
        libc.madvise(self._addr, self._nbytes, _MADV_HUGEPAGE)
        full = self._nbytes // _HUGE * _HUGE
        for off in range(0, full, self.SETTLE_CHUNK):
            if buf.closed:
                return
            libc.madvise(self._addr + off, min(self.SETTLE_CHUNK, full - off), _MADV_COLLAPSE)

    def empty(self, shape, dtype) -> torch.Tensor:
        n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if self._next + n > self._bytes.numel():
            left = self._bytes.numel() - self._next
            raise MemoryError(f"HugeArena: {n} bytes asked, {left} left")
        t = self._bytes[self._next:self._next + n].view(dtype).view(shape)
        self._next += -(-n // self.ALIGN) * self.ALIGN
        return t

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        return self.empty(t.shape, t.dtype).copy_(t)

    MOVE_CHUNK = 32 << 20  # bytes copied between two releases in ``move``

    def move(self, t: torch.Tensor) -> torch.Tensor:
        """``copy`` for a tensor about to be dropped, which gives its pages back as the copy
        goes (``release_pages``, a piece of ``MOVE_CHUNK`` bytes at a time): moving the 0.8B
        shape's 0.25-0.5 GiB embedding no longer holds both copies at once. ``t`` must not be
        read afterwards."""
        out = self.empty(t.shape, t.dtype)
        whole = (t.device.type == "cpu" and t.is_contiguous() and t.dim() > 0
                 and t.untyped_storage().nbytes() == t.numel() * t.element_size())
        if not whole or t.numel() * t.element_size() <= self.MOVE_CHUNK:
            out.copy_(t)
            release_pages(t)
            return out
        rows = max(1, self.MOVE_CHUNK // (t[0].numel() * t.element_size()))
        for i in range(0, t.shape[0], rows):
            src = t[i:i + rows]
            out[i:i + rows].copy_(src)
            begin = src.data_ptr()
            _release(begin, begin + src.numel() * src.element_size())
        return out

    @classmethod
    def size_for(cls, tensors) -> int:
        """Bytes an arena needs to hold ``tensors`` (each padded to ``ALIGN``)."""
        return sum(-(-t.numel() * t.element_size() // cls.ALIGN) * cls.ALIGN for t in tensors)
