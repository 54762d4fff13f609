"""The thread governor (hybridrt/threads.py) and the busy-machine benchmark."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hybridrt import threads as threads_mod
from hybridrt.bench import busy as busybench
from hybridrt.threads import ThreadGovernor


def test_busy_bench_report(monkeypatch):
    """Every variant runs in both conditions, alternated, with its environment; the default's
    ratio is to the best explicit --threads; the busy condition really has a busy process."""
    calls = []

    def fake_probe(model, env, threads, tokens, engine):
        assert engine == {"block_size": 32}  # the option group's flags reach each probe
        spinning = subprocess.run(["pgrep", "-f", busybench._SPIN], capture_output=True,
                                  check=False).returncode == 0
        calls.append((dict(env), threads, spinning))
        return {0: 8.0, 1: 10.0, 2: 4.0}[threads] * (0.5 if spinning else 1.0)

    monkeypatch.setattr(busybench, "_probe", fake_probe)
    report = busybench.measure_busy("m", tokens=5, rounds=2, cores=2, engine={"block_size": 32})
    cond = report["conditions"]
    assert set(cond) == {"as is", "one busy process"}
    assert cond["as is"]["default_over_best_explicit"] == pytest.approx(0.8)
    assert cond["one busy process"]["tok_s"]["--threads 1"] == pytest.approx(5.0)
    assert len(calls) == 2 * 2 * len(busybench._variants(2))
    assert all(spin == (i >= len(calls) // 2) for i, (_, _, spin) in enumerate(calls))
    assert ({"HYBRIDRT_ADAPTIVE_THREADS": "0"}, 0, False) in calls
    text = busybench.format_report(report)
    assert "default / best --threads" in text and "0.80x" in text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_busy_bench_spinner_dies_with_the_benchmark():
    """A benchmark killed outright (no cleanup runs) takes its busy process with it."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import time; from hybridrt.bench import busy as busybench; "
         "print(busybench._spinner().pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    assert os.path.exists(f"/proc/{pid}")
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    survived = _alive(pid)
    if survived:  # do not leave it spinning under the rest of the suite
        os.kill(pid, 9)
    assert not survived, "the spinner outlived the benchmark"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_busy_bench_probe_runs_the_demo_model():
    assert busybench._probe(None, {}, 1, 3) > 0


class FakeMachine:
    """/proc's CPU counters for a machine where other processes keep ``others`` cores busy and
    this process ``own`` cores, advanced by ``tick`` seconds."""

    def __init__(self):
        self.t, self.busy, self.own = 0.0, 0.0, 0.0
        self.others, self.own_rate = 0.0, 1.0
        self.set_calls = []

    def tick(self, dt: float) -> None:
        self.t += dt
        self.busy += (self.others + self.own_rate) * dt
        self.own += self.own_rate * dt

    def governor(self, max_threads=2, interval=0.5):
        return ThreadGovernor(max_threads, interval, read=lambda: (self.busy, self.own),
                              clock=lambda: self.t, set_threads=self.set_calls.append)


def test_governor_leaves_busy_cores_to_others(monkeypatch):
    monkeypatch.setattr(threads_mod, "_cores", lambda: 2)
    m = FakeMachine()
    g = m.governor()  # takes the first sample
    assert g.update() == 2 and m.set_calls == []  # no interval yet
    m.others = 1.0  # one busy process
    m.tick(0.2)
    assert g.update() == 2  # within the interval: not re-decided
    m.tick(0.4)
    assert g.update() == 1 and m.set_calls == [1]
    m.others, m.own_rate = 0.3, 2.0  # quiet again (our own 2 cores are not "others")
    m.tick(0.6)
    assert g.update() == 2 and m.set_calls == [1, 2]
    m.others = 5.0  # more busy than there are cores: still one thread
    m.tick(0.6)
    assert g.update() == 1
    g4 = FakeMachine().governor(max_threads=1)
    assert g4.update() == 1


def test_governor_without_proc_keeps_its_threads():
    calls = []
    g = ThreadGovernor(2, 0.0, read=lambda: None, set_threads=calls.append)
    assert g.update() == 2 and g.update() == 2 and calls == []


def test_cpu_times_count_this_process():
    sample = threads_mod._cpu_times()
    if sample is None:
        pytest.skip("no /proc here")
    busy0, own0 = sample
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    busy1, own1 = threads_mod._cpu_times()
    assert own1 - own0 >= 0.2 and busy1 - busy0 >= own1 - own0 - 0.05


def test_llm_adapts_threads_only_when_nobody_chose(monkeypatch):
    import torch

    from hybridrt.llm import LLM

    before = torch.get_num_threads()
    try:
        assert isinstance(LLM(tokenizer=None).engine.governor, ThreadGovernor)
        assert LLM(tokenizer=None, threads=1).engine.governor is None
        monkeypatch.setenv("HYBRIDRT_ADAPTIVE_THREADS", "0")
        assert LLM(tokenizer=None).engine.governor is None
    finally:
        torch.set_num_threads(before)
