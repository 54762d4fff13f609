"""CPU threads that leave other processes' cores alone.

An OpenMP parallel region (torch's ops and the compiled kernels share torch's OpenMP runtime;
a 0.8B decode step runs some 200) ends when every worker has done its share; a worker whose
core another process holds gets it back only at that process's next time slice, milliseconds
later. Beside one busy process the default two threads on two cores decoded several times
slower than one thread (docs/performance.md); making idle workers sleep instead of spin
(``OMP_WAIT_POLICY=PASSIVE``) recovers much of that but costs speed on an idle machine.
So the engine fits the thread count to the free cores instead (``ThreadGovernor``).
"""

from __future__ import annotations

import os

from hybridrt import env


class ThreadGovernor:
    """Fits torch's thread count to the cores other processes leave free, re-decided at most
    every ``interval`` seconds (the engine calls ``update`` once per step): the CPU time of
    other processes over the last interval (the CPUs' busy time from /proc/stat minus this
    process's own from /proc/self/stat) decides, threads = cores - (their busy cores, rounded),
    between 1 and ``max_threads``. Only where those files exist (Linux), and only when nobody
    chose a thread count (``LLM(threads=...)``, ``--threads``, ``HYBRIDRT_ADAPTIVE_THREADS=0``).
    """

    def __init__(self, max_threads: int, interval: float = 0.5, read=None, clock=None,
                 set_threads=None):
        import time

        import torch

        self.max_threads = max_threads
        self.interval = interval
        self._read = read or _cpu_times
        self._clock = clock or time.monotonic
        self._set = set_threads or torch.set_num_threads
        self.threads = max_threads
        self._last = None  # (time, all CPUs' busy seconds, this process's seconds)
        self.changes = 0
        self.update()  # the first sample: the first step after ``interval`` decides

    def update(self) -> int:
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.interval:
            return self.threads
        sample = self._read()
        if sample is None:
            return self.threads
        busy, own = sample
        if self._last is not None:
            t0, busy0, own0 = self._last
            others = max(0.0, (busy - busy0) - (own - own0)) / max(now - t0, 1e-9)
            want = max(1, min(self.max_threads, _cores() - int(others + 0.5)))
            if want != self.threads:
                self._set(want)
                self.threads = want
                self.changes += 1
        self._last = (now, busy, own)
        return self.threads


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _cpu_times() -> tuple[float, float] | None:
    """(seconds the CPUs this process may run on spent busy, seconds this process spent on
    CPUs) since boot, or None where /proc cannot tell."""
    try:
        mine = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        with open("/proc/stat") as f:
            lines = [ln.split() for ln in f if ln.startswith("cpu")]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except (OSError, AttributeError):
        return None
    # cpuN user nice system idle iowait irq softirq steal ...; own[11], own[12]: utime, stime
    busy = sum(int(v) for fields in lines if fields[0] in mine
               for i, v in enumerate(fields[1:9]) if i not in (3, 4))
    return busy / _TICK, (int(own[11]) + int(own[12])) / _TICK


def adaptive_threads_enabled() -> bool:
    return env.adaptive_threads()
