"""The terminal while chat streams an answer: keys typed meanwhile are neither echoed into the
answer nor left over for the next prompt, and Ctrl-C prints no ``^C``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import IO


@contextlib.contextmanager
def quiet_input(stdin: IO) -> Iterator[None]:
    """Turn off the echo of ``stdin``'s terminal (ECHO, ECHOCTL) for the block; on the way out,
    however it ends (Ctrl-C, an exception), discard what was typed meanwhile and restore the
    settings. Signals stay on: Ctrl-C still interrupts. A no-op where stdin is not a terminal
    (a pipe, a file, tests' StringIO) or termios does not exist (Windows)."""
    try:
        import termios
    except ImportError:
        termios = None
    saved = None
    if termios is not None:
        with contextlib.suppress(AttributeError, OSError, ValueError, termios.error):
            fd = stdin.fileno()
            saved = termios.tcgetattr(fd) if stdin.isatty() else None
    if saved is None:
        yield
        return
    quiet = list(saved)
    quiet[3] = saved[3] & ~(termios.ECHO | termios.ECHOCTL)  # lflag
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        # TCSAFLUSH: also drops the input not yet read
        with contextlib.suppress(OSError, termios.error):
            termios.tcsetattr(fd, termios.TCSAFLUSH, saved)
