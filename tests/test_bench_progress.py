"""Every ``hybridrt bench`` command that runs longer than a few seconds shows its progress bar
on stderr before its first long step (the model load, a server start, a subprocess) ends, and
the bar has counted every step it announced when the command is done; stdout keeps the table.
Tiny configurations; startup's and busy's subprocesses replaced by stand-ins (their own runs are
tested in test_cli.py and test_threads.py). ``bench throughput``'s bar: test_bench_throughput_
report.py; ``bench gemm`` (minutes at any size: its 0.8B shapes are fixed) is not run here."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

import hybridrt.llm
from hybridrt.bench import busy, gemv, preemption, progress, quality, serve, startup, steps
from hybridrt.bench.fixtures import TINY_TEXT_CONFIG

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tests/conftest.py


def stderr_at_first_call(monkeypatch, capsys, owner, name: str, stand_in=None) -> dict:
    """``owner.name`` replaced by a wrapper (around ``stand_in``, else the original) that keeps
    what stderr held when it was first called, in the returned dict's "err"."""
    seen: dict = {}
    real = stand_in or getattr(owner, name)

    def first(*args, **kwargs):
        if "err" not in seen:
            seen["err"] = capsys.readouterr().err
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, first)
    return seen


def assert_bar(seen: dict, capsys, desc: str, total: int, doing: str) -> None:
    """The bar ``desc`` with ``total`` steps was drawn, saying ``doing``, before the first long
    step ended, and counted to ``total`` by the end; nothing of it went to stdout."""
    assert "err" in seen, "the first long step never ran"
    assert re.search(rf"(^|[\r\n]){desc}: +0%\|.*\| 0/{total} ", seen["err"]), seen["err"]
    assert doing in seen["err"], seen["err"]
    rest = capsys.readouterr()
    assert f"| {total}/{total} " in rest.err, rest.err[-500:]
    assert f"{desc}:" not in rest.out and "%|" not in rest.out


def test_a_silent_bar_draws_nothing(capsys):
    b = progress.silent()
    b.update()
    progress.step(b, "x")
    b.close()
    assert capsys.readouterr().err == ""


def test_steps(monkeypatch, capsys):
    seen = stderr_at_first_call(monkeypatch, capsys, hybridrt.llm, "LLM")
    steps.run(None, batches=(1,), steps=2, rounds=1, threads=1, cache_memory="64MiB",
              max_model_len=128)
    assert_bar(seen, capsys, "steps", 3, "loading bfloat16")


def test_structured(monkeypatch, capsys):
    pytest.importorskip("llguidance")
    from hybridrt.bench import structured

    seen = stderr_at_first_call(monkeypatch, capsys, hybridrt.llm, "LLM")
    structured.run(None, threads=1, batches=(1,), rounds=1, tokens=4, cpu_time=True)
    assert_bar(seen, capsys, "structured", 5, "loading")


def test_preemption(monkeypatch, capsys, tmp_path):
    seen = stderr_at_first_call(monkeypatch, capsys, hybridrt.llm, "LLM")
    preemption.run_preemption_bench(None, dtype="float32", cache_memory="64MiB",
                                    max_model_len=128, long=(40, 8), short=(20, 4),
                                    num_short=2, threads=1, json_path=tmp_path / "p.json")
    assert_bar(seen, capsys, "preemption", 3, "loading")
    assert json.loads((tmp_path / "p.json").read_text())["rows"]


def test_quality(monkeypatch, capsys):
    seen = stderr_at_first_call(monkeypatch, capsys, quality, "_load")
    quality.run_quality(skip_08b=True, threads=1, max_docs=1)
    assert_bar(seen, capsys, "quality", 1 + len(quality.QUANTIZATIONS), "demo model, bf16")


def test_gemv(monkeypatch, capsys):
    from hybridrt.kernels import native

    if native.load() is None:
        pytest.skip("compiled kernels unavailable")
    seen = stderr_at_first_call(monkeypatch, capsys, gemv, "step_products")
    gemv.run_gemv_bench((1,), threads=1, repeats=1, config=TINY_TEXT_CONFIG)
    assert_bar(seen, capsys, "gemv", 4, "making the weights")


def test_startup(monkeypatch, capsys):
    phases = {"import_torch": 1.0, "import_hybridrt": 0.1, "load": 0.2, "first_token": 0.1,
              "dtype": "bfloat16", "threads": 1}

    def fake(args):
        rc = 2 if "-1" in args else 0
        return 0.5, subprocess.CompletedProcess(args, rc, json.dumps(phases) + "\n", "")

    seen = stderr_at_first_call(monkeypatch, capsys, startup, "_timed", fake)
    startup.run_startup_bench(None, runs=2, threads=1)
    assert_bar(seen, capsys, "startup", 8, "run 1: import torch")


def test_busy(monkeypatch, capsys):
    class Spinner:
        def kill(self):
            pass

        def wait(self):
            pass

    monkeypatch.setattr(busy, "_spinner", Spinner)
    seen = stderr_at_first_call(monkeypatch, capsys, busy, "_probe", lambda *a: 10.0)
    busy.measure_busy(None, tokens=2, rounds=1, cores=1)
    variants = len(busy._variants(1))
    assert_bar(seen, capsys, "busy", 2 * variants, "as is, round 1: default")


def test_serve(monkeypatch, capsys):
    pytest.importorskip("fastapi")
    seen = stderr_at_first_call(monkeypatch, capsys, serve, "_wait_healthy")
    report = serve.run(None, conversations=1, turns=2, max_tokens=2, time_limit=60, threads=1)
    assert [r["requests"] for r in report["runs"]] == [2, 2]
    assert_bar(seen, capsys, "serve", 4, "prefix reuse on: starting the server")


def test_spec(monkeypatch, capsys):
    from hybridrt.bench import spec
    from hybridrt.model_path import default_model

    seen = stderr_at_first_call(monkeypatch, capsys, hybridrt.llm, "LLM")
    spec.run_spec_bench(default_model(), ks=(0,), batch_sizes=(1,), quick=True, threads=1)
    assert_bar(seen, capsys, "spec", 3, "loading")


def test_prefix(monkeypatch, capsys):
    from hybridrt.bench import prefix

    seen = stderr_at_first_call(monkeypatch, capsys, hybridrt.llm, "LLM")
    prefix.run(None, threads=1, num_requests=2, system_tokens=64, question_tokens=8,
               max_tokens=2, rounds=1, cache_memory="256MiB", workloads=("shared",))
    assert_bar(seen, capsys, "prefix", 4, "loading the three engines")


def test_prefix_policy(monkeypatch, capsys):
    from hybridrt.bench import prefix_policy

    seen = stderr_at_first_call(monkeypatch, capsys, hybridrt.llm, "LLM")
    prefix_policy.run(None, threads=1, scale=0.05, max_tokens=2, cache_memory="256MiB",
                      max_model_len=512, chosen=("shared",))
    assert_bar(seen, capsys, "prefix-policy", 1 + len(prefix_policy.POLICIES), "loading")
