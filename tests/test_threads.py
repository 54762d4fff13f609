"""The OpenMP wait policy hybridrt picks (hybridrt/threads.py) and the busy-machine benchmark."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hybridrt import busybench


def _policy(code: str, **env) -> tuple[str, str]:
    """Run ``code`` in a fresh interpreter with libgomp printing its settings at start-up ->
    (stdout, the spin count libgomp runs with: 0 for PASSIVE; 300000 when no policy is set, its
    spin-then-sleep default, which it also prints as PASSIVE)."""
    full = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "HYBRIDRT_PASSIVE_WAIT")}
    full.update(OMP_DISPLAY_ENV="VERBOSE", **env)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, check=True)
    lines = [ln.strip() for ln in proc.stderr.splitlines() if "GOMP_SPINCOUNT" in ln]
    return proc.stdout.strip(), lines[0] if lines else ""


IMPORT = "import hybridrt, torch, os; torch.ones(1); print(os.environ.get('OMP_WAIT_POLICY'))"


def test_import_makes_openmp_wait_passively():
    """``import hybridrt`` before torch: torch's OpenMP runtime starts with PASSIVE (as libgomp
    itself reports)."""
    out, gomp = _policy(IMPORT)
    assert out == "PASSIVE"
    assert gomp == "GOMP_SPINCOUNT = '0'"


@pytest.mark.parametrize("env,code,want", [
    ({"OMP_WAIT_POLICY": "ACTIVE"}, IMPORT, "ACTIVE"),  # the user's choice stays
    ({"HYBRIDRT_PASSIVE_WAIT": "0"}, IMPORT, "None"),  # opted out
    ({}, "import torch, hybridrt, os; print(os.environ.get('OMP_WAIT_POLICY'))", "None"),
], ids=["user-choice", "opt-out", "torch-first"])
def test_wait_policy_left_alone(env, code, want):
    out, gomp = _policy(code, **env)
    assert out == want
    assert gomp != "GOMP_SPINCOUNT = '0'" and gomp.startswith("GOMP_SPINCOUNT")


def test_busy_bench_report(monkeypatch):
    """Every variant runs in both conditions, alternated, with its environment; the default's
    ratio is to the best explicit --threads; the busy condition really has a busy process."""
    calls = []

    def fake_probe(model, env, threads, tokens):
        spinning = subprocess.run(["pgrep", "-f", busybench._SPIN], capture_output=True,
                                  check=False).returncode == 0
        calls.append((dict(env), threads, spinning))
        return {0: 8.0, 1: 10.0, 2: 4.0}[threads] * (0.5 if spinning else 1.0)

    monkeypatch.setattr(busybench, "_probe", fake_probe)
    report = busybench.measure_busy("m", tokens=5, rounds=2, cores=2)
    cond = report["conditions"]
    assert set(cond) == {"as is", "one busy process"}
    assert cond["as is"]["default_over_best_explicit"] == pytest.approx(0.8)
    assert cond["one busy process"]["tok_s"]["--threads 1"] == pytest.approx(5.0)
    assert len(calls) == 2 * 2 * len(busybench._variants(2))
    assert all(spin == (i >= len(calls) // 2) for i, (_, _, spin) in enumerate(calls))
    assert ({"HYBRIDRT_PASSIVE_WAIT": "0"}, 0, False) in calls
    text = busybench.format_report(report)
    assert "default / best --threads" in text and "0.80x" in text


def test_busy_bench_probe_runs_the_demo_model():
    assert busybench._probe(None, {}, 1, 3) > 0
