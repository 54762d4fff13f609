"""``hybridrt chat`` in a terminal (a pseudo-terminal it has as its controlling terminal): keys
typed while an answer streams are not echoed into it nor kept for the next prompt, Ctrl-C
stops the answer without a ``^C`` and gives a fresh prompt, ``/bye`` quits with exit 0."""

from __future__ import annotations

import contextlib
import os
import re
import select
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX terminal")

# The demo model answers in well under a second: each piece is held back a moment so that
# there is time to type into a streaming answer. Everything else is the real command.
_CHAT = """
import fcntl, sys, termios, time
fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # the pty is this session's terminal: Ctrl-C is SIGINT
from hybridrt.cli import chat
write = chat.Renderer.write
def slow(self, pieces):
    time.sleep(0.25)
    write(self, pieces)
chat.Renderer.write = slow
from hybridrt.cli.main import main
sys.argv = ["hybridrt", "chat", "--temperature", "0", "--max-tokens", "64", "--threads", "1"]
main()
"""
QUESTION = "What does json.dumps do?"
ASKED = ">>> " + QUESTION  # the banner's example is the same question
TYPED = "ZQXW"
_ESCAPES = re.compile(r"\x1b(\[[0-9;?]*[A-Za-z]|[=>])")  # readline's and the dim text's


class Terminal:
    """The chat on the far side of a pty; ``text`` is everything it has written so far."""

    def __init__(self):
        import pty

        self.fd, slave = pty.openpty()
        self.proc = subprocess.Popen([sys.executable, "-c", _CHAT], stdin=slave, stdout=slave,
                                     stderr=slave, start_new_session=True,
                                     env={**os.environ, "TERM": "xterm"})
        os.close(slave)
        self.text = ""

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def wait_for(self, done, timeout: float = 60.0) -> str:
        """Read until ``done(text)``; -> the text. Fails on timeout or end of output."""
        end = time.monotonic() + timeout
        while not done(self.text):
            left = end - time.monotonic()
            assert left > 0, f"timed out; the terminal shows:\n{self.text!r}"
            if select.select([self.fd], [], [], min(left, 0.5))[0]:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # EIO: the chat has exited
                    chunk = b""
                assert chunk, f"the chat ended; the terminal shows:\n{self.text!r}"
                self.text += chunk.decode("utf-8", "replace")
        return self.text

    def drain(self) -> None:
        """Read to the end of output (the chat has exited)."""
        while True:
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:
                return
            if not chunk:
                return
            self.text += chunk.decode("utf-8", "replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.fd)


def _ask_and_type_into_the_answer(term: Terminal, keys: str) -> None:
    mark = len(term.text)
    term.type(QUESTION + "\r")
    at = term.wait_for(lambda t: QUESTION in t[mark:]).index(QUESTION, mark) + len(QUESTION)
    # the answer has begun: a few characters of it after the echoed question
    term.wait_for(lambda t: sum(c.isalnum() for c in _ESCAPES.sub("", t[at:])) >= 3)
    term.type(keys)


def test_typing_and_ctrl_c_while_an_answer_streams_then_bye():
    term = Terminal()
    try:
        # a line before torch and the model load (a new machine's compile says so after it),
        # then the banner and the prompt
        term.wait_for(lambda t: t.endswith(">>> "))
        assert 0 <= term.text.index("hybridrt: loading the embedded demo model ...") \
            < term.text.index("hybridrt chat: ")
        _ask_and_type_into_the_answer(term, TYPED)
        time.sleep(0.3)
        term.type("\x03")  # Ctrl-C
        term.wait_for(lambda t: "(interrupted)" in t and t.endswith(">>> "))
        # Ctrl-C at the prompt: as before, a hint and a fresh prompt. A SIGINT that lands
        # between readline's prompt and its select() is seen only at the next key or signal
        # (CPython's readline), so the key is pressed again until the hint shows, as a user would
        mark = len(term.text)
        for _ in range(12):
            term.type("\x03")
            with contextlib.suppress(AssertionError):
                term.wait_for(lambda t: "(/exit or Ctrl-D to quit)" in t[mark:], timeout=5.0)
                break
        term.wait_for(lambda t: "(/exit or Ctrl-D to quit)" in t[mark:] and t.endswith(">>> "))
        # keys typed into an answer that ends by itself are dropped too
        mark = len(term.text)
        _ask_and_type_into_the_answer(term, TYPED.lower())
        term.wait_for(lambda t: "tok/s]" in t[mark:] and t.endswith(">>> "))
        term.type("/bye\r")
        term.drain()
        assert term.proc.wait(timeout=30) == 0, term.text
    finally:
        term.close()
    out = term.text
    for typed in (TYPED, TYPED.lower()):  # neither echoed nor kept for the next prompt
        assert typed not in out, out
    answer = out[out.index(ASKED) + len(ASKED):out.index("(interrupted)")]
    assert "^C" not in answer, out
    hints = out.count("(/exit or Ctrl-D to quit)")
    assert hints >= 1 and out.count(">>> ") == 3 + hints, out  # the first, after each answer,
    # after each Ctrl-C at it
    assert out.endswith(">>> /bye\r\n"), out
