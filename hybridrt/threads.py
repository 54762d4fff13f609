"""CPU worker threads that give their cores back while they wait.

torch's OpenMP workers (and the compiled kernels', which share torch's OpenMP runtime) spin
between parallel regions. On a machine where another process wants a core, a spinning worker
holds it and the worker that has work waits for a time slice: the default two threads on two
cores then decoded about 10x slower beside one busy process (docs/performance.md). With
``OMP_WAIT_POLICY=PASSIVE`` idle workers sleep instead. OpenMP reads the variable once, when
torch is imported, so ``import hybridrt`` sets it (unless the environment already has a value,
or ``HYBRIDRT_PASSIVE_WAIT=0``), which works when hybridrt is imported before torch: the command
line always, and programs that import hybridrt first.
"""

from __future__ import annotations

import os
import sys

POLICY = "OMP_WAIT_POLICY"
SWITCH = "HYBRIDRT_PASSIVE_WAIT"


def prefer_passive_wait() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` if torch is not imported yet and nothing else chose a
    policy -> whether it was set here."""
    if os.environ.get(SWITCH, "1").lower() in ("0", "false", "no", "off"):
        return False
    if POLICY in os.environ or "torch" in sys.modules:
        return False
    os.environ[POLICY] = "PASSIVE"
    return True


def wait_policy() -> str:
    """The policy this process's OpenMP runtime runs with (as far as the environment says)."""
    return os.environ.get(POLICY, "unset (spin, then sleep)")
