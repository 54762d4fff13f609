"""The server process's own concerns: glibc's heap (one malloc arena, memory handed back
after a large request) and the API key (flag, file or environment)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os


def release_memory() -> None:
    """Give freed heap back to the system: glibc keeps large freed blocks in the process
    otherwise (its mmap threshold grows with the largest block freed), so a refused 4 MB
    request would leave its parsed copies' pages resident."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def one_malloc_arena(environ=None) -> bool:
    """Put every thread's heap in glibc's main arena (``mallopt(M_ARENA_MAX, 1)``), unless
    MALLOC_ARENA_MAX or a ``glibc.malloc.arena_max`` tunable says otherwise; True when set.
    Call it before any thread allocates: a thread keeps the arena it first used. Why:
    ``malloc_trim`` (``release_memory``) hands back the main arena's free top but not another
    arena's, and a parsing thread's arena keeps a free top of up to 64 MiB (glibc trims it on
    free only past a threshold it raises to twice the largest block freed) - docs/server.md."""
    environ = os.environ if environ is None else environ
    if "MALLOC_ARENA_MAX" in environ or "arena_max" in environ.get("GLIBC_TUNABLES", ""):
        return False
    with contextlib.suppress(OSError, AttributeError, TypeError):
        m_arena_max = -8  # malloc.h
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(
            m_arena_max, 1) == 1
    return False


def resolve_api_key(api_key: str | None, api_key_file: str | None,
                    environ=None) -> str | None:
    """The key from --api-key, else the file --api-key-file names, else HYBRIDRT_API_KEY;
    None: no key. Surrounding blanks (a file's newline) are dropped; an empty key is an
    error (it would let anyone in). ValueError for a file that cannot be read."""
    from hybridrt import env

    if api_key is None and api_key_file is not None:
        try:
            with open(api_key_file, encoding="utf-8") as f:
                api_key = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {api_key_file}: {e}") from None
    if api_key is None:
        api_key = env.read("HYBRIDRT_API_KEY", environ) or None
    if api_key is not None:
        api_key = api_key.strip()
        if not api_key:
            raise ValueError("the API key is empty")
    return api_key
