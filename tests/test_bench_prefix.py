"""``hybridrt bench prefix``: the shared workload's prefilled tokens are exactly what the cache
must save (the system message once, then each request's own tokens), the workload sharing
nothing reuses nothing, and a bad workload name is one line."""

from __future__ import annotations

import subprocess
import sys

from hybridrt.bench import prefix as prefixbench


def test_prefix_bench_counts_exactly_what_the_cache_saves(tmp_path):
    rep = prefixbench.run(None, threads=1, num_requests=4, system_tokens=64, question_tokens=8,
                          max_tokens=2, disjoint_requests=3, disjoint_tokens=20, rounds=1,
                          cache_memory="256MiB", json_path=tmp_path / "r.json", verbose=False,
                          cpu_time=True)
    assert rep["clock"] == "cpu"
    shared = rep["workloads"]["shared"]
    prompt = 64 + 8 + 2  # system, question, generation-prompt start + one token
    assert shared["off"]["prefilled_tokens"] == 4 * prompt
    # The first request computes all of it; the others resume where the prompts part: after
    # the system message and the next message's start token (the queue's branch point).
    assert shared["on"]["prefilled_tokens"] == prompt + 3 * (prompt - 65)
    assert shared["on"]["cached_tokens"] == 3 * 65
    assert shared["cache"]["hits"] == 3
    assert shared["today"]["prefilled_tokens"] == prompt + 3 * (prompt - 64)  # message start
    disjoint = rep["workloads"]["disjoint"]
    assert disjoint["on"]["prefilled_tokens"] == disjoint["off"]["prefilled_tokens"] == 3 * 20
    assert disjoint["cache"]["hit_tokens"] == 0
    assert (tmp_path / "r.json").exists()


def test_prefix_bench_document_questions_resume_after_the_document():
    """Questions about one document in one user message, submitted at once: with branch points
    every question after the first resumes after the document; with today's policy (message
    starts, the interval beyond the prompt) none does."""
    rep = prefixbench.run(None, threads=1, question_tokens=8, max_tokens=2, rounds=1,
                          workloads=("document",), document_tokens=300, document_questions=4,
                          cache_memory="256MiB", verbose=False)
    doc = rep["workloads"]["document"]
    prompt = 300 + 8 + 2
    assert doc["off"]["prefilled_tokens"] == doc["today"]["prefilled_tokens"] == 4 * prompt
    assert doc["on"]["prefilled_tokens"] == prompt + 3 * (prompt - 300)
    assert "| document | today / on |" in prefixbench.table(rep)


def test_prefix_bench_refuses_an_unknown_workload():
    r = subprocess.run([sys.executable, "-m", "hybridrt", "bench", "prefix", "--workloads",
                        "shared,nope"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "--workloads: unknown workload(s) ['nope']" in r.stderr
