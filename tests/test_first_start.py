"""The first start on a machine: the kernels' compile is announced (what, for how long, where
it is cached) and every later start is silent."""

import os
import stat
import subprocess
import sys

LOAD = ("import sys; from hybridrt.kernels import native; "
        "native.load(sys.argv[1]); print('loaded', native._lib is not None)")


def _fake_compiler(tmp_path):
    """A 'cc' that writes an empty file wherever -o points (the load then fails and warns:
    only the announcement is under test, not a minute of compiling)."""
    cc = tmp_path / "fake-cc"
    cc.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do\n  if [ "$1" = -o ]; then : > "$2"; fi\n'
                  '  shift\ndone\n')
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    return cc


def test_first_compile_is_announced_once(tmp_path):
    env = {**os.environ, "CC": str(_fake_compiler(tmp_path))}
    cache = tmp_path / "cache"
    first = subprocess.run([sys.executable, "-c", LOAD, str(cache)], capture_output=True,
                           text=True, env=env, timeout=120, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    lines = [ln for ln in first.stderr.splitlines() if ln.startswith("hybridrt: ")]
    assert lines[0].startswith("hybridrt: compiling the CPU kernels for this CPU")
    assert str(cache) in lines[0] and " s, cached in " in lines[0]
    assert lines[1].startswith("hybridrt: CPU kernels compiled in ")
    again = subprocess.run([sys.executable, "-c", LOAD, str(cache)], capture_output=True,
                           text=True, env=env, timeout=120, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "compiling" not in again.stderr
